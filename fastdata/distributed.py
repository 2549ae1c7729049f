"""Which process am I: rank, world size, device and the torch.distributed process group, in one place.

``dist_rank_world`` answers for the samplers and the prefetcher, ``is_main_rank`` for progress bars and
logs (without importing torch, so preprocessing workers stay light), ``resolve_device`` reads
``device="auto"``, and ``init_distributed`` / ``shutdown_distributed`` join and leave the group under
torchrun. Objects that hold the group (a Trainer's DDP wrapper) register with `hold_group` so that
``shutdown_distributed`` can release them first.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ._io import user_stacklevel
from .errors import ConfigError

if TYPE_CHECKING:
    import torch


def dist_rank_world(rank: Optional[int] = None, world_size: Optional[int] = None) -> tuple[int, int]:
    """``(rank, world_size)``: the arguments when given, else ``torch.distributed``'s, else ``(0, 1)``."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    if world_size is None and _torchrun_world() > 1:
        warnings.warn(f"torchrun started {_torchrun_world()} processes but none has joined a process group yet: "
                      "this order serves the whole dataset on every rank; call fastdata.init_distributed() before "
                      "making loaders (or pass rank and world_size)", UserWarning, stacklevel=user_stacklevel())
    rank, world_size = (0 if rank is None else rank), (1 if world_size is None else world_size)
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ConfigError(f"rank must be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
    return rank, world_size


def _torchrun_world() -> int:
    """torchrun's ``WORLD_SIZE`` (1 when unset or not a number)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _joined() -> Any:
    """``torch.distributed`` when this process has joined a group, else None; never imports torch:
    ``fastdata preprocess`` and its workers run without it."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def is_main_rank() -> bool:
    """Rank 0 of the process group when one is joined, else of torchrun's ``RANK`` (0 when unset).
    Never imports torch."""
    dist = _joined()
    if dist is not None:
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def resolve_device(device: Any = "auto") -> "torch.device":
    """``"auto"`` is CUDA when torch sees a GPU, else the CPU; any other name is taken as it is.

    Raises:
        ConfigError: ``device`` names no device torch knows.
    """
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={device!r} is not a device: use auto, cpu, cuda or cuda:N") from None


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: "torch.device"

    @property
    def main(self) -> bool:
        return self.rank == 0


def check_cuda(device: "torch.device", hint: str) -> None:
    """Refuse a CUDA ``device`` where torch sees no GPU, ``hint`` saying what to pass instead (torch's own
    error comes later, from deep inside the first copy: "Torch not compiled with CUDA enabled")."""
    import torch

    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={str(device)!r} but torch sees no CUDA device: {hint}")


def init_distributed(device: str = "auto") -> DistInfo:
    """Read torchrun's environment, pick this process's device, and join the process group when there is one.

    The rank, world size and local rank come from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (0, 1, 0 when
    unset).
    With more than one process the group is joined: nccl on CUDA, gloo on the CPU.
    Calling it again returns the same answer without joining twice.

    Args:
        device: ``"auto"`` (default: CUDA when torch sees a GPU, else the CPU), ``"cpu"``, ``"cuda"`` (this
            process's GPU: ``cuda:LOCAL_RANK``, made current) or ``"cuda:N"``.

    Returns:
        ``DistInfo(rank, world_size, local_rank, device)``; its ``main`` is True on rank 0.

    Raises:
        ConfigError: ``device`` is CUDA where torch sees no GPU.

    Examples:
        >>> info = init_distributed()  # under `torchrun --nproc-per-node 8 train.py`
        >>> loader = FastLoader(FastDataset("data/train"), 256)  # this rank's share of every epoch
        >>> ...
        >>> shutdown_distributed()
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = str(resolve_device(device))
    if device.startswith("cuda"):
        check_cuda(torch.device(device), "use --device cpu")
        dev = torch.device("cuda", local) if device == "cuda" else torch.device(device)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        # DDP imports torch._dynamo on first use; imported while a group exists, it keeps references to
        # that group for good, so destroy_process_group could not free it (nor join gloo's threads).
        with contextlib.suppress(ImportError):  # a torch build without dynamo has nothing to keep it
            importlib.import_module("torch._dynamo")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank, world, local, dev)


_HOLDERS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # objects with close() that hold the group


def hold_group(holder: Any) -> None:
    """Register ``holder`` (anything with ``close()``, e.g. a Trainer wrapping its model in DDP) to be
    closed by `shutdown_distributed` before the group is freed."""
    _HOLDERS.add(holder)


def release_group(holder: Any) -> None:
    _HOLDERS.discard(holder)


def shutdown_distributed() -> None:
    """Leave the process group joined by `init_distributed` once every rank got here, and free it.

    Every registered holder (each live Trainer: its DDP wrapper holds the group) is closed first.
    Call it at the end of a distributed run: a group still alive when the interpreter exits keeps gloo's
    threads running into finalisation, where one that takes the GIL can abort the process ("terminate called
    without an active exception") after a run that went well.
    Without a process group it does nothing.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        for holder in list(_HOLDERS):
            holder.close()
        gc.collect()  # DDP wrappers sit in reference cycles: free them now, not at exit
        dist.barrier()
        dist.destroy_process_group()


def group_size() -> int:
    """The size of the joined process group (1 without one). Never imports torch."""
    dist = _joined()
    return dist.get_world_size() if dist is not None else 1


def broadcast_bytes(data: Optional[bytes]) -> Optional[bytes]:
    """Rank 0's ``data`` (None: it has none) on every rank of the joined process group, as two broadcasts
    of tensors (a length, then the bytes: nothing is pickled); ``data`` itself without a group. Every rank
    must call it, at the same point: it is a collective."""
    if group_size() == 1:
        return data
    import torch
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    main = dist.get_rank() == 0
    size = torch.tensor([-1 if data is None or not main else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if int(size) <= 0:  # (nothing to send: no empty tensor goes through the backend)
        return None if int(size) < 0 else b""
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if main and data else
           torch.empty(int(size), dtype=torch.uint8, device=device))
    dist.broadcast(buf, 0)
    return data if main else buf.cpu().numpy().tobytes()
