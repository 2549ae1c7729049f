"""``fastdata show DATA``: a PNG grid of a dataset's samples, to look at what preprocessing made.

Each cell is one sample's image (scaled up by an integer factor to at least `MIN_CELL` pixels, nearest
neighbour, so a small dataset's pixels stay visible) over a strip of text: its class name, its multi-labels,
its captions decoded and its numbers. Masks are overlaid in a colour per id, boxes drawn in a colour per
box with their class names (NOTE [fields] in fastdata/formats/schema.py). Pillow only.
"""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .._io import disk_error, require_folder_of
from ..errors import ConfigError, MissingDependencyError

MIN_CELL = 160  # pixels: an image is scaled up by an integer factor to at least this
LINE = 12  # pixels per line of text (Pillow's default bitmap font is 11 high)
TEXT_LINES = 4
BACKGROUND = (24, 24, 24)
TEXT = (235, 235, 235)
# boxes: box j gets BOX_COLOURS[j % len]; masks: id v > 0 gets MASK_COLOURS[v % len], blended by MASK_ALPHA
BOX_COLOURS = ((255, 64, 64), (64, 255, 64), (64, 160, 255), (255, 220, 0), (255, 0, 255), (0, 255, 255))
MASK_COLOURS = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180))
MASK_ALPHA = 0.45


@dataclass(frozen=True)
class Cell:
    """Where sample ``index`` sits in the grid: its image's top-left pixel and its scale factor."""

    index: int
    x: int
    y: int
    scale: int


def sample_indices(n_samples: int, n: int) -> list[int]:
    """``n`` samples spread evenly over the dataset (a folder is stored class after class: every class shows)."""
    if n_samples <= n:
        return list(range(n_samples))
    return np.linspace(0, n_samples - 1, n).round().astype(np.int64).tolist()


