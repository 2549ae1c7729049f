"""Progress bars: tqdm on stderr, off with ``--quiet`` (`set_quiet`, for the bars a command does not
draw itself, such as a URL dataset's downloads) and on every rank but 0."""
from __future__ import annotations

import sys
from typing import Any

from .distributed import is_main_rank

_QUIET = False


def set_quiet(quiet: bool = True) -> None:
    """Turn every fastdata progress bar of this process off (or back on)."""
    global _QUIET
    _QUIET = quiet


def progress_bar(*, total: int, desc: str, unit: str, enabled: bool = True, initial: int = 0,
                 unit_scale: bool = False) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                disable=_QUIET or not (enabled and is_main_rank()), dynamic_ncols=True, leave=False)
