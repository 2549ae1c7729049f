"""The ``fastdata`` command: argparse subcommands that build the library's config objects.

A `FastdataError` becomes one line on stderr and exit status 1, never a traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .._io import disk_error, require_folder_of, scrub
from ..errors import ConfigError, FastdataError
from .data import add_data_commands, add_retry_seconds, local_path, path_or_url, retry_seconds


def _preprocess_images(args: argparse.Namespace) -> int:
    from ..preprocess.image_manifest import summary
    from ..preprocess.images import ImagePreprocessConfig, preprocess_images

    config = ImagePreprocessConfig(
        src=args.src, out=args.out, size=args.size, resize=args.resize, format=args.format, workers=args.workers,
        shard_size=args.shard_size, on_error=args.on_error, quality=args.quality, filter=args.filter,
        overwrite=args.overwrite, progress=not args.quiet, coco=args.coco, mask_dtype=args.mask_dtype,
        tokenizer=args.tokenizer, shuffle_seed=args.shuffle, **_engine(args))
    manifest = preprocess_images(config)
    if not args.quiet or manifest.get("skipped"):  # (--quiet: only what was lost is worth a line)
        print(summary(manifest), file=sys.stderr)
    return 0


def _preprocess_text(args: argparse.Namespace) -> int:
    from ..preprocess.text import TextPreprocessConfig, preprocess_text, summary

    config = TextPreprocessConfig(src=args.src, out=args.out, tokenizer=args.tokenizer, field=args.field,
                                  val_fraction=args.val_fraction, workers=args.workers, on_error=args.on_error,
                                  shard_tokens=args.shard_tokens, seed=args.seed, overwrite=args.overwrite,
                                  progress=not args.quiet, **_engine(args))
    manifest = preprocess_text(config)
    if not args.quiet or manifest["skipped_count"]:
        print(summary(manifest), file=sys.stderr)
    return 0


def _engine(args: argparse.Namespace) -> dict[str, Any]:
    """``--ray [ADDRESS]`` as the preprocess configs' ``engine`` and ``ray_address``."""
    if args.ray is None:
        return {}
    return {"engine": "ray", "ray_address": None if args.ray == "auto" else args.ray}


def _add_ray(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                        help="run the work as Ray tasks on the cluster at ADDRESS (HOST:PORT; alone: the cluster "
                             "on this machine, or a new local one); the same output bytes (pip install "
                             "'fastdata[ray]')")


def _share_or_auto(text: str) -> float | str:
    """``--hw-decoder-load``: a number, else the text as given ("auto"; ImageRun refuses anything else by name)."""
    try:
        return float(text)
    except ValueError:
        return text


