"""The JPEG (LMDB) read path, centre crops, side by side in one run on the same records and threads.

Rows, each at 1 and 2 threads, uint8 centre crops of --size px in batches of 256 from records stored at
shorter side 256 (ImageNet-like 500x375 sources):
- bare decoder: simplejpeg decoding each record at the scale fastdata picks, nothing else (the limit);
- fastdata: FastLoader over FastDataset(lmdb, size=--size) (decode at M/8, cut or resize, gather);
- fastdata at the stored size (256: a cut at scale 1);
- the previous path: Pillow draft + Lanczos per record (`decode.load_array`), what FastDataset did before;
- DALI's CPU pipeline (`DALILoader(device="cpu")`) and FFCV's `CenterCropRGBImageDecoder` when installed
  (skipped with a message otherwise; see ../shared/PEERS.md for installing them).
Also the PSNR of fastdata's crops against the previous (Lanczos) path on the same records.

    python benchmarks/bench_jpeg.py [--images 1024] [--size 224] [--seconds 4]
"""
from __future__ import annotations

import argparse
import io
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import simplejpeg
import torch

import fastdata
from fastdata import decode
from fastdata.dataset import FastDataset
from fastdata.formats.lmdb_store import LmdbReader
from fastdata.loader import FastLoader
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images
from fastdata.synthetic import make_image_folder
from fastdata.timing import timed_rate

BATCH = 256


def per_record_rate(records: list[bytes], fn, threads: int, seconds: float) -> float:
    """Images/s of ``fn(record)`` over every record, in batches of BATCH spread over ``threads`` threads."""
    chunks = [records[i:i + BATCH] for i in range(0, len(records), BATCH)]
    with ThreadPoolExecutor(threads) as pool:
        def one_pass() -> int:
            for chunk in chunks:
                list(pool.map(fn, chunk, chunksize=max(1, len(chunk) // threads)))
            return len(records)
        return timed_rate(one_pass, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-jpeg-"))
    try:
        make_image_folder(scratch / "jpeg", num_classes=8, per_class=args.images // 8, sizes=((500, 375), (375, 500)))
        preprocess_images(ImagePreprocessConfig(src=scratch / "jpeg", out=scratch / "lmdb", size=256, format="lmdb",
                                                progress=False))
        lmdb = scratch / "lmdb"
        records = LmdbReader(lmdb / "images.lmdb").get_many(range(args.images // 8 * 8))
        size = args.size
        print(f"fastdata {fastdata.__version__}, simplejpeg {simplejpeg.__version__}, torch {torch.__version__}; "
              f"{len(records)} records (500x375 sources stored at shorter side 256), {size}px centre crops, "
              f"batch {BATCH}")

        def bare(blob: bytes) -> np.ndarray:  # fastdata's own call into the decoder, without crop or gather
            return decode.turbo_decode(blob, size)

        def old(blob: bytes) -> np.ndarray:
            return decode.load_array(io.BytesIO(blob), size, "center-crop")

        peers = {}
        try:
            from fastdata.dali import DALILoader

            peers["DALI CPU pipeline (DALILoader, device='cpu')"] = lambda t: timed_rate(
                lambda: sum(len(x) for x, _ in DALILoader(lmdb, BATCH, size=size, train=False, device="cpu",
                                                           num_threads=t)), args.seconds)
        except ImportError as exc:
            print(f"skipped DALI: {exc}")
        try:
            import ffcv  # noqa: F401
            print("FFCV is installed, but its row is not written yet: it needs its own .beton of these records")
        except ImportError:
            print("skipped FFCV: not installed (sdist only: see ../shared/PEERS.md)")

        rows: dict[str, dict[int, float]] = {}
        for t in (1, 2):
            rows.setdefault("bare decoder (simplejpeg, same scale)", {})[t] = per_record_rate(records, bare, t,
                                                                                             args.seconds)
            ds = FastDataset(lmdb, size=size)
            rows.setdefault(f"fastdata FastLoader, size={size}", {})[t] = timed_rate(
                lambda: sum(len(x) for x, _ in FastLoader(ds, BATCH, num_threads=t, prefetch=1)), args.seconds)
            ds256 = FastDataset(lmdb)
            rows.setdefault("fastdata FastLoader, stored size 256 (cut)", {})[t] = timed_rate(
                lambda: sum(len(x) for x, _ in FastLoader(ds256, BATCH, num_threads=t, prefetch=1)), args.seconds)
            rows.setdefault("previous path (Pillow draft + Lanczos)", {})[t] = per_record_rate(records, old, t,
                                                                                              args.seconds)
            for name, run in peers.items():
                rows.setdefault(name, {})[t] = run(t)
        ours = rows[f"fastdata FastLoader, size={size}"]
        print(f"\n{'row':<48} {'1 thread':>10} {'2 threads':>10} {'1->2':>6} {'fastdata / row (1t, 2t)':>24}")
        for name, r in rows.items():
            print(f"{name:<48} {r[1]:>10,.0f} {r[2]:>10,.0f} {r[2] / r[1]:>5.2f}x "
                  f"{ours[1] / r[1]:>11.2f}x {ours[2] / r[2]:>10.2f}x")
        sample = records[:200]
        psnr = [10 * np.log10(255 ** 2 / max(1e-12, float(((decode.decode_jpeg(b, size).astype(float)
                                                             - old(b).astype(float)) ** 2).mean()))) for b in sample]
        print(f"\nPSNR of fastdata's {size}px crops against the previous Lanczos path, {len(sample)} records: "
              f"mean {np.mean(psnr):.1f} dB, min {np.min(psnr):.1f} dB")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
