"""Which source ``fastdata preprocess images SRC`` names: WebDataset tars, a records file, Parquet, COCO, a
segmentation pair or an image folder, on this machine's disk or at a URL."""
from __future__ import annotations

import posixpath
from pathlib import Path
from typing import Any, Optional, Union

from .._io import scrub
from ..errors import SourceError
from ..storage.object_store import is_url
from .indexed import FileSource
from .parquet import ParquetSource, images_beside, is_parquet
from .records import coco, csv_records, discover_any, is_record_csv, jsonl_records, segmentation_pair
from .sources import IMAGE_EXTENSIONS, Source, discover, is_image_name, listed, url_folder
from .tar_index import TarSource
from .tars import is_tar_source, tar_files
from .url_reads import url_listing, url_path


def discover_source(src: Union[str, Path], coco_json: Optional[Path] = None) -> Union[Source, FileSource]:
    """The source behind ``fastdata preprocess images SRC``: WebDataset tars (a ``.tar``, a brace pattern, a
    folder of them) or Parquet files (a ``.parquet``, a folder of them), summarised later by tasks (NOTE
    [indexed source] in fastdata/preprocess/indexed.py), else what `discover_any` finds; local or at a URL
    (NOTE [url source] in fastdata/preprocess/url_reads.py).

    Raises:
        SourceError: The source is missing, unreadable (at a URL: one line, scrubbed), empty or malformed.
    """
    if coco_json is None and is_tar_source(src):
        return TarSource.of(src, tar_files(src))
    if is_url(str(src)):
        try:
            return _discover_url(str(src), coco_json)
        except SourceError as exc:  # records' messages name their file and line: its URL, scrubbed
            raise SourceError(scrub(str(exc))) from None
    local = Path(src)
    pair = local.is_dir() and (local / "images").is_dir() and (local / "masks").is_dir()  # as discover_any
    if coco_json is None and not pair and is_parquet(local):
        return ParquetSource.at(local)
    return discover_any(Path(src), coco_json)


def _discover_url(url: str, coco_json: Optional[Path]) -> Union[Source, FileSource]:
    """`discover_any` at a URL: a records file by its path's suffix (a presigned URL's query follows it), else a
    folder, listed once."""
    suffix = posixpath.splitext(url_path(url).rstrip("/"))[1].lower()
    if coco_json is not None:
        source = coco(url, coco_json)
    elif suffix == ".jsonl":
        source = jsonl_records(url)
    elif suffix == ".csv":
        return csv_records(url) if is_record_csv(url) else discover(url)
    elif suffix == ".parquet":
        return ParquetSource.at(url)
    else:
        listing = url_listing(url)
        if {"images", "masks"} <= {n.split("/", 1)[0] for n in listing if "/" in n}:
            source = segmentation_pair(url, listing)
        elif any("/" not in n and n.endswith(".parquet") for n in listing):
            files = sorted(n for n in listing if "/" not in n and listed(n, ".parquet")
                           and listing[n].get("type", "file") == "file")
            if files:  # (as a local folder: class folders of images beside them are refused)
                images_beside(url, f"{url.rstrip('/')}/{files[0]}", _image_class(listing))
            return ParquetSource.at(url)
        else:
            source = url_folder(url, listing)
    if not source.paths:
        raise SourceError(f"source {url} holds no samples (image extensions: {', '.join(sorted(IMAGE_EXTENSIONS))})")
    return source


def _image_class(listing: dict[str, dict[str, Any]]) -> Optional[str]:
    """The first class folder of a folder's listing that holds an image, as `url_folder` finds them."""
    for rel in sorted(listing):
        parts = rel.split("/")
        if (len(parts) > 1 and not any(p.startswith(".") for p in parts[:-1]) and is_image_name(parts[-1])
                and listing[rel].get("type") != "directory"):
            return parts[0]
    return None