def _train(args: argparse.Namespace) -> int:
    import torch

    from ..distributed import init_distributed, shutdown_distributed
    from ..formats.manifest import IMAGES_LMDB, IMAGES_NPY, TOKENS
    from ..storage.opening import open_path
    from ..storage.streamed import streamed_files
    from ..train.assemble import ImageRun, build, build_lm
    from ..train.config import TrainConfig, check_device, parse_duration
    from ..train.trainer import Trainer

    cfg = TrainConfig(
        epochs=args.epochs, max_steps=args.max_steps, max_time=parse_duration(args.max_time), lr=args.lr,
        optimizer=args.optimizer, weight_decay=args.weight_decay, schedule=args.schedule,
        warmup_steps=args.warmup_steps, label_smoothing=args.label_smoothing, amp=args.amp, accum=args.accum,
        clip=args.clip, compile=args.compile, sync_bn=args.sync_bn,
        checkpoint_dir=args.checkpoint, checkpoint_every=args.checkpoint_every,
        resume=args.resume, val_every=args.val_every, val_every_steps=args.val_every_steps,
        early_stop_patience=args.early_stop_patience, early_stop_min_delta=args.early_stop_min_delta,
        log_every=args.log_every, log_file=str(args.log_file) if args.log_file else None,
        profile_steps=args.profile, device=args.device, seed=args.seed, progress=not args.quiet, **retry_seconds(args))
    info = init_distributed(cfg.device)  # before the loaders, so each serves its rank's shard
    tuned: dict[str, Any] = {}  # FastLoader's autotuned prefetch and pin_memory
    if args.config is not None:  # autotuned loader settings; explicit --storage / --threads still win
        from ..loading.loader import load_config

        config = load_config(args.config)
        args.storage = args.storage or config["storage"]
        args.threads = args.threads or config["loader"].get("num_threads")
        tuned = {k: v for k, v in config["loader"].items() if k in ("prefetch", "pin_memory")}
        if info.device.type != "cuda":  # (tuned on a GPU machine: pinned memory is for copies to a GPU)
            tuned.pop("pin_memory", None)
    check_device(cfg, info.device)  # before the data is opened
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    args.storage = args.storage or "mmap"
    cache = {"cache_dir": args.cache_dir, "cache_limit": args.cache_limit, **retry_seconds(args)}
    run = dict(model=args.model or "resnet18", batch_size=args.batch_size, val=args.val,
               val_fraction=args.val_fraction, storage=args.storage, threads=args.threads, augment=args.augment,
               crop=args.crop, seed=args.seed, backend=args.backend, shuffle_window=args.shuffle_window,
               hw_decoder_load=args.hw_decoder_load, **tuned, **cache)
    if args.mix:  # several datasets by weight (docs/mixtures.md)
        from dataclasses import replace

        from ..datasets.mix_config import parse_mix
        from ..train.assemble import build_mix

        if args.data is not None:
            raise ConfigError(f"give DATA or --mix, not both (got {args.data} and --mix {' '.join(args.mix)})")
        spec = parse_mix(args.mix)
        if args.allow_new_sources:
            spec = replace(spec, allow_new_sources=True)  # (or the mix file's allow_new_sources)
        pipe = ImageRun(data=next(iter(spec.sources.values()))[0], **run)
        model, train, val = build_mix(spec, pipe, info.device, args.seq_len, args.model)
    elif args.data is None:
        raise ConfigError("give a dataset folder or URL (fastdata train DATA), or --mix NAME=PATH:WEIGHT")
    elif args.allow_new_sources:
        raise ConfigError("--allow-new-sources applies to --mix (sources a resumed mixture did not have): drop it "
                          f"for one dataset ({scrub(str(args.data))})")
    else:
        # the dataset's manifest is read once for the whole run, and its kind decides the run
        opened = open_path(args.data, (IMAGES_NPY, IMAGES_LMDB, TOKENS), **cache,
                           streamed=lambda m: streamed_files(m, args.storage))
        if opened.manifest["format"] == TOKENS:
            _refuse_image_flags(args)
            model, train, val = build_lm(opened, args.model, args.batch_size, args.seq_len, args.storage,
                                         args.threads, args.seed, info.device, args.shuffle_window, **tuned)
        else:
            model, train, val = build(ImageRun(data=args.data, **run), info.device, opened)
    trainer = Trainer(model, train, val, config=cfg)
    trainer.fit()
    shutdown_distributed()  # not on an error: a barrier there would wait for ranks that are still training
    if trainer.stop_signal is None:
        return 0
    if info.rank == 0:  # NOTE [stop signals]: the run is not finished, and says how to go on
        from ..train.stop import signal_name

        print(f"fastdata: stopped by {signal_name(trainer.stop_signal)} at step {trainer.step}, checkpoint saved in "
              f"{scrub(str(args.checkpoint))}: rerun with --resume to continue", file=sys.stderr)
    return 128 + trainer.stop_signal  # what a shell reports for a process the signal ended


