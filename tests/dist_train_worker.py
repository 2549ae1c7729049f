"""Run by test_train.py (under torchrun, or alone): train a BN-free MLP for a few steps, save rank 0's weights.

argv: DATASET OUT.pt BATCH ACCUM STEPS [CHECKPOINT_DIR [resume]]
With a checkpoint folder, the MLP has a dropout and the ranks are seeded apart (nanoGPT's ``1337 + rank``), so
each rank's random stream is its own; it checkpoints there (and resumes from it with ``resume``).
"""
import json
import sys
import weakref

import torch
import torch.distributed as dist

from fastdata.datasets.images import FastDataset
from fastdata.distributed import init_distributed, shutdown_distributed
from fastdata.errors import ConfigError
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.loading.loader import FastLoader
from fastdata.train.config import TrainConfig
from fastdata.train.trainer import Trainer

data, out, batch, accum, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ckpt, resume = (sys.argv[6:] + [None])[0], sys.argv[7:] == ["resume"]
info = init_distributed("cpu")
group = weakref.ref(dist.group.WORLD) if info.world_size > 1 else None
torch.manual_seed(0)
drop = [torch.nn.Dropout(0.5)] if ckpt else []
model = torch.nn.Sequential(torch.nn.Flatten(), *drop, torch.nn.Linear(8 * 8 * 3, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 3))
if ckpt:
    torch.manual_seed(1337 + info.rank)  # (DDP broadcasts rank 0's weights: only the draws differ by rank)
loader = CUDAPrefetcher(FastLoader(FastDataset(data), batch, seed=3), device="cpu")
val = CUDAPrefetcher(FastLoader(FastDataset(data), 10, shuffle=False, pad=False), device="cpu")
cfg = TrainConfig(epochs=5, max_steps=steps, lr=0.2, accum=accum, device="cpu", progress=False, schedule="constant",
                  checkpoint_dir=ckpt, resume=resume)
trainer = Trainer(model, loader, val, config=cfg)
initial = trainer.evaluate()  # the same weights on every world size: the metrics must not depend on it
trainer.fit()
metrics = trainer.evaluate()  # every rank evaluates its shard of the val set; the sums are all-reduced
draws = {"draws": torch.rand(3).tolist()} if ckpt else {}  # where this rank's random stream is now
with open(out + f".val{info.rank}.json", "w") as f:
    json.dump({**metrics, "initial": initial, **draws}, f)
if info.rank == 0:
    torch.save(model.state_dict(), out)
shutdown_distributed()  # closes the trainer: its DDP wrapper no longer holds the group
if group is not None and group() is not None:  # its gloo threads would run on into interpreter exit
    sys.exit("the process group outlived shutdown_distributed()")
if group is not None:
    try:
        trainer.fit()
    except ConfigError as exc:
        assert "closed" in str(exc), exc
    else:
        sys.exit("a Trainer closed by shutdown_distributed() went on training without its DDP wrapper")
