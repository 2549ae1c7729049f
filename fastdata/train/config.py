"""What a training run does, as one validated frozen dataclass (``TrainConfig``), what a device can run, and
the optimizer settings it implies (weight-decay groups, the learning-rate schedule).

``fastdata train`` builds a TrainConfig from its flags, taking every default from here (one default per
option), so the CLI and the Python API behave alike.
"""
from __future__ import annotations

import math
import numbers
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import ConfigError, is_whole, require
from ..storage.object_store import RETRY_SECONDS

if TYPE_CHECKING:  # torch is imported where a device is checked: `fastdata preprocess` never loads it
    import torch

AMP = ("bf16", "fp16", "none")


def parse_duration(text: str | float | int | None) -> Optional[float]:
    """Seconds from ``DD:HH:MM:SS`` / ``HH:MM:SS`` / ``MM:SS`` / a number of seconds."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    try:
        parts = [float(p) for p in str(text).split(":")]
    except ValueError:
        raise ConfigError(f"max_time must look like DD:HH:MM:SS or a number of seconds, got {text!r}") from None
    if len(parts) > 4:
        raise ConfigError(f"max_time must look like DD:HH:MM:SS, got {text!r}")
    if not all(p >= 0 for p in parts):  # ("1:-30" summed to 30 s; nan compares False too)
        raise ConfigError(f"max_time's fields must be 0 or more, as in DD:HH:MM:SS, got {text!r}")
    return sum(p * m for p, m in zip(reversed(parts), (1, 60, 3600, 86400)))


COUNTS = ("epochs", "max_steps", "accum", "log_every", "checkpoint_keep", "warmup_steps", "checkpoint_every",
          "val_every", "val_every_steps", "early_stop_patience", "profile_steps")  # TrainConfig's whole numbers


@dataclass(frozen=True)
class TrainConfig:
    """Everything the training loop does, as one frozen dataclass validated on construction.

    The batch size belongs to the loader (per process), not here.
    ``fastdata train`` builds one from its flags, with these defaults.

    Args:
        epochs: Epochs to train (default None: 1 epoch, or as many as ``max_steps`` needs when it is set).
        max_steps: Stop after this many optimizer steps (default None: no bound).
        max_time: Stop after this many seconds; `parse_duration` reads ``"DD:HH:MM:SS"``
            (default None). Under DDP it is checked at log intervals.
        lr: The peak learning rate (default 0.1).
        optimizer: ``"sgd"`` (with momentum, Nesterov when ``momentum`` > 0) or ``"adamw"`` (default ``"sgd"``).
        momentum: SGD's momentum (default 0.9).
        weight_decay: Weight decay on weights only, never on norms or biases (default 5e-4).
        schedule: ``"cosine"`` (after warm-up), ``"onecycle"`` or ``"constant"`` (default ``"cosine"``).
        warmup_steps: Optimizer steps of linear warm-up (default 0; not with ``"onecycle"``, which warms up over
            its first 30% of steps).
        label_smoothing: The default loss's label smoothing, in [0, 1) (default 0.0).
        amp: Autocast precision: ``"bf16"``, ``"fp16"`` (with a GradScaler; CUDA only) or ``"none"`` (default).
        accum: Micro-batches accumulated per optimizer step (default 1).
        clip: The gradients' largest global norm (default None: no clipping).
        channels_last: Put a convolutional model and its images in channels_last (default True).
        compile: Run the model through ``torch.compile`` (default False).
        sync_bn: Use SyncBatchNorm under DDP (default False; CUDA only).
        cudnn_benchmark: Let cuDNN pick the fastest kernels for the fixed shapes (default True).
        checkpoint_dir: The folder of ``checkpoint.pt``, or a URL (``s3://bucket/run``, with the ``remote``
            extra) where a preempted job that comes back on another machine finds it (default None: no
            checkpoints).
        checkpoint_every: Also save every this many optimizer steps (default 0: at epoch ends and when stopping;
            needs ``checkpoint_dir``).
        checkpoint_keep: Checkpoint generations kept, >= 1: ``checkpoint.pt``, ``checkpoint.prev.pt``...
            (default 2; NOTE [checkpoint generations] in fastdata/train/checkpoint.py).
        resume: Continue from ``checkpoint_dir``'s newest intact checkpoint (default False); its ``optimizer``,
            ``lr``, ``weight_decay`` and ``momentum`` must be the checkpoint's (the optimizer's saved state holds
            them).
        retry_seconds: How long object storage may fail before a checkpoint save or load at a URL gives up
            (default 120; NOTE [retry budget] in fastdata/storage/object_store.py).
        val_every: Validate every this many epochs (default 1; 0: never at epoch ends).
        val_every_steps: Also validate every this many optimizer steps (default 0: never).
        early_stop_patience: Validations without an improvement of the validation loss before stopping
            (default 0: off; needs ``val_every`` or ``val_every_steps`` to validate, before ``max_steps``:
            `check_first_validation`).
        early_stop_min_delta: The least decrease of the validation loss that counts as an improvement
            (default 0.0).
        log_every: Optimizer steps per log record (default 50).
        log_file: A file that each log record is appended to as one JSON line, by rank 0 (default None).
        profile_steps: Run ``torch.profiler`` over the first this many steps (default 0: off).
        device: ``"auto"`` (CUDA when torch sees a GPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (default ``"auto"``).
        seed: The run's seed (default 0); ``fastdata train`` seeds torch and the loaders with it.
        progress: Show a progress bar and log lines on rank 0 (default True).

    Raises:
        ConfigError: A field is out of range; the message names the field and echoes the value. An option with
            nothing to act on is refused too: ``checkpoint_every`` without ``checkpoint_dir``,
            ``early_stop_patience`` where no validation runs, ``warmup_steps`` with the one-cycle schedule.

    Examples:
        >>> cfg = TrainConfig(epochs=16, lr=0.2, amp="bf16", warmup_steps=500, checkpoint_dir="runs/r50")
    """

    epochs: Optional[int] = None  # None: 1 epoch, or as many as max_steps needs when it is set
    max_steps: Optional[int] = None
    max_time: Optional[float] = None  # seconds ("00:12:00:00" through parse_duration); in DDP, at log intervals
    lr: float = 0.1
    optimizer: str = "sgd"  # "sgd" (momentum, nesterov) or "adamw"
    momentum: float = 0.9
    weight_decay: float = 5e-4  # applied to weights only: never to norms or biases
    schedule: str = "cosine"  # "cosine" (after warm-up), "onecycle", "constant"
    warmup_steps: int = 0
    label_smoothing: float = 0.0
    amp: str = "none"
    accum: int = 1
    clip: Optional[float] = None
    channels_last: bool = True
    compile: bool = False
    sync_bn: bool = False
    cudnn_benchmark: bool = True
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0  # optimizer steps; 0: at epoch ends and when stopping
    checkpoint_keep: int = 2  # generations kept: checkpoint.pt, checkpoint.prev.pt (NOTE [checkpoint generations])
    resume: bool = False
    retry_seconds: float = RETRY_SECONDS  # checkpoints at a URL: how long the store may fail
    val_every: int = 1  # epochs (0: never at epoch ends)
    val_every_steps: int = 0
    early_stop_patience: int = 0  # validations without improvement of val loss before stopping (0: off)
    early_stop_min_delta: float = 0.0
    log_every: int = 50
    log_file: Optional[str] = None
    profile_steps: int = 0
    device: str = "auto"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, expected: str) -> None:
            require(ok, name, getattr(self, name), expected)

        def number(value: Any) -> bool:  # (a bool is an int to Python; lr=inf made every weight nan)
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        for name in COUNTS:  # a whole float (max_steps=1e4) is its integer; 2.5 stays refused below
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
        # (max_steps=2.5 ran 3 steps, epochs=True one epoch)
        need(self.epochs is None or (is_whole(self.epochs) and self.epochs >= 1), "epochs",
             "a positive integer or None")
        need(self.max_steps is None or (is_whole(self.max_steps) and self.max_steps >= 1), "max_steps",
             "a positive integer or None")
        need(self.max_time is None or self.max_time > 0, "max_time", "positive seconds")
        need(number(self.lr) and self.lr > 0, "lr", "a positive number")
        need(self.optimizer in ("sgd", "adamw"), "optimizer", "'sgd' or 'adamw'")
        need(self.schedule in ("cosine", "onecycle", "constant"), "schedule", "'cosine', 'onecycle' or 'constant'")
        need(self.amp in AMP, "amp", f"one of {AMP}")
        need(is_whole(self.accum) and self.accum >= 1, "accum", "a positive integer")
        need(self.clip is None or self.clip > 0, "clip", "positive")
        need(0 <= self.label_smoothing < 1, "label_smoothing", "in [0, 1)")
        need(is_whole(self.log_every) and self.log_every >= 1, "log_every", "a positive integer")
        need(is_whole(self.checkpoint_keep) and self.checkpoint_keep >= 1, "checkpoint_keep",
             "a positive integer")
        for name in ("warmup_steps", "checkpoint_every", "val_every", "val_every_steps", "early_stop_patience",
                     "profile_steps"):  # (a negative warm-up made the learning rate negative)
            need(is_whole(getattr(self, name)) and getattr(self, name) >= 0, name, "0 or a positive integer")
        # (SGD's momentum of 1 or more diverges; AdamW reads none)
        need(number(self.momentum) and (self.optimizer != "sgd" or 0 <= self.momentum < 1), "momentum", "in [0, 1)")
        for name in ("weight_decay", "early_stop_min_delta"):  # (inf: every weight nan; no step ever better)
            need(number(getattr(self, name)) and getattr(self, name) >= 0, name, "0 or more")
        need(self.checkpoint_dir is None or str(self.checkpoint_dir).strip() != "", "checkpoint_dir",
             "a folder or a URL, or None for no checkpoints")
        if self.checkpoint_dir is not None:  # a Path too (saved in each checkpoint as a string: no pickled class)
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        need(isinstance(self.retry_seconds, (int, float)) and not isinstance(self.retry_seconds, bool)
             and 0 <= self.retry_seconds < float("inf"), "retry_seconds", "a number of seconds >= 0")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", "auto, cpu or cuda")
        self._refuse_without_effect()

    def _refuse_without_effect(self) -> None:
        """Refuse, by flag, options that this config gives nothing to act on: they are refused, not ignored
        (each was accepted and did nothing)."""
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError(f"--checkpoint-every {self.checkpoint_every} (checkpoint_every) needs a checkpoint "
                              "folder, and this run has none: give --checkpoint DIR (checkpoint_dir), or drop it")
        by_epochs = self.val_every and self.val_every <= self.num_epochs
        if self.early_stop_patience and not (by_epochs or self.val_every_steps):
            never = (f"--val-every {self.val_every} (val_every) is more than the run's {self.num_epochs} epoch(s)"
                     if self.val_every else "--val-every 0 (val_every)")
            raise ConfigError(f"--early-stop-patience {self.early_stop_patience} (early_stop_patience) needs "
                              f"validations, and this run makes none: {never} and --val-every-steps 0 "
                              "(val_every_steps) never validate; give either a number the run reaches, or drop it")
        if self.warmup_steps and self.schedule == "onecycle":
            raise ConfigError(f"--warmup-steps {self.warmup_steps} (warmup_steps) does nothing with --schedule "
                              "onecycle, which warms up over its first 30% of steps: drop it, or use --schedule "
                              "cosine or constant")

    @property
    def num_epochs(self) -> int:
        """``epochs``, or when unset: 1, unbounded if ``max_steps`` is set (the run stops at that step)."""
        if self.epochs is not None:
            return self.epochs
        return sys.maxsize if self.max_steps else 1


def check_device(cfg: TrainConfig, device: "torch.device") -> None:
    """Refuse settings ``device`` cannot run (``fastdata train`` calls it before opening any data)."""
    import torch

    if cfg.amp == "fp16" and device.type != "cuda":
        raise ConfigError("--amp fp16 needs a CUDA device (GradScaler): use --amp bf16 or none on the CPU "
                          "(amp='bf16' or 'none' in TrainConfig)")
    if cfg.sync_bn and device.type != "cuda":
        raise ConfigError("sync_bn needs CUDA devices (SyncBatchNorm has no CPU kernel): drop --sync-bn on the CPU")
    if cfg.amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("this GPU has no bf16 support: use amp='fp16'")


def check_first_validation(cfg: TrainConfig, epochs_steps: Callable[[int], Optional[int]]) -> None:
    """Refuse ``early_stop_patience`` where ``max_steps`` ends the run before its first validation: it did
    nothing (the Trainer calls it, knowing the loader). No validation is made at the run's end, and a stop at
    ``max_steps`` on an epoch's last step comes before that epoch's end and its validation.

    Args:
        cfg: The run's config.
        epochs_steps: The optimizer steps of the first N epochs (None when the loader has no ``len``).

    Raises:
        ConfigError: Naming ``--early-stop-patience``, ``--max-steps`` and the first validation's step.
    """
    if not (cfg.early_stop_patience and cfg.max_steps):
        return
    firsts = []  # (the least max_steps that reaches it, the first validation)
    if cfg.val_every_steps:
        firsts.append((cfg.val_every_steps, f"at step {cfg.val_every_steps} (--val-every-steps {cfg.val_every_steps} "
                                            "(val_every_steps))"))
    if cfg.val_every and cfg.val_every <= cfg.num_epochs:
        steps = epochs_steps(cfg.val_every)
        if steps is None:  # (epochs of unknown length: one may end first)
            return
        firsts.append((steps + 1, f"at the end of epoch {cfg.val_every} (--val-every {cfg.val_every} (val_every)), "
                                  f"which follows its last step, {steps}"))
    reach, first = min(firsts)  # (one at least: TrainConfig refused the run without validations)
    if cfg.max_steps < reach:
        raise ConfigError(f"--early-stop-patience {cfg.early_stop_patience} (early_stop_patience) needs validations, "
                          f"and this run makes none: --max-steps {cfg.max_steps} (max_steps) ends it before its "
                          f"first, {first}; give --max-steps {reach} or more, validate sooner with --val-every-steps "
                          "(val_every_steps), or drop it")


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate's factor at each optimizer step: warm-up + cosine, constant after warm-up, or one-cycle."""
    def f(step: int) -> float:
        if cfg.schedule == "onecycle":  # linear up for 30%, then cosine down to 0
            peak = max(1, int(0.3 * total_steps))
            if step < peak:
                return 0.04 + 0.96 * step / peak
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - peak) / max(1, total_steps - peak))))
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def param_groups(model: "torch.nn.Module", weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weights only: norms' scales and all biases (1-D parameters) are exempt."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
