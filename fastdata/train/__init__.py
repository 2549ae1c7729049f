"""Training: the Trainer, its config, meter, stop signals, checkpoints, models, assembling a run."""