def _refuse_image_flags(args: argparse.Namespace) -> None:
    """Flags that a token dataset's run would ignore, refused by name: it validates on its own val split."""
    from ..train.assemble import image_flags

    given = [flag for flag, on in (("--val", args.val is not None), ("--val-fraction", bool(args.val_fraction)),
                                   ("--backend dali", args.backend == "dali"),
                                   ("--hw-decoder-load", args.hw_decoder_load is not None)) if on]
    given += image_flags(args.crop, args.augment)
    if given:
        raise ConfigError(f"{scrub(str(args.data))} holds tokens: drop {', '.join(given)}, for image datasets only "
                          "(a token dataset validates on its own val split, made by `fastdata preprocess text "
                          "--val-fraction`, and trains on the native backend)")


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    # Only the options given on the command line: each mode's defaults are its function's (see its docstring).
    given = {k: v for k, v in (("model", args.model), ("batch_size", args.batch_size), ("seconds", args.seconds))
             if v is not None}
    pipeline = {"storage": args.storage, "num_threads": args.threads, "pageable": args.pageable}
    for option, path in (("--json", args.json), ("--plot", args.plot)):  # (refused before the measurement)
        if path is not None:
            require_folder_of(path, option)
    if args.loader:
        report = bench.diagnose_loader(args.loader, image_size=args.image_size, device=args.device, **given)
        if report["model"] is None:
            step = f"model step skipped: {report['model_skipped']}"
        else:
            step = (f"model step {report['work_ms']:.1f} ms ({report['model']} on "
                    f"{tuple(report['model_input_shape'])}, from the first batch {tuple(report['batch_shape'])} "
                    f"{report['batch_dtype']})")
        print(f"{args.loader}: {report['steps']} steps, {step}, waiting {report['wait_ms']:.1f} ms\n"
              f"{report['verdict']}")
    elif args.data is None:
        raise ConfigError("give a dataset folder (fastdata bench DATA) or --loader module:factory")
    elif args.autotune:
        given.pop("model", None)
        given.setdefault("seconds", 120.0)  # the CLI's budget (autotune() alone defaults to 60 s)
        report = bench.autotune(args.data, progress=not args.quiet, **given)
        print(f"best: storage={report['storage']} {report['loader']} -> {report['images_per_s']:,.0f} images/s "
              f"(default {report['default_images_per_s']:,.0f})")
    else:
        report = bench.bench_pipeline(args.data, device=args.device, progress=not args.quiet, **pipeline, **given)
        print(bench.render(report))
        if args.plot:
            bench.plot(report, args.plot)
            print(f"stage chart written to {args.plot}")
    if args.json:
        try:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        except OSError as exc:
            raise disk_error(exc, args.json) from exc
        print(f"figures written to {args.json}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from .show import show

    opts = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    out, drawn = show(args.data, args.n, args.out, **opts)  # (drawn < -n when the dataset has fewer samples)
    print(f"{scrub(str(args.data))}: {drawn} samples drawn in {out}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.out, per_class=args.per_class)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ..imaging.decode_file import FILTERS
    from ..preprocess.images import FORMATS, ON_ERROR, RESIZE_MODES
    from ..train.config import TrainConfig

    parser = argparse.ArgumentParser(prog="fastdata",
                                     description="Preprocess once, then train without waiting on data.")
    parser.add_argument("--version", action="version", version=f"fastdata {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pre = sub.add_parser("preprocess", help="turn raw data into a fastdata dataset folder")
    pre_sub = pre.add_subparsers(dest="kind", required=True, metavar="KIND")
    img = pre_sub.add_parser("images", help="images (and masks, boxes, labels, captions) -> .npy shards or JPEG LMDB")
    img.add_argument("src", type=path_or_url, help="ImageFolder tree, a path,label .csv, a .jsonl/.csv of records "
                     "(with an 'image' column), a folder with images/ and masks/, .parquet file(s), WebDataset .tar "
                     "shards (a folder, a .tar, or a brace pattern such as shards/{00000..00009}.tar; a URL too), or "
                     "(with --coco) the image folder")
    img.add_argument("out", help="output dataset folder, or a URL (s3://bucket/prefix)")
    img.add_argument("--size", type=int, default=256, help="output side S in pixels (default 256)")
    img.add_argument("--resize", choices=RESIZE_MODES, default="center-crop",
                     help="npy: how to reach SxS (default center-crop); lmdb: max-side keeps the aspect with the "
                          "longer side at most S (default: the shorter side at most S)")
    img.add_argument("--format", choices=FORMATS, default="npy", help="npy shards (default) or lmdb (JPEG bytes)")
    img.add_argument("--workers", type=int, default=None,
                     help="decoding processes (default: all cores); with --ray, per node of the smallest size "
                          "(docs/cluster.md)")
    _add_ray(img)
    img.add_argument("--shard-size", type=int, default=1024, help="samples per shard (default 1024)")
    img.add_argument("--on-error", choices=ON_ERROR, default="skip", help="unreadable images: skip (default) or fail")
    img.add_argument("--quality", type=int, default=90, help="lmdb: JPEG quality (default 90)")
    img.add_argument("--filter", choices=tuple(FILTERS), default="lanczos",
                     help="resize filter (default lanczos; fast-bicubic is 2-3x cheaper at 50 dB PSNR against it, "
                          "bilinear ~1.5x; see benchmarks/RESULTS.md)")
    img.add_argument("--coco", type=Path, default=None, help="COCO instances.json: boxes for the images in SRC")
    img.add_argument("--mask-dtype", choices=("uint8", "uint16"), default="uint8",
                     help="masks with ids above 255 need uint16 (default uint8)")
    img.add_argument("--tokenizer", default="bytes", help="text fields (captions): bytes | PATH/tokenizer.json | "
                     "tiktoken:NAME")
    img.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                     help="store the samples in a random order drawn from SEED (default: the source's order, "
                          "class after class for a folder), so a small FastLoader shuffle_window mixes classes")
    img.add_argument("--overwrite", action="store_true", help="replace a dataset made with other arguments")
    img.add_argument("--quiet", action="store_true", help="no progress bar or log lines; the summary only if "
                     "files were skipped")
    img.set_defaults(func=_preprocess_images)

    txt = pre_sub.add_parser("text", help=".txt / .jsonl (.gz, .zst too), .json.gz / .json.zst (JSON Lines), "
                                          ".parquet -> uint16/uint32 token shards")
    txt.add_argument("src", help="a .txt/.jsonl file (optionally .gz or .zst), a .json.gz/.json.zst file of JSON "
                                 "Lines, a .parquet file or a folder of them, local or at a URL")
    txt.add_argument("out", help="output dataset folder, or a URL (s3://bucket/prefix)")
    txt.add_argument("--tokenizer", default="bytes", help="bytes | PATH/tokenizer.json | tiktoken:NAME")
    txt.add_argument("--field", default="text", help="JSON Lines: the field holding the document; Parquet: the "
                                                     "column")
    txt.add_argument("--val-fraction", type=float, default=0.001, help="documents held out for validation")
    txt.add_argument("--workers", type=int, default=None,
                     help="tokenizing processes (default: all cores); with --ray, per node of the smallest size "
                          "(docs/cluster.md)")
    _add_ray(txt)
    txt.add_argument("--on-error", choices=("skip", "fail"), default="skip")
    txt.add_argument("--shard-tokens", type=int, default=1 << 26, help="tokens per shard (default 64 Mi)")
    txt.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    txt.add_argument("--overwrite", action="store_true")
    txt.add_argument("--quiet", action="store_true", help="no progress bar; the summary only if documents "
                     "were skipped")
    txt.set_defaults(func=_preprocess_text)

    add_data_commands(sub)

    D = TrainConfig  # every training default lives in TrainConfig: one default per option
    tr = sub.add_parser("train", help="train a model on a dataset folder (add torchrun for DDP)")
    tr.add_argument("data", type=path_or_url, nargs="?", default=None,
                    help="dataset folder made by `fastdata preprocess`, or its URL "
                                                    "(s3://..., gs://...: streamed through the node cache)")
    tr.add_argument("--val", type=path_or_url, default=None, help="validation dataset folder or URL")
    tr.add_argument("--mix", action="append", default=None, metavar="NAME=PATH:WEIGHT",
                    help="train on a mixture instead of DATA: repeat for each source (or give one JSON/TOML file); "
                         "--resume with other weights goes on where every source stopped (docs/mixtures.md)")
    tr.add_argument("--allow-new-sources", action="store_true",
                    help="--mix --resume: start sources the checkpoint does not have at their epoch 0")
    tr.add_argument("--val-fraction", type=float, default=0.0, help="hold out this share of DATA instead")
    tr.add_argument("--model", default=None, help="cnn-small, resnet18 (default for images), resnet50, "
                                                  "gpt-tiny (default for tokens)")
    tr.add_argument("--seq-len", type=int, default=256, help="tokens: window length")
    tr.add_argument("--epochs", type=int, default=D.epochs,
                    help="default 1, or as many as --max-steps needs when it is given")
    tr.add_argument("--batch-size", type=int, default=256, help="per process")
    tr.add_argument("--lr", type=float, default=D.lr)
    tr.add_argument("--optimizer", choices=("sgd", "adamw"), default=D.optimizer)
    tr.add_argument("--weight-decay", type=float, default=D.weight_decay)
    tr.add_argument("--schedule", choices=("cosine", "onecycle", "constant"), default=D.schedule)
    tr.add_argument("--warmup-steps", type=int, default=D.warmup_steps)
    tr.add_argument("--label-smoothing", type=float, default=D.label_smoothing)
    tr.add_argument("--amp", choices=("bf16", "fp16", "none"), default=D.amp)
    tr.add_argument("--accum", type=int, default=D.accum, help="gradient accumulation steps")
    tr.add_argument("--clip", type=float, default=D.clip, help="clip the gradient norm to this")
    tr.add_argument("--storage", choices=("mmap", "ram", "shm", "cuda"), default=None, help="default mmap")
    tr.add_argument("--threads", type=int, default=None, help="loader threads")
    tr.add_argument("--shuffle-window", type=int, default=None, metavar="K",
                    help="shuffle shards, then samples within windows of K shards (data larger than the cache)")
    tr.add_argument("--cache-dir", default=None, help="URL datasets: the node cache (default $FASTDATA_CACHE)")
    tr.add_argument("--cache-limit", default=None, help="URL datasets: bytes the cache may hold, e.g. 200GB")
    add_retry_seconds(tr)
    tr.add_argument("--augment", choices=("none", "flip", "crop-flip", "rrc-flip"), default="flip")
    tr.add_argument("--crop", type=int, default=None, help="rrc-flip / dali: output side")
    tr.add_argument("--backend", choices=("native", "dali"), default="native",
                    help="dali: decode an LMDB dataset's JPEGs with NVIDIA DALI (pip install 'fastdata[dali]')")
    tr.add_argument("--hw-decoder-load", type=_share_or_auto, default=None, metavar="SHARE|auto",
                    help="dali: the share of JPEGs for the GPU's hardware decoder, in [0, 1], or auto (measured on "
                         "the first batches); default DALILoader's")
    tr.add_argument("--checkpoint", default=None, help="checkpoint folder, or a URL (s3://bucket/run)")
    tr.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every, help="also checkpoint every N steps")
    tr.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    tr.add_argument("--max-steps", type=int, default=D.max_steps)
    tr.add_argument("--max-time", default=None, help="DD:HH:MM:SS or seconds")
    tr.add_argument("--early-stop-patience", type=int, default=D.early_stop_patience)
    tr.add_argument("--early-stop-min-delta", type=float, default=D.early_stop_min_delta)
    tr.add_argument("--val-every", type=int, default=D.val_every, help="validate every N epochs")
    tr.add_argument("--val-every-steps", type=int, default=D.val_every_steps)
    tr.add_argument("--sync-bn", action="store_true")
    tr.add_argument("--compile", action="store_true")
    tr.add_argument("--profile", type=int, default=D.profile_steps, metavar="N", help="profile the first N steps")
    tr.add_argument("--device", default=D.device, help="auto, cuda or cpu")
    tr.add_argument("--seed", type=int, default=D.seed)
    tr.add_argument("--log-every", type=int, default=D.log_every)
    tr.add_argument("--log-file", type=Path, default=None, help="JSONL metrics")
    tr.add_argument("--config", type=Path, default=None, help="loader settings from `fastdata bench --autotune`")
    tr.add_argument("--quiet", action="store_true")
    tr.set_defaults(func=_train)

    be = sub.add_parser("bench", help="find where a training pipeline waits; --autotune the loader")
    be.add_argument("data", type=local_path, nargs="?", default=None, help="dataset folder")
    be.add_argument("--model", default=None, help="default resnet50; --loader: resnet50 on a GPU, cnn-small on the "
                    "CPU; 'none': the data pipeline alone, to the device")
    be.add_argument("--batch-size", type=int, default=None, help="default 256; --loader: the loader's own")
    be.add_argument("--device", default="auto")
    be.add_argument("--seconds", type=float, default=None,
                    help="time budget (default 120 s; 30 s with --loader)")
    be.add_argument("--loader", default=None, metavar="MODULE:FACTORY", help="diagnose your own loader")
    be.add_argument("--image-size", type=int, default=None,
                    help="--loader: side of the model's synthetic input (default: the loader's batches')")
    be.add_argument("--storage", default="mmap", choices=("mmap", "ram", "shm"), help="the dataset's (default mmap)")
    be.add_argument("--threads", type=int, default=None, help="FastLoader threads (default min(4, cores))")
    be.add_argument("--pageable", action="store_true",
                    help="batches in pageable memory, copied with a blocking .to(device): a loop without pinned "
                         "buffers or CUDAPrefetcher")
    be.add_argument("--autotune", action="store_true", help="search loader settings; write them with --json")
    be.add_argument("--json", type=Path, default=None, help="write every figure (and the autotuned config)")
    be.add_argument("--plot", type=Path, default=None, help="stage chart PNG (needs matplotlib)")
    be.add_argument("--quiet", action="store_true")
    be.set_defaults(func=_bench)

    sh = sub.add_parser("show", help="draw a grid of samples (class names, masks, boxes, captions) into a PNG")
    sh.add_argument("data", type=path_or_url, help="image dataset folder or URL")
    sh.add_argument("-n", type=int, default=16, help="how many samples, spread over the dataset (default 16)")
    sh.add_argument("-o", "--out", type=Path, default=Path("grid.png"), help="PNG to write (default grid.png)")
    sh.add_argument("--cache-dir", default=None, help="URL datasets: the node cache (default $FASTDATA_CACHE)")
    sh.set_defaults(func=_show)

    demo = sub.add_parser("demo", help="make a small JPEG dataset, preprocess it, load it, train on it, report speed")
    demo.add_argument("--out", type=Path, default=Path("demo-out"), help="working folder (default ./demo-out)")
    demo.add_argument("--per-class", type=int, default=100, help="images per class (4 classes)")
    demo.set_defaults(func=_demo)
    _say_defaults(parser)
    return parser


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's default in ``--help`` where its help does not say it already (a flag's default that
    is set here, not TrainConfig's, was said nowhere); None (decided later) and off switches say nothing."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _say_defaults(child)
            continue
        given = action.default
        if (not action.option_strings or given is None or given is False or given is argparse.SUPPRESS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
                or "default" in (action.help or "")):
            continue
        action.help = f"{action.help} (default %(default)s)" if action.help else "default %(default)s"


def _version() -> str:
    from .._version import __version__

    return __version__


class _StdoutHandler(logging.Handler):
    """Writes to the ``sys.stdout`` of the moment: a training run's report lines are the command's output."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging's own rule: a failed emit never raises
            self.handleError(record)


def _setup_logging(quiet: bool) -> None:
    from ..progress import set_quiet

    set_quiet(quiet)  # (the bars no command draws itself too: a URL dataset's downloads)
    logging.basicConfig(level=logging.WARNING, format="fastdata: %(message)s", stream=sys.stderr)
    # fastdata's own lines at INFO; other libraries' (botocore's "Found endpoint for s3 via...", Ray's) at WARNING
    logging.getLogger("fastdata").setLevel(logging.WARNING if quiet else logging.INFO)
    report = logging.getLogger("fastdata.train")  # validation lines, the end summary, --profile's table
    if not any(isinstance(h, _StdoutHandler) for h in report.handlers):
        report.addHandler(_StdoutHandler())
        report.propagate = False
    report.setLevel(logging.WARNING if quiet else logging.INFO)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "ids") and not any(e.startswith("-") for e in extra):
        args.ids += extra  # ids after an option (`cache remove --dir D ID`): argparse took none before it
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(getattr(args, "quiet", False))
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # (here, not at exit: a reader that left is caught below)
        return code
    except BrokenPipeError:  # `fastdata inspect DATA | head -1`: the reader left, as it may
        if not _reader_left():  # (another pipe broke: a worker's, a socket's; that is an error)
            raise
        _stdout_to_devnull()
        return 1
    except FastdataError as exc:
        print(f"fastdata: error: {scrub(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = _after_interrupt(args)
        print("fastdata: interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return 130


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader closed it (poll reports POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # (no poll, or a stdout without a descriptor)
        return False


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at os.devnull, so that the flush at exit raises no second BrokenPipeError
    (the recipe of Python's `signal` docs, "Note on SIGPIPE")."""
    with contextlib.suppress(OSError, ValueError):  # (a stdout without a descriptor: nothing left to flush)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _after_interrupt(args: argparse.Namespace) -> Optional[str]:
    """What a rerun does after Ctrl-C: preprocess and push resume by themselves, train only with --resume."""
    if args.command in ("preprocess", "push"):
        return "rerun the same command to resume"
    if args.command == "train":
        if getattr(args, "checkpoint", None):
            from ..train import checkpoint

            where = scrub(str(args.checkpoint))
            try:  # (one try at a URL: Ctrl-C is no time to wait out an outage)
                saved = checkpoint.existing(checkpoint.location(args.checkpoint), retry_seconds=0)
            except FastdataError:
                return f"rerun with --resume to continue from the last checkpoint in {where}, if one was saved"
            if saved:
                return f"rerun with --resume to continue from the last checkpoint in {where}"
            return f"no checkpoint was saved in {where} yet: a rerun starts from the beginning"
        return "without --checkpoint there is nothing to resume from"
    return None

