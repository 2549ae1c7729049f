"""The training loop: AMP, DDP under torchrun, accumulation, clipping, checkpoints, early stopping.

One readable loop (``Trainer.fit``): every technique is visible where it happens. Metrics stay on the
device and are synchronised once per log interval; the data stall (time the step waited for its batch,
measured with CUDA events on a GPU) is reported with them.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .._io import disk_error, scrub
from ..distributed import broadcast_bytes, hold_group, init_distributed, release_group
from ..errors import ConfigError, OutputError
from ..storage.object_store import is_url
from . import checkpoint
from .config import TrainConfig, check_device, check_first_validation, lr_lambda, param_groups
from .meter import Meter, StepProfiler
from .models import is_convnet
from .stop import EarlyStops, signal_name

log = logging.getLogger("fastdata.train")  # the name users configure, kept by the move to train/trainer.py


def default_loss(label_smoothing: float) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """Cross-entropy on the targets: class logits ``(B, C)`` or a language model's ``(B, T, V)``; for a dict
    batch (sample fields), on its ``label``, else per pixel on its ``mask`` for ``(B, C, H, W)`` logits."""
    def loss(out: torch.Tensor, target: Any) -> torch.Tensor:
        if isinstance(target, dict):
            if "label" in target and out.ndim == 2:
                target = target["label"]
            elif "mask" in target and out.ndim == 4:
                return F.cross_entropy(out, target["mask"].long(), label_smoothing=label_smoothing)
            else:
                raise ConfigError(f"batches hold fields {sorted(target)}: pass Trainer(loss_fn=lambda out, batch: "
                                  "...) to say what the model's output is scored against")
        if out.ndim == 3:  # language model: (B, T, V) logits, (B, T) targets
            out, target = out.flatten(0, 1), target.flatten()
        return F.cross_entropy(out, target, label_smoothing=label_smoothing)
    return loss


class Trainer:
    """Train a model on a loader's batches: AMP, DDP under torchrun, accumulation, checkpoints, early stops.

    The data's way:

        train_loader (CUDAPrefetcher, or CPU batches moved here) -> model under autocast -> loss_fn
            -> backward (accumulated) -> clip -> optimizer and schedule step -> metrics on the device,
            synchronised once per log interval with the data stall -> checkpoints, validation, stops

    Loaders yield ``(inputs, targets)``, on the device already (CUDAPrefetcher) or on the CPU (moved here).
    A loader without ``len()`` (an iterable dataset's) needs ``max_steps``.
    Under torchrun, build the loaders after `init_distributed` so each serves its shard.
    A dataset with sample fields yields dicts: the model gets ``batch["image"]`` and ``loss_fn(out, batch)``
    the whole dict.
    With a checkpoint folder, SIGTERM or SIGUSR1 during `fit` stops it at a step boundary with a
    checkpoint (NOTE [stop signals]); ``stop_signal`` then holds the signal's number.

    Args:
        model: The module to train; it is moved to the device (channels_last for a convnet when
            ``config.channels_last``).
        train_loader: The training batches, iterated once per epoch.
        val_loader: The validation batches for `evaluate` (default None: no validation).
        config: What the loop does (`TrainConfig`).
        loss_fn: ``loss_fn(output, targets)`` -> a scalar tensor (default: cross-entropy on the targets; for a
            dict batch on its ``label``, or per pixel on its ``mask``; see `default_loss`).

    Raises:
        ConfigError: The checkpoint folder holds another run's checkpoint and ``resume`` is off, ``resume`` met a
            checkpoint trained with another optimizer, lr, weight decay or momentum, the training loader serves no
            batch, a loader without ``len()`` comes without ``max_steps``, or the device cannot
            run the config (fp16 or sync_bn on the CPU, bf16 on a GPU without it, CUDA where there is none).
        OutputError: The checkpoint folder cannot be written (at a URL: the store refuses a probe object).
        FormatError: ``resume`` met a checkpoint that cannot be read or does not fit the model.

    Examples:
        >>> train = CUDAPrefetcher(FastLoader(FastDataset("data/train"), 256), "cuda")
        >>> val = CUDAPrefetcher(FastLoader(FastDataset("data/val"), 256, shuffle=False, pad=False), "cuda")
        >>> trainer = Trainer(model, train, val, config=TrainConfig(epochs=16, amp="bf16"))
        >>> history = trainer.fit()  # a list of log records (dicts)
    """

    def __init__(self, model: nn.Module, train_loader: Any, val_loader: Any = None, *, config: TrainConfig,
                 loss_fn: Optional[Callable[[torch.Tensor, Any], torch.Tensor]] = None) -> None:
        cfg = self.cfg = config
        existing = self._checkpoint_path()
        # (checked before any process group is held; any generation kept counts: NOTE [checkpoint generations])
        if (existing is not None and not cfg.resume
                and checkpoint.existing(existing, cfg.checkpoint_keep, cfg.retry_seconds)):
            raise ConfigError(f"{scrub(str(existing))} holds another run's checkpoint, which this run would "
                              "overwrite: pass --resume (resume=True) to continue it, or choose another --checkpoint "
                              "folder (or delete it to start afresh)")
        try:
            batches: Optional[int] = len(train_loader)
        except TypeError:  # a DataLoader of an iterable dataset
            batches = None
        if batches == 0:  # else every epoch ends at once, and the run "finishes" having learnt nothing
            raise ConfigError("the training loader serves no batch in an epoch (its len() is 0): with drop_last, "
                              "a batch larger than a rank's share of the data is dropped whole; use a smaller "
                              "batch size or drop_last=False")
        if batches is None and not cfg.max_steps:
            raise ConfigError("the training loader has no len() (an iterable dataset): pass max_steps (--max-steps) "
                              "so that the run, and its learning-rate schedule, have a length")
        _check_validation(cfg, val_loader)
        check_first_validation(cfg, lambda epochs: _epochs_steps(train_loader, cfg, batches, epochs))
        self.dist = init_distributed(cfg.device)
        self.device = self.dist.device
        if cfg.checkpoint_dir and self.dist.main:  # rank 0 writes them
            checkpoint.prepare_folder(cfg.checkpoint_dir, cfg.retry_seconds)
        check_device(cfg, self.device)
        torch.backends.cudnn.benchmark = cfg.cudnn_benchmark  # pick the fastest conv kernels for fixed shapes
        check_ranks(train_loader, val_loader, self.dist.world_size)
        self.train_loader, self.val_loader = train_loader, val_loader
        self.channels_last = cfg.channels_last and is_convnet(model)
        layout = torch.channels_last if self.channels_last else torch.preserve_format
        model = model.to(self.device, memory_format=layout)
        # a process group (torchrun's, or one the caller made, even of one process): DDP and SyncBatchNorm
        grouped = self.dist.world_size > 1 or (dist.is_available() and dist.is_initialized())
        if cfg.sync_bn and grouped:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = model  # the module whose weights are saved
        if grouped:  # DDP broadcasts rank 0's weights: every rank starts identical
            ids = [self.device.index] if self.device.type == "cuda" else None
            model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.ddp = model if grouped else None
        self.forward = torch.compile(model) if cfg.compile else model
        if self.ddp is not None:
            hold_group(self)
        if cfg.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(param_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                             momentum=cfg.momentum, nesterov=cfg.momentum > 0)
        else:
            self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr)
        # the schedule spans the run: max_steps, or the epochs' steps where they end first
        by_epochs = _epochs_steps(train_loader, cfg, batches)
        self.total_steps = min(n for n in (cfg.max_steps, by_epochs) if n)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.amp == "fp16")
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        self.loss_fn = loss_fn or default_loss(cfg.label_smoothing)
        self.epoch = self.step = 0
        self.best: Optional[float] = None
        self.bad_evals = 0
        self._val_step: Optional[int] = None  # the step last validated: never twice at one step (same weights)
        self._val_due_at: Optional[int] = None  # the step whose validation is due (`_val_owed`)
        self.history: list[dict[str, Any]] = []
        self._waited = self._busy = 0.0  # seconds waiting for data / in logged intervals, for the whole run
        self._log_file = Path(cfg.log_file) if cfg.log_file and self.dist.main else None
        self.stop_signal: Optional[int] = None  # the signal fit() stopped on (NOTE [stop signals])
        self._stops = EarlyStops(False, None, alone=True)  # fit() makes the run's own
        self._saved_at: Optional[tuple[int, int]] = None  # (epoch, step) of the last checkpoint written
        self._saves = checkpoint.Saves()  # rank 0's: at a URL, one upload going on while training does
        if cfg.resume:
            self.load_checkpoint()


    # -- small helpers --------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        on = self.amp_dtype is not None
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if on else contextlib.nullcontext()

    def _to_device(self, t: torch.Tensor, image: bool = False) -> torch.Tensor:
        t = t.to(self.device, non_blocking=True)
        return t.contiguous(memory_format=torch.channels_last) if image and self.channels_last and t.ndim == 4 else t

    def _inputs(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """``(model input, targets)`` on the device: ``(x, y)``, or a dict batch's image and the whole dict."""
        if isinstance(batch, dict):
            moved = {k: self._to_device(v, image=k == "image") for k, v in batch.items()}
            return moved["image"], moved
        return self._to_device(batch[0], image=True), self._to_device(batch[1])

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self._log_file is not None:
            try:
                with open(self._log_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as exc:  # the run stops: the user asked for this log (a checkpoint resumes it)
                raise disk_error(exc, self._log_file, "free space there or give --log-file another path, then "
                                                      "rerun (with --resume if it has a --checkpoint)") from exc

    def _reduce(self, *values: torch.Tensor) -> list[float]:
        """Sum across ranks and bring to the host: the one sync of a log interval."""
        stacked = torch.stack([v.double() for v in values])
        if self.dist.world_size > 1:
            dist.all_reduce(stacked)
        return stacked.tolist()

    def close(self) -> None:
        """Drop the DDP wrapper, which holds the process group (`shutdown_distributed` closes every
        live Trainer before it frees the group). The trainer then refuses to train; ``evaluate`` and
        ``save_checkpoint`` still work for as long as the group exists."""
        if self.ddp is not None:
            self.ddp = None
            self.forward = self.model
            release_group(self)

    # -- the loop -------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train until the last epoch ends, ``max_steps`` or ``max_time`` is reached, early stopping or a signal.

        Returns:
            The log records of the run so far (``history``): ``"train"`` records per log interval (loss, accuracy,
            lr, samples per second, data stall), validation records, and an ``"end"`` record with the reason.

        Raises:
            ConfigError: The trainer was closed by `shutdown_distributed`.
            OutputError: A checkpoint or the log file cannot be written (DiskFullError when the disk is full).
        """
        if self.dist.world_size > 1 and self.ddp is None:  # closed: see close()
            raise ConfigError("this Trainer was closed (shutdown_distributed() closes every Trainer): "
                              "build a new one after init_distributed() to train again")
        cfg = self.cfg
        start = time.monotonic()
        bar = self._progress()
        traces = self._checkpoint_path()  # beside the checkpoints, or here when they go to a URL
        traces = traces.parent if isinstance(traces, Path) else Path(".")
        ended = self._ended()  # a resumed run that had finished (a requeued job always passes --resume)
        profiler = StepProfiler(cfg.profile_steps, self.device, traces, self.dist.main,
                                self._waited) if cfg.profile_steps and not ended else None
        with EarlyStops(cfg.checkpoint_dir is not None, cfg.max_time, self.dist.world_size == 1) as self._stops:
            try:
                # first the validation a stop left owed (NOTE [stop signals]); an ended run's stop saved where it was
                stop = self._owed_validation(ended) or ended or self._epochs(bar, profiler)
            except BaseException:  # an error, Ctrl-C: the save on its way still lands (rank 0 alone, no collective)
                if self.dist.main:
                    self._saves.finish(quiet=True)
                raise
            self._finish_saves()  # (within: a signal meanwhile is the run's, NOTE [stop signals])
        self.stop_signal = self._stops.signal
        if profiler is not None:
            profiler.stop(self._waited)
        if bar is not None:
            bar.close()
        reason = f"signal {signal_name(self.stop_signal)}" if self.stop_signal else stop or "epochs"
        summary = {"event": "end", "reason": reason, "epoch": self.epoch, "step": self.step, "time_s":
                   time.monotonic() - start, "data_stall_pct": 100 * self._waited / max(self._busy, 1e-9)}
        self._log(summary)
        if self.dist.main and cfg.progress:
            log.info("stopped (%s) after %d steps in %.1f s; data stall %.1f%%", summary["reason"], self.step,
                     summary["time_s"], summary["data_stall_pct"])
        return self.history

    def _epochs(self, bar: Any, profiler: Optional[StepProfiler]) -> Optional[str]:
        """Train until the last epoch ends (returns None) or a stop says why it came early."""
        cfg, model = self.cfg, self.forward
        stop: Optional[str] = None
        while self.epoch < cfg.num_epochs and stop is None:
            _set_epoch(self.train_loader, self.epoch)
            model.train()
            meter = Meter(self.device)
            micro = 0
            batches = iter(self.train_loader)
            while True:
                meter.wait_begin()
                batch = next(batches, None)  # the only place the loop can wait for data
                if batch is None:
                    break
                x, y = self._inputs(batch)
                meter.wait_end()
                micro += 1
                last_micro = micro % cfg.accum == 0
                # DDP all-reduces gradients in backward; skip that on all but the last micro-step.
                sync = contextlib.nullcontext() if (self.ddp is None or last_micro) else self.ddp.no_sync()
                with sync:
                    with self._autocast():
                        out = _forward(model, x)
                        loss = self.loss_fn(out, y)
                    self.scaler.scale(loss / cfg.accum).backward()
                meter.add(loss.detach(), out.detach(), y)
                if last_micro:
                    self._optimizer_step()
                    stop = self._stepped(meter, bar, profiler)  # (saved while the iteration is live: a
                    if stop:  # look-ahead's batches are not counted as served)
                        break
            if stop is None:  # the batches ran out
                stop = self._epoch_end(meter, bar, profiler, micro % cfg.accum)
            elif meter.has_data():
                self._log_interval(meter, bar)  # the stopped epoch's last, partial interval
        return stop

    def _epoch_end(self, meter: Meter, bar: Any, profiler: Any, micros: int) -> Optional[str]:
        """The epoch's batches ran out (its loader moved on to the next epoch): the step of an accumulation they
        left unfinished (``micros`` micro-batches), then the epoch's validation and checkpoint; a stop at that
        step skips them, as a stop at any step does (its checkpoint owes the validation: `_owed_validation`)."""
        cfg = self.cfg
        self.epoch += 1  # (first: a checkpoint at the step below resumes past this epoch's batches, as its loader)
        due = self.val_loader is not None and cfg.val_every and self.epoch % cfg.val_every == 0
        if due:  # at the epoch's last step: a stop there saves it as owed (NOTE [stop signals])
            self._val_due_at = self.step + (1 if micros else 0)
        stop = None
        if micros:  # an epoch that ends mid-accumulation still steps, as any step
            self._partial_accumulation(micros)
            self._optimizer_step()
            stop = self._stepped(meter, bar, profiler)
        if meter.has_data():
            self._log_interval(meter, bar)  # the epoch's last, partial interval
        if stop:
            return stop
        if due and self._val_step != self.step:  # (validated at this step already: the same weights, whose second
            stop = self._validate_and_check()  # loss would count as no improvement)
        self.save_checkpoint(wait=False)
        return stop or self._stops.due()

    def _stepped(self, meter: Meter, bar: Any, profiler: Any) -> Optional[str]:
        """What follows every optimizer step (`_after_step`); a stop is saved at its step."""
        stop = self._after_step(meter, bar, profiler)
        if stop and self._saved_at != (self.epoch, self.step):  # (NOTE [stop signals]: a repeated signal
            self.save_checkpoint(wait=False)  # meanwhile is ignored; fit waits for it)
        return stop

    def _ended(self) -> Optional[str]:
        """Why a resumed run has nothing left to train (said on rank 0), or None: it reached ``max_steps``, or
        its early stopping had fired (its ``bad_evals`` reached ``early_stop_patience``)."""
        cfg = self.cfg
        if cfg.max_steps and self.step >= cfg.max_steps:
            reason, why = "max_steps", f"reached --max-steps {cfg.max_steps}: give a larger one to train on"
        elif cfg.early_stop_patience and self.bad_evals >= cfg.early_stop_patience:
            reason, why = "early_stop", (f"stopped early ({self.bad_evals} validations without improvement): "
                                         "raise --early-stop-patience to train on")
        else:
            return None
        if self.dist.main:
            log.warning("the resumed run had already ended at step %d: it %s; nothing to train", self.step, why)
        return reason

    def _val_owed(self) -> bool:
        """Whether the validation due at this step (``val_every_steps``, or the epoch's end) has not run: a
        stop saves before it (NOTE [stop signals]), and the checkpoint says so (``val_due``)."""
        return self.val_loader is not None and self._val_due_at == self.step and self._val_step != self.step

    def _owed_validation(self, ended: Optional[str]) -> Optional[str]:
        """Run the validation owed at this step (`_val_owed`) before any other, as the run that was not stopped
        did there, saved at once; ``"early_stop"`` when it ends the run. A run that had ended at ``max_steps`` owes
        only that step's ``val_every_steps`` validation (``max_steps`` skips the epoch's end), one that stopped early
        none."""
        cfg = self.cfg
        by_steps = cfg.val_every_steps and self.step % cfg.val_every_steps == 0
        if not self._val_owed() or ended == "early_stop" or (ended == "max_steps" and not by_steps):
            return None
        stop = self._validate_and_check()
        self.save_checkpoint(wait=False)  # now (with checkpoints): a run stopped again, or killed, before its next
        return stop  # save would make it again, and lose its best and bad_evals meanwhile

    def _partial_accumulation(self, micros: int) -> None:
        """An epoch ended after ``micros`` of ``accum`` micro-batches: their gradients, as one batch of them, and
        averaged over ranks here (they ran under ``no_sync()``: ranks stepped on their own and drifted apart)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.ddp is not None:
            for g in grads:  # once an epoch
                dist.all_reduce(g)
        torch._foreach_mul_(grads, self.cfg.accum / micros / (self.dist.world_size if self.ddp is not None else 1))

    def _optimizer_step(self) -> None:
        cfg = self.cfg
        if cfg.clip is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the fp16-scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)  # frees gradient memory instead of writing zeros
        self.scheduler.step()
        self.step += 1

    def _after_step(self, meter: Meter, bar: Any, profiler: Any) -> Optional[str]:
        cfg = self.cfg
        if profiler is not None:
            profiler.step(self.step, self._waited)
        if self.step % cfg.log_every == 0:
            self._log_interval(meter, bar)
        due = self.val_loader is not None and cfg.val_every_steps and self.step % cfg.val_every_steps == 0
        if due:
            self._val_due_at = self.step
        stop = self._stops.due()
        if stop:  # saved with its validation owed, not made: NOTE [stop signals]
            return stop
        if due and self._validate_and_check():
            return "early_stop"  # (saved by the caller, with this validation)
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:  # after the step's validation: a
            self.save_checkpoint(wait=False)  # resumed run's early stopping starts from its best and bad_evals
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        return None

    def _log_interval(self, meter: Meter, bar: Any) -> None:
        samples = torch.tensor(float(meter.samples), device=self.device, dtype=torch.float64)
        loss_sum, correct, count, samples_all = self._reduce(meter.loss_sum, meter.correct, meter.count, samples)
        if self.dist.world_size > 1:  # NOTE [agreed stops]: a stop any rank sees is every rank's, at this step
            seen = torch.tensor(self._stops.view(), device=self.device, dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            self._stops.agree(seen.tolist())
        waited, total = meter.wait_and_total()
        self._waited, self._busy = self._waited + waited, self._busy + total
        stall = 100 * waited / max(total, 1e-9)
        elapsed = max(1e-9, meter.elapsed())
        record = {"event": "train", "epoch": self.epoch, "step": self.step, "loss": loss_sum / max(1, count),
                  "accuracy": correct / max(1, count), "lr": self.scheduler.get_last_lr()[0],
                  "samples_per_s": samples_all / elapsed, "data_stall_pct": stall}
        if count != samples_all:  # several targets per sample (language models): report tokens too
            record["tokens_per_s"] = count / elapsed
        sources = getattr(getattr(self.train_loader, "dataset", None), "interval_report", None)
        if sources is not None:  # a Mixture: each source's samples/s and share in this interval (this rank's)
            record["sources"] = sources(elapsed)
        self._log(record)
        if bar is not None:
            bar.update(self.step - bar.n)
            rate = {"tok_s": f"{record['tokens_per_s']:.0f}"} if "tokens_per_s" in record else \
                {"img_s": f"{record['samples_per_s']:.0f}"}
            bar.set_postfix(loss=f"{record['loss']:.3f}", **rate, stall=f"{stall:.1f}%")
        meter.reset()

    # -- validation and early stopping ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader: Any = None) -> dict[str, float]:
        """Loss and accuracy over ``loader`` (the validation loader), summed over every rank's shard.

        Runs no collective per batch (the module without its DDP wrapper), so ranks may serve different
        batch counts: a loader with ``pad=False`` gives exact metrics, each sample counted once.
        """
        loader = loader if loader is not None else self.val_loader
        forward = self.forward if self.ddp is None else self.model
        self.forward.eval()
        meter = Meter(self.device)  # the training loop's sums, on the device until the one reduce below
        language_model = False
        for batch in loader:
            x, y = self._inputs(batch)
            with self._autocast():
                out = _forward(forward, x)
                loss = self.loss_fn(out, y)
            meter.add(loss, out, y)
            language_model = out.ndim == 3
        self.forward.train()
        loss_sum_, correct_, count_ = self._reduce(meter.loss_sum, meter.correct, meter.count)
        metrics = {"val_loss": loss_sum_ / max(1, count_), "val_accuracy": correct_ / max(1, count_)}
        if count_ and language_model:
            metrics["val_perplexity"] = math.exp(min(metrics["val_loss"], 50.0))
        return metrics

    def _validate_and_check(self) -> Optional[str]:
        metrics = self.evaluate()
        self._val_step = self.step
        self._log({"event": "val", "epoch": self.epoch, "step": self.step, **metrics})
        if self.dist.main and self.cfg.progress:
            ppl = f", perplexity {metrics['val_perplexity']:.2f}" if "val_perplexity" in metrics else ""
            log.info("epoch %d step %d: val loss %.4f, accuracy %.1f%%%s", self.epoch, self.step,
                     metrics["val_loss"], 100 * metrics["val_accuracy"], ppl)
        if self.best is None or self.best - metrics["val_loss"] > self.cfg.early_stop_min_delta:
            self.best, self.bad_evals = metrics["val_loss"], 0
            return None
        self.bad_evals += 1
        if self.cfg.early_stop_patience and self.bad_evals >= self.cfg.early_stop_patience:
            return "early_stop"
        return None

    # -- checkpoints ----------------------------------------------------------------------------------
    def _checkpoint_path(self) -> Optional[checkpoint.Location]:
        return checkpoint.location(self.cfg.checkpoint_dir) if self.cfg.checkpoint_dir else None

    def save_checkpoint(self, wait: bool = True) -> None:
        """Everything needed to continue exactly here, written atomically by rank 0 (see train/checkpoint.py).

        Args:
            wait: At a URL, return once the checkpoint is in the store (default); False: once its state is
                serialised, the upload going on while training does (``fit`` saves so and waits at its end;
                NOTE [checkpoint generations] rule 5).

        Raises:
            OutputError: This save, or an upload before it, failed (on every rank: rank 0's reason).
        """
        path = self._checkpoint_path()
        if path is None:
            return
        loader_state = self.train_loader.state_dict() if hasattr(self.train_loader, "state_dict") else None
        rng_ranks = checkpoint.rng_states_of_ranks()  # (a collective: on every rank)
        failed: Optional[Exception] = None
        if self.dist.main:
            rng = {"rng": checkpoint.rng_state()}
            if rng_ranks is not None:  # (rank 0's stays under "rng", where any version reads it)
                rng = {"rng": rng_ranks[0], "rng_ranks": rng_ranks}
            try:
                self._saves.save(path, keep=self.cfg.checkpoint_keep, retry_seconds=self.cfg.retry_seconds,
                                 wait=wait, label=f"step {self.step}", state={
                                     "model": self.model.state_dict(), "model_class": type(self.model).__name__,
                                     "optimizer": self.optimizer.state_dict(),
                                     "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                                     "loader": loader_state, "epoch": self.epoch, "step": self.step,
                                     "best": self.best, "bad_evals": self.bad_evals, "val_step": self._val_step,
                                     "val_due": self._val_owed(), "config": self._config_saved(), **rng})
            except Exception as exc:  # noqa: BLE001 - told to the other ranks below, then raised here
                failed = exc
        self._agree(failed)
        self._saved_at = (self.epoch, self.step)

    def _finish_saves(self) -> None:
        """Wait for the checkpoint upload under way (rank 0), on every rank: its error is every rank's."""
        failed: Optional[Exception] = None
        if self.dist.main:
            try:
                self._saves.finish()
            except Exception as exc:  # noqa: BLE001 - told to the other ranks below, then raised here
                failed = exc
        self._agree(failed)

    def _agree(self, failed: Optional[Exception]) -> None:
        """Raise rank 0's ``failed`` on every rank (a collective; not a barrier, where the others would wait for
        a rank that had raised)."""
        if self.dist.world_size > 1:
            said = broadcast_bytes(scrub(str(failed) or type(failed).__name__).encode() if failed else b"")
            if failed is None and said:
                raise OutputError(f"rank 0 could not save the checkpoint: {said.decode()}")
        if failed is not None:
            raise failed

    def _config_saved(self) -> dict[str, Any]:
        """The config as a checkpoint records it: a URL's secrets never go into a file."""
        cfg = asdict(self.cfg)
        if is_url(cfg["checkpoint_dir"] or ""):
            cfg["checkpoint_dir"] = scrub(cfg["checkpoint_dir"])
        return cfg

    def load_checkpoint(self) -> bool:
        """Continue from (rank 0's) ``checkpoint_dir/checkpoint.pt`` if it exists; returns whether it did."""
        path = self._checkpoint_path()
        if path is None:
            raise ConfigError("resume=True needs checkpoint_dir (--checkpoint DIR)")
        grouped = self.dist.world_size > 1
        chosen, data = (checkpoint.newest(path, self.cfg.checkpoint_keep, self.cfg.retry_seconds) if self.dist.main
                        else (None, None))
        data = checkpoint.rank0_bytes(chosen, self.dist.main, data) if grouped else data
        if (grouped and data is None) or (not grouped and chosen is None):
            return False
        state = checkpoint.read(chosen or path, self.device, self.model, data)
        saved = (state.get("config") or {}).get("optimizer")
        if saved is not None and saved != self.cfg.optimizer:  # (torch loads another's state, then fails mid-step)
            raise ConfigError(f"checkpoint {scrub(str(chosen or path))} was trained with --optimizer {saved}, this "
                              f"run asks for {self.cfg.optimizer}: resume with --optimizer {saved} "
                              f"(optimizer={saved!r}), or use another --checkpoint folder")
        self._check_settings(state, scrub(str(chosen or path)))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if state["loader"] is not None and hasattr(self.train_loader, "load_state_dict"):
            _check_split(self.train_loader, state["loader"])
            self.train_loader.load_state_dict(state["loader"])
        elif self.dist.main:
            log.warning("the training loader has no state_dict(): the resumed run reads its data from the start")
        self.epoch, self.step = state["epoch"], state["step"]
        self.best, self.bad_evals = state["best"], state["bad_evals"]
        self._val_step = state.get("val_step")  # (absent from checkpoints saved before it)
        self._val_due_at = self.step if state.get("val_due") else None  # (likewise)
        self._set_rng(state, scrub(str(chosen or path)))
        if self.dist.main and self.cfg.progress:
            log.info("resumed from %s: epoch %d, step %d", scrub(str(chosen)), self.epoch, self.step)
        return True

    def _check_settings(self, state: dict[str, Any], where: str) -> None:
        """Refuse another lr, weight decay or momentum than the checkpoint's, as another optimizer is refused:
        its optimizer and scheduler states put the saved ones back, while the config saved with the run claimed
        the new ones. Applying them instead would break what a resume promises, the weights of a run never
        stopped (docs/training.md), for a requeued job whose flags changed by mistake."""
        cfg = self.cfg
        group = (state["optimizer"].get("param_groups") or [{}])[0]  # (param_groups: the decay group first)
        lr = (state["scheduler"].get("base_lrs") or [group.get("initial_lr")])[0]
        saved = {"lr": lr, "weight_decay": group.get("weight_decay"),
                 "momentum": group.get("momentum") if cfg.optimizer == "sgd" else None}  # (AdamW reads none)
        changed = [(name, was) for name, was in saved.items() if isinstance(was, (int, float))
                   and not math.isclose(was, getattr(cfg, name), rel_tol=1e-9, abs_tol=1e-12)]
        if not changed:
            return

        def named(name: str, value: float, said: str = "") -> str:  # "--flag value (keyword=value)", as all do
            flag = {"lr": "--lr", "weight_decay": "--weight-decay"}.get(name)  # (Python alone sets momentum)
            return f"{flag} {value!r} ({name}={value!r})" if flag else f"{name}={value!r}{said}"

        was = " and ".join(named(name, value, " (TrainConfig's: fastdata train has no flag for it)")
                           for name, value in changed)
        now = " and ".join(named(name, getattr(cfg, name)) for name, _ in changed)
        raise ConfigError(f"checkpoint {where} was trained with {was}, this run asks for {now}: a resumed run goes "
                          "on with its saved optimizer state, which holds them; resume with the checkpoint's values, "
                          "or train a new run with the new ones in another --checkpoint folder (checkpoint_dir)")

    def _set_rng(self, state: dict[str, Any], where: str) -> None:
        """Each rank's own random state where the checkpoint has every rank's at this world size; else rank 0's,
        on every rank (said once: ranks seeded apart then draw alike)."""
        ranks, world = state.get("rng_ranks"), self.dist.world_size
        if ranks is not None and len(ranks) == world:
            checkpoint.set_rng_state(ranks[self.dist.rank])
            return
        if self.dist.main and (ranks is not None or world > 1):
            log.warning("checkpoint %s holds the random states of %d rank(s), this run has %d: every rank resumes "
                        "rank 0's (ranks seeded apart draw other dropout masks than a run never stopped would)",
                        where, len(ranks) if ranks is not None else 1, world)
        checkpoint.set_rng_state(state["rng"])

    # -- progress bar and profiler --------------------------------------------------------------------
    def _progress(self) -> Any:
        if not (self.cfg.progress and self.dist.main):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)


def _epochs_steps(loader: Any, cfg: TrainConfig, batches: Optional[int],
                  epochs: Optional[int] = None) -> Optional[int]:
    """Optimizer steps in the first ``epochs`` (default ``cfg.epochs``) epochs of ``loader`` (None without
    ``len``): a Mixture's epochs that end with their sources (``stop``) differ in length, and its sampler counts
    each (`epochs_batches`); any other loader's are ``len(loader)`` each. An epoch's last, partial accumulation
    is a step too."""
    if batches is None:
        return None
    epochs = cfg.epochs if epochs is None else epochs
    samplers = (getattr(layer, "sampler", None) for layer in _layers(loader))
    sampler = next((s for s in samplers if hasattr(s, "epochs_batches")), None)
    if epochs is not None and sampler is not None:
        return sum(max(1, math.ceil(b / cfg.accum)) for b in sampler.epochs_batches(epochs))
    return (epochs or cfg.num_epochs) * max(1, math.ceil(batches / cfg.accum))


def _forward(model: Any, x: Any) -> Any:
    """``model(x)``; a uint8 NHWC batch that the model cannot take (a FastLoader's, not converted) says how
    to convert it, instead of torch's "Input type (unsigned char) and bias type (float)"."""
    try:
        return model(x)
    except RuntimeError as exc:
        if (isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.ndim == 4
                and not isinstance(exc, torch.cuda.OutOfMemoryError)):  # (a model that converts them itself)
            raise ConfigError(f"the model got uint8 images of shape {tuple(x.shape)} (NHWC), as FastLoader serves "
                              "them, and failed on them: wrap the loader in CUDAPrefetcher(loader, device=...) (on "
                              "the CPU too), which converts them to normalised float NCHW, or convert them in "
                              f"the model ({str(exc).splitlines()[0][:120]})") from exc
        raise


def check_ranks(train_loader: Any, val_loader: Any, world_size: int) -> None:
    """Refuse loaders dealt to other ranks than the run has (made before `init_distributed`: every rank would
    train on the whole epoch). A validation loader on one rank's order is the whole set on each rank: valid,
    `Trainer.evaluate` sums over ranks.

    Raises:
        ConfigError: naming the loader, its ranks and the run's.
    """
    for name, loader in (("training", train_loader), ("validation", val_loader)):
        made_for = _ranks_of(loader)
        whole = name == "validation" and made_for == 1
        if made_for is not None and made_for != world_size and not whole:
            raise ConfigError(f"the {name} loader deals its data to {made_for} rank(s), this run has {world_size}: "
                              "make loaders after fastdata.init_distributed() (the Trainer joins the group then), "
                              "or pass rank and world_size")


def _check_split(loader: Any, state: Any) -> None:
    """Refuse, naming the split, a loader state saved with --val-fraction on a run without it, or the other way
    round. A state of the whole dataset has no split key to compare, so the loader's count check answered
    first and called it another dataset. Anything else is left to the loader's own checks."""
    ds = getattr(loader, "view", None)  # (a DALILoader's split: its dataset is the loader itself)
    ds = getattr(loader, "dataset", None) if ds is None else ds
    samples = getattr(getattr(loader, "sampler", None), "num_samples", None)
    if not isinstance(state, dict) or "mixture" in state or not isinstance(state.get("num_samples"), int) or \
            not isinstance(samples, int):
        return
    saved, version = state.get("dataset_sha256"), getattr(loader, "manifest_sha256", None)
    version = version if version is not None else getattr(ds, "manifest_sha256", None)
    if saved is not None and version is not None and saved != version:
        return  # another version of the dataset: the loader says so
    was, now, n = _fraction(state.get("dataset_key")), _fraction(getattr(ds, "state_key", None)), state["num_samples"]
    base = getattr(ds, "base", None)  # (a split's dataset)
    if was is None and now is not None and base is not None and n == len(base) != samples:
        raise ConfigError(f"the checkpoint's loader state is for all {n} samples of the dataset, and this run trains "
                          f"on the train split of --val-fraction {now} ({samples} samples): resume without "
                          "--val-fraction, as the run started, or start the run over")
    if was is not None and now is None and n != samples:
        raise ConfigError(f"the checkpoint's loader state is for the train split of --val-fraction {was} ({n} "
                          f"samples), and this run trains on all {samples} samples of the dataset: resume with "
                          f"--val-fraction {was}, as the run started, or start the run over")


def _fraction(key: Any) -> Optional[float]:
    """A split's --val-fraction, from its state key (None: no split)."""
    return key.get("val_fraction") if isinstance(key, dict) else None


def _check_validation(cfg: TrainConfig, val_loader: Any) -> None:
    """Refuse validation settings a run without a validation loader would silently ignore."""
    if val_loader is not None:
        return
    for name, flag in (("val_every_steps", "--val-every-steps"), ("early_stop_patience", "--early-stop-patience")):
        if getattr(cfg, name):
            raise ConfigError(f"{flag} {getattr(cfg, name)} ({name}) needs validation data, and this run has none: "
                              "give --val DATA or --val-fraction (a val_loader in Python), or drop it")


def _layers(loader: Any) -> Iterator[Any]:
    """``loader``, then the loader it wraps (a prefetcher's), then one wrapped once more: no deeper nesting is
    made here."""
    for _ in range(3):
        if loader is None:
            return
        yield loader
        loader = getattr(loader, "loader", None)


def _set_epoch(loader: Any, epoch: int) -> None:
    """Select ``epoch`` on ``loader``, and on the samplers of a torch DataLoader beneath it (itself, or a
    prefetcher's): its DistributedSampler replays one order every epoch unless told. A fastdata loader
    selects its own sampler's epoch, so that sampler is told once."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    layer = next((layer for layer in _layers(loader) if not hasattr(layer, "set_epoch")), None)
    if layer is None:  # (fastdata loaders all the way down)
        return
    told: list[Any] = []  # a DataLoader: its sampler and batch sampler (one object, maybe)
    for sampler in (getattr(layer, "sampler", None), getattr(layer, "batch_sampler", None)):
        if hasattr(sampler, "set_epoch") and not any(sampler is s for s in told):
            sampler.set_epoch(epoch)
            told.append(sampler)


def _ranks_of(loader: Any) -> Optional[int]:
    """The ranks ``loader``'s order was dealt to: its sampler's (FastLoader, DALILoader, a DataLoader with a
    DistributedSampler or a DistributedBatchSampler), through a prefetcher's loader; None when it does not say."""
    for layer in _layers(loader):
        for attr in ("sampler", "batch_sampler"):
            sampler = getattr(layer, attr, None)
            ranks = getattr(sampler, "world_size", getattr(sampler, "num_replicas", None))
            if isinstance(ranks, int):
                return ranks
    return None
