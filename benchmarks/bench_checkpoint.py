"""Checkpoints in object storage: how long a save holds training, against a save to a local folder and a
blocking upload of the same state, in one run (moto's S3 server on 127.0.0.1, in its own process).

Rows, each the best of --rounds (this machine's timings are noisy):
- local folder: `checkpoint.write` to a folder (serialised, fsynced, generations shifted): training waits
  for all of it, as before checkpoints could go to a URL;
- URL, blocking: `Saves.save(..., wait=True)`: serialised, uploaded, generations copied within the store;
- URL, fit's saves: `Saves.save(..., wait=False)`, what `Trainer.fit` does: training waits for the
  serialisation only, the upload going on meanwhile ("then uploading": the rest, waited for by `finish`);
- one PUT: the serialised bytes put once with fsspec, nothing else: the floor of a blocking upload.

The state is a model's weights and an SGD momentum buffer per weight (--model, default resnet50: ~200 MB),
the generations kept 2.

    python benchmarks/bench_checkpoint.py [--model resnet50] [--rounds 3]
"""
from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_remote import moto_server  # noqa: E402

import fastdata  # noqa: E402
from fastdata.storage.object_store import filesystem  # noqa: E402
from fastdata.train import checkpoint  # noqa: E402
from fastdata.train.models import create_model  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=1000)
    state = {"model": model.state_dict(), "momentum": [p.detach().clone() for p in model.parameters()], "step": 1}
    buf = io.BytesIO()
    torch.save(state, buf)
    nbytes = buf.tell()
    scratch = Path(tempfile.mkdtemp(prefix="bench_checkpoint-"))
    server, endpoint = moto_server()
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} CPUs; {args.model} weights + momentum: {nbytes / 1e6:.0f} MB a checkpoint; "
              f"moto server on {endpoint}; TMPDIR {tempfile.gettempdir()}")
        (scratch / "one.pt").write_bytes(buf.getvalue())
        fs, _ = filesystem("s3://bench")
        best: dict[str, float] = {}

        def keep(name: str, seconds: float) -> None:
            best[name] = min(best.get(name, float("inf")), seconds)
        for r in range(args.rounds):  # interleaved rounds, best kept
            keep("local folder", timed(lambda: checkpoint.write(scratch / f"ck{r}" / "checkpoint.pt", state)))
            url = f"s3://bench/run{r}/checkpoint.pt"
            checkpoint.write(url, state)  # a generation to shift, as every save but a run's first has
            keep("URL, blocking", timed(lambda: checkpoint.Saves().save(url, state, wait=True)))
            saves = checkpoint.Saves()
            keep("URL, fit's saves", timed(lambda: saves.save(url, state, wait=False)))
            keep("  then uploading", timed(saves.finish))
            keep("one PUT", timed(lambda: fs.put_file(str(scratch / "one.pt"), f"bench/put{r}.pt")))
        print(f"{'save':>18} {'training waits s':>17}")
        for name in ("local folder", "URL, blocking", "URL, fit's saves", "  then uploading", "one PUT"):
            print(f"{name:>18} {best[name]:17.3f}")
        fit, blocking = best["URL, fit's saves"], best["URL, blocking"]
        print(f"training waits {blocking / fit:.1f}x less for fit's saves than for a blocking upload, "
              f"{best['local folder'] / fit:.1f}x less than for a local folder; the blocking upload costs "
              f"{blocking / best['one PUT']:.2f}x one PUT")
    finally:
        server.terminate()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