def render(dataset: Any, n: int = 16) -> tuple[Image.Image, list[Cell]]:
    """Draw ``n`` samples of an image dataset (a `FastDataset`) as one grid.

    Args:
        dataset: the opened dataset.
        n: how many samples (spread evenly over the dataset).

    Returns:
        The grid image and each sample's `Cell`.
    """
    idx = sample_indices(len(dataset), n)
    batch = dataset.get_batch(np.asarray(idx, np.int64))
    if not isinstance(batch, dict):
        batch = {"image": batch[0], "label": batch[1]}
    batch = {k: v.numpy() if hasattr(v, "numpy") else np.asarray(v) for k, v in batch.items()}
    images = batch["image"]
    side = images.shape[1]
    scale = max(1, math.ceil(MIN_CELL / side))
    cell_w, cell_h = side * scale, side * scale + LINE * TEXT_LINES + 4
    cols = max(1, math.ceil(math.sqrt(len(idx))))
    rows = math.ceil(len(idx) / cols)
    grid = Image.new("RGB", (cols * cell_w + (cols - 1) * 4, rows * cell_h), BACKGROUND)
    font = ImageFont.load_default()
    fields = {f.name: f for f in (dataset.fields or [])}
    tokenizer = _tokenizer(dataset.manifest)
    cells = []
    for j, i in enumerate(idx):
        x, y = (j % cols) * (cell_w + 4), (j // cols) * cell_h
        img = _with_masks(images[j], batch, fields, j)
        tile = Image.fromarray(img).resize((cell_w, cell_w), Image.Resampling.NEAREST)
        draw = ImageDraw.Draw(tile)
        if "boxes" in batch:
            _draw_boxes(draw, batch, j, scale, dataset.classes, font)
        grid.paste(tile, (x, y))
        text = _caption(i, batch, fields, j, dataset.classes, tokenizer)
        lines = textwrap.wrap(text, max(8, cell_w // 6))[:TEXT_LINES]
        ImageDraw.Draw(grid).multiline_text((x + 2, y + cell_w + 2), "\n".join(lines), fill=TEXT, font=font,
                                            spacing=1)
        cells.append(Cell(i, x, y, scale))
    return grid, cells


def _rows(batch: dict[str, np.ndarray], name: str, j: int) -> np.ndarray:
    """Sample ``j``'s values of the variable field ``name`` (``box_labels`` shares the offsets of ``boxes``)."""
    offsets = batch[("boxes" if name == "box_labels" else name) + "_offsets"]
    return batch[name][offsets[j]:offsets[j + 1]]


def _with_masks(image: np.ndarray, batch: dict[str, np.ndarray], fields: dict[str, Any], j: int) -> np.ndarray:
    out = image.astype(np.float32)
    palette = np.asarray(MASK_COLOURS, np.float32)
    for name, f in fields.items():
        if f.kind != "mask":
            continue
        m = batch[name][j].astype(np.int64)
        on = m > 0
        out[on] = (1 - MASK_ALPHA) * out[on] + MASK_ALPHA * palette[m[on] % len(palette)]
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)


def _draw_boxes(draw: ImageDraw.ImageDraw, batch: dict[str, np.ndarray], j: int, scale: int, classes: list[str],
                font: Any) -> None:
    boxes, labels = _rows(batch, "boxes", j), _rows(batch, "box_labels", j)
    for k, (box, cls) in enumerate(zip(boxes, labels)):
        colour = BOX_COLOURS[k % len(BOX_COLOURS)]
        x1, y1, x2, y2 = (float(v) * scale for v in box)
        draw.rectangle((x1, y1, max(x1, x2 - 1), max(y1, y2 - 1)), outline=colour, width=2)
        name = classes[int(cls)] if 0 <= int(cls) < len(classes) else str(int(cls))
        draw.text((x1 + 3, y1 + 2), name, fill=colour, font=font)


def _caption(i: int, batch: dict[str, np.ndarray], fields: dict[str, Any], j: int, classes: list[str],
             tokenizer: Any) -> str:
    """Sample ``i``'s text: ``#i``, its class name, multi-labels, captions and numbers."""
    def name(c: int) -> str:
        return classes[c] if 0 <= c < len(classes) else str(c)

    parts = [f"#{i}"]
    if "label" in batch:
        parts.append(name(int(batch["label"][j])))
    for key, f in fields.items():
        if f.kind == "labels":
            parts.append(f"{key}: " + ", ".join(name(int(c)) for c in _rows(batch, key, j)))
        elif f.kind == "tokens":
            ids = _rows(batch, key, j)
            parts.append(f"{key}: " + (tokenizer.decode(ids.tolist()) if tokenizer is not None else
                                       " ".join(map(str, ids[:16].tolist()))))
        elif f.kind == "vector":
            v = np.asarray(batch[key][j]).reshape(-1)
            parts.append(f"{key}=" + ",".join(f"{x:.3g}" for x in v[:4]) + ("..." if v.size > 4 else ""))
    return "  ".join(parts)


def _tokenizer(manifest: dict[str, Any]) -> Optional[Any]:
    """The dataset's caption tokenizer when it can be loaded here (else ids are shown)."""
    spec = manifest.get("tokenizer", {}).get("spec")
    if spec is None:
        return None
    from ..formats.tokenizer import load_tokenizer

    try:
        return load_tokenizer(spec)
    except (ConfigError, MissingDependencyError, OSError):
        return None


def show(data: Union[str, Path], n: int = 16, out: Union[str, Path] = "grid.png",
         **open_kwargs: Any) -> tuple[Path, int]:
    """Write a grid of ``n`` samples of the image dataset ``data`` (a folder or URL) to the PNG ``out``.

    Args:
        data: the dataset folder or URL.
        n: how many samples (1..1024; all of them when the dataset has fewer).
        out: the PNG file to write.
        **open_kwargs: passed to `FastDataset` (``cache_dir``, ``storage_options``, ...).

    Returns:
        The PNG's path and how many samples it shows.

    Raises:
        ConfigError: ``n`` out of range, or ``out`` not a ``.png`` in a folder that exists.
        FormatError: ``data`` is not an image dataset.
        OutputError: ``out`` cannot be written.
    """
    from ..datasets.images import FastDataset

    if not isinstance(n, int) or not 1 <= n <= 1024:
        raise ConfigError(f"n must be an integer in 1..1024, got n={n!r}")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"out must be a .png file, got out={str(out)!r}")
    require_folder_of(out, "out")  # (said before any shard is read)
    # a URL's image shards stream through the node cache: only the shown samples' shards are fetched
    grid, cells = render(FastDataset(data, storage="mmap", **open_kwargs), n)
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)  # (a leftover, or a link at its name: never written through)
        grid.save(tmp, "PNG")
        tmp.replace(out)
    except OSError as exc:
        raise disk_error(exc, out) from exc
    return out, len(cells)  # (fewer than n for a smaller dataset)
