"""The ``fastdata`` commands that look after datasets rather than make or use them: ``verify``, ``push``,
``inspect``, ``shm`` (the per-machine /dev/shm copies) and ``cache`` (the node cache of remote datasets)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable


def retry_seconds(args: argparse.Namespace) -> dict[str, float]:
    """``{"retry_seconds": N}`` when ``--retry-seconds`` was given, else nothing (the library's default)."""
    return {} if getattr(args, "retry_seconds", None) is None else {"retry_seconds": args.retry_seconds}


def add_retry_seconds(cmd: argparse.ArgumentParser) -> None:
    """The ``--retry-seconds`` option of a command that reads or writes URLs."""
    cmd.add_argument("--retry-seconds", type=float, default=None, metavar="S",
                     help="URLs: how long the store may fail (refused connections, timeouts, 5xx) before giving up "
                          "with one line (default 120; retried with backoff and jitter)")


def path_or_url(text: str) -> str | Path:
    """A dataset argument: a URL stays a string (``Path`` would fold ``s3://`` into ``s3:/``)."""
    from ..storage.object_store import is_url

    if not text.strip():  # (an unset shell variable: Path("") is the current folder)
        raise argparse.ArgumentTypeError("an empty path: give a folder, a file or a URL")
    return text if is_url(text) else Path(text)


def local_path(text: str) -> Path:
    """A local folder argument (``push DATA``, ``bench DATA``), refused when empty as `path_or_url` is."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a dataset folder")
    return Path(text)


def _verify(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..formats.manifest import load_columns, total_bytes
    from ..formats.integrity import verify
    from ..progress import progress_bar
    from ..storage.cache_folders import SOURCE_NAME
    from ..storage.object_store import is_url

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got --workers {args.workers}")
    if is_url(args.path):
        return _verify_url(args)
    manifest = load_columns(args.path)  # (columns, let go of before `verify` reads it again: 10^6 files)
    cache = (Path(args.path) / SOURCE_NAME).is_file()  # a node cache: streamed files come and go
    absent = [e for e in manifest["files"] if cache and not (Path(args.path) / e["path"]).is_file()]
    files, total = len(manifest["files"]), total_bytes(manifest)
    del manifest
    bar = progress_bar(total=total - sum(int(e["bytes"]) for e in absent), desc="verify",
                       unit="B", unit_scale=True, enabled=not args.quiet)
    try:
        problems = verify(args.path, bar.update, partial=cache, workers=args.workers)
    finally:
        bar.close()
    if problems:
        _problems(f"{args.path}: {len(problems)} problem(s):", problems)
        return 1
    print(f"{args.path}: OK, {files - len(absent)} files intact"
          + (f"; {len(absent)} not in this node cache (fetched and checked when read; `fastdata verify URL` "
             "checks the store's objects)" if absent else ""))
    return 0


def _problems(head: str, problems: list[str]) -> None:
    """What ``fastdata verify`` found, on stderr: a line saying where, then one line per problem."""
    print(head, file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)


def _verify_url(args: argparse.Namespace) -> int:
    """``fastdata verify URL``: the objects in the store, hashed as they stream (the cache is not their
    source), then this version's node cache folder, if any, reported apart. Exit 0 only if both are intact."""
    from ..formats.manifest import MANIFEST_NAME, total_bytes
    from ..formats.integrity import verify
    from ..progress import progress_bar
    from .._io import scrub
    from ..storage.remote import RemoteDataset, verify_store

    remote = RemoteDataset(args.path, **retry_seconds(args), **({"workers": args.workers} if args.workers else {}))
    url, n = scrub(remote.url), len(remote.manifest["files"])
    bar = progress_bar(total=total_bytes(remote.manifest), desc="verify store", unit="B", unit_scale=True,
                       enabled=not args.quiet)
    try:
        problems = verify_store(remote, bar.update)
    finally:
        bar.close()
    if problems:
        _problems(f"{url}: {len(problems)} problem(s) in the store (push the dataset again):", problems)
    else:
        print(f"{url}: OK, {n} files intact in the store")
    if not (remote.dir / MANIFEST_NAME).is_file():
        print(f"node cache: no copy of this version in {remote.dir.parent}")
        return 1 if problems else 0
    damaged = verify(remote.dir, partial=True, workers=args.workers)
    cached = sum((remote.dir / e["path"]).is_file() for e in remote.manifest["files"])
    if damaged:
        _problems(f"node cache {remote.dir}: {len(damaged)} problem(s) (remove it: `fastdata cache remove "
                  f"{remote.id}`):", damaged)
    else:
        print(f"node cache {remote.dir}: OK, {cached} of {n} files cached and intact")
    return 1 if problems or damaged else 0


def _push(args: argparse.Namespace) -> int:
    from ..formats.manifest import load_manifest, total_bytes
    from ..progress import progress_bar
    from ..storage.push import push
    from .._io import scrub

    bar = progress_bar(total=total_bytes(load_manifest(args.data)), desc="push", unit="B", unit_scale=True,
                       enabled=not args.quiet)
    try:
        counts = push(args.data, args.url, workers=args.workers, progress=bar.update, **retry_seconds(args))
    finally:
        bar.close()
    print(f"{scrub(args.url)}: {counts['uploaded']} object(s) uploaded, {counts['skipped']} already there; "
          "manifest last")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from ..formats.manifest import describe
    from .._io import scrub
    from ..storage.object_store import is_url
    from ..storage.remote import RemoteDataset

    if is_url(args.path):  # only the manifest is read (into the node cache): nothing else is downloaded
        remote = RemoteDataset(args.path, **retry_seconds(args))
        info = describe(remote.prepare(frozenset(f["path"] for f in remote.manifest["files"])))
        info["path"] = scrub(args.path)
    else:
        info = describe(args.path)
    if isinstance(info.get("source"), dict) and "path" in info["source"]:
        info["source"]["path"] = scrub(str(info["source"]["path"]))
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
        return 0
    print(f"path:      {info['path']}")
    print(f"format:    {info['format']} (version {info['format_version']}, fastdata {info['fastdata_version']})")
    if info.get("num_samples") is not None:
        print(f"samples:   {info['num_samples']}" + (f" ({info['skipped']} source files skipped)" if info["skipped"]
                                                     else ""))
    # (a dataset of fields has a label only in a field 'label': a mask's or a regression's manifest still
    # names a label_dtype, which no batch carries)
    labelled = "fields" not in info or "label" in info["fields"]
    for key in ("sample_shape", "dtype", "layout", "label_dtype", "shard_size", "max_short_side", "encoding"):
        if key in info and (key != "label_dtype" or labelled):
            print(f"{key + ':':<13} {info[key]}")
    for name, desc in info.get("fields", {}).items():
        print(f"field:     {name}: {desc}")
    print(f"on disk:   {info['bytes'] / 2**20:.1f} MiB in {info['files']} files")
    print(f"params:    {json.dumps(info['params'])}")
    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    print(f"source:    {source.get('kind', 'text')} {source.get('path', '?')}")
    if "splits" in info:
        t = info["tokenizer"]
        print(f"tokenizer: {t['spec']} ({t['kind']}, vocab {t['vocab_size']}, end-of-document id {t['eos_id']})")
        for name, sp in info["splits"].items():
            docs = f", {sp['documents']:,} documents" if isinstance(sp.get("documents"), int) else ""
            print(f"{name + ':':<10} {sp['tokens']:,} tokens{docs}, {sp['shards']} shards")
        if isinstance(info.get("bytes_per_token"), (int, float)):
            print(f"source bytes/token: {info['bytes_per_token']:.2f} (the files as stored: a compressed one "
                  "counts its compressed bytes)")
    if info.get("classes"):  # (none: no class labels, not "classes: 0")
        print(f"classes:   {len(info['classes'])}")
        for name, count in info["classes"].items():
            print(f"  {count:>8}  {name}")
    return 0


def _shm(args: argparse.Namespace) -> int:
    from ..storage import shm

    if args.action == "list":
        copies = shm.list_copies(args.dir)
        for c in copies:
            partial = f"  (partial: {c['partial']})" if "partial" in c else ""
            print(f"{c['id']}  {c['bytes'] / 2**20:>10,.1f} MiB  {c['dataset']}{partial}")
        print(f"{len(copies)} cop{'y' if len(copies) == 1 else 'ies'} in {shm.private_dir(args.dir, create=False)}",
              file=sys.stderr)
        return 0
    return _remove(args, "copies", "copy", lambda ids: shm.remove_copies(ids, args.dir),
                   shm.private_dir(args.dir, create=False))


def _cache(args: argparse.Namespace) -> int:
    from .._io import scrub
    from ..storage.cache_folders import default_cache_dir, list_cached, remove_cached

    where = args.dir or default_cache_dir()
    if args.action == "list":
        found = list_cached(where)
        for c in found:
            print(f"{c['id']}  {c['cached_bytes'] / 2**20:>10,.1f} of {c['bytes'] / 2**20:,.1f} MiB  "
                  f"{c['cached_files']}/{c['files']} files  {scrub(c['url'])}")
        print(f"{len(found)} dataset(s) in {where}", file=sys.stderr)
        return 0
    if args.action == "fetch":
        return _cache_fetch(args, where)
    return _remove(args, "datasets", "cached dataset", lambda ids: remove_cached(ids, where), where)


def _cache_fetch(args: argparse.Namespace, where: Path) -> int:
    """``fastdata cache fetch URL...``: every file of each dataset into the node cache, verified (a node
    warmed before a job)."""
    from ..formats.manifest import total_bytes
    from ..progress import progress_bar
    from .._io import scrub
    from ..storage.object_store import is_url
    from ..storage.remote import RemoteDataset

    if not args.ids or not all(is_url(u) for u in args.ids):
        print("fastdata: error: name the dataset URLs to fetch (s3://..., gs://...)", file=sys.stderr)
        return 2
    for url in args.ids:
        remote = RemoteDataset(url, cache_dir=where, **retry_seconds(args))
        missing = [e for e in remote.manifest["files"] if not (remote.dir / e["path"]).is_file()]
        bar = progress_bar(total=total_bytes({"files": missing}), desc="fetch", unit="B", unit_scale=True,
                           enabled=not args.quiet)
        try:
            remote.local(bar.update)
        finally:
            bar.close()
        print(f"{remote.id}  {len(remote.manifest['files'])} files in {remote.dir}  {scrub(remote.url)}")
    return 0


def _remove(args: argparse.Namespace, things: str, thing: str, remove: Callable[[list[str]], list[str]],
            where: Path) -> int:
    """``fastdata shm|cache remove IDS|--all``: remove, print each id removed, name the ids not found."""
    if not args.ids and not args.all:
        print(f"fastdata: error: name the {things} to remove (ids from `fastdata {args.command} list`) or pass --all",
              file=sys.stderr)
        return 2
    removed = remove([] if args.all else args.ids)
    for cid in removed:
        print(f"removed {cid}")
    missing = sorted(set(args.ids) - set(removed))
    if missing:
        print(f"fastdata: error: no {thing} named {', '.join(missing)} in {where}", file=sys.stderr)
        return 1
    return 0


def _add_list_remove(sub: Any, name: str, help: str, things: str, every: str, dir_help: str, func: Any,
                     fetch: bool = False) -> Any:
    """A ``list | remove [IDS] [--all] [--dir]`` command (``shm``, ``cache``); with ``fetch``, also
    ``fetch URLS``."""
    cmd = sub.add_parser(name, help=help)
    cmd.add_argument("action", choices=("list", "fetch", "remove") if fetch else ("list", "remove"))
    cmd.add_argument("ids", nargs="*", help=f"remove: ids of the {things} (see `fastdata {name} list`)"
                     + ("; fetch: dataset URLs" if fetch else ""))
    cmd.add_argument("--all", action="store_true", help=f"remove: {every}")
    cmd.add_argument("--dir", type=Path, default=None, help=dir_help)
    cmd.set_defaults(func=func)
    return cmd


def add_data_commands(sub: Any) -> None:
    """Register the commands above on the ``fastdata`` subparsers."""
    ver = sub.add_parser("verify", help="re-hash every file against the manifest (exit 0 only if intact)")
    ver.add_argument("path", type=path_or_url,
                     help="dataset folder or URL (s3://..., gs://...: the objects in the store are hashed as they "
                          "stream; this node's cache of it is checked apart)")
    ver.add_argument("--quiet", action="store_true")
    ver.add_argument("--workers", type=int, default=None,
                     help="files hashed at once (default: this machine's cores, at most 8; a URL: 8 objects)")
    add_retry_seconds(ver)
    ver.set_defaults(func=_verify)

    pu = sub.add_parser("push", help="upload a finished dataset to object storage (manifest last; reruns resume)")
    pu.add_argument("data", type=local_path, help="dataset folder")
    pu.add_argument("url", help="fsspec URL: s3://bucket/prefix, gs://..., az://..., file://...")
    pu.add_argument("--workers", type=int, default=8, help="parallel uploads (default 8)")
    pu.add_argument("--quiet", action="store_true")
    add_retry_seconds(pu)
    pu.set_defaults(func=_push)

    ins = sub.add_parser("inspect", help="what a dataset folder (or URL) holds")
    ins.add_argument("path", type=path_or_url, help="dataset folder or URL (only its manifest is downloaded)")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    add_retry_seconds(ins)
    ins.set_defaults(func=_inspect)
    _add_list_remove(sub, "shm", "list or remove the per-machine dataset copies in /dev/shm", "copies", "every copy",
                     "shm folder (default $FASTDATA_SHM_DIR or /dev/shm)", _shm)
    cache = _add_list_remove(sub, "cache", "list, fetch (warm a node before a job) or remove the node cache of "
                             "remote datasets (private to this user; $FASTDATA_CACHE_MODE=group shares it with "
                             "the cache folder's group)", "datasets", "every dataset (run it between jobs)",
                             "cache folder (default $FASTDATA_CACHE, $XDG_CACHE_HOME/fastdata or ~/.cache/fastdata)",
                             _cache, fetch=True)
    cache.add_argument("--quiet", action="store_true", help="fetch: no progress bar")
    add_retry_seconds(cache)
