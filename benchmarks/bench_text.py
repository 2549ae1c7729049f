"""Text: tokenisation throughput and window serving, fastdata vs the usual code, in the same run.

1. Tokenising a JSONL corpus (MB of text per second) with the bytes tokenizer and a BPE trained here:
   fastdata preprocess text (1 worker, all workers) vs a naive per-document loop with the same tokenizer
   (``ids.extend(encode(doc))``, then one ``np.array(ids, uint16)`` saved to disk).
2. Serving (B, seq_len + 1) windows: TokenDataset.get_batch vs a memcpy of the same bytes (the ceiling)
   vs the best gather of rows of the same size at random offsets (np.take of contiguous rows: the memory
   system's limit for this access pattern) vs nanoGPT's get_batch (a new np.memmap every batch, a Python
   list of windows, torch.stack). get_batch uses the compiled window copy where numba is installed (rule 5
   of NOTE [window gather]); the "gather" rows time get_batch with the copy turned off (the numpy/torch
   gather it replaces), in the same run.
3. ``--ray``: the same corpus tokenised (bytes tokenizer) by Ray tasks, one per piece of the source (NOTE [text
   pieces] in fastdata/preprocess/text.py), on 1 node of 1 CPU and on 2 nodes of 1 CPU (``ray.cluster_utils``,
   every node on 127.0.0.1), beside the local pool's 1 and 2 workers on the same cores (the ceiling of the
   1 -> 2 node row), and a check that Ray's output is the local pool's, byte for byte.
Targets (issue 7): TokenDataset >= 0.5x memcpy.

    python benchmarks/bench_text.py [--mb 20] [--seq-len 1024 4096] [--batch 64] [--ray]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fastdata
from fastdata.cli.timing import timed_rate
from fastdata.datasets.tokens import TokenDataset
from fastdata.formats.tokenizer import load_tokenizer
from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text


def corpus(path: Path, mb: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = np.array("the of and to in data loader token shard window fast training model gpu batch memory "
                     "résumé naïve 数据 über".split())
    docs, size = [], 0
    while size < mb * 1e6:
        doc = " ".join(rng.choice(words, int(rng.integers(50, 800))))
        docs.append(doc)
        size += len(doc.encode())
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    return docs


def naive(docs: list[str], encode, eos: int, out: Path) -> None:
    ids: list[int] = []
    for doc in docs:
        ids.extend(encode(doc))
        ids.append(eos)
    np.array(ids, dtype=np.uint16).tofile(out)


def ray_rows(src: Path, scratch: Path) -> dict[str, float]:
    """Seconds to tokenise ``src`` (bytes) with the local pool (1, 2 workers) and on Ray (1, 2 nodes of 1 CPU),
    best of two each; ``identical``: Ray's 2-node output is the local pool's."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every node and this driver on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    scratch.mkdir(parents=True, exist_ok=True)
    warm = scratch / "warm.jsonl"
    warm.write_text("".join(json.dumps({"text": f"warm {i}"}) + "\n" for i in range(100)))

    def run(out: Path, where: Path = src, **kw) -> float:
        shutil.rmtree(out, ignore_errors=True)
        return timed(lambda: preprocess_text(TextPreprocessConfig(src=where, out=out, val_fraction=0.0,
                                                                  progress=False, **kw)))
    res = {f"local_{w}": min(run(scratch / f"local-{w}", workers=w) for _ in range(2)) for w in (1, 2)}
    for label, nodes in (("ray_1x1", 1), ("ray_2x1", 2)):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            assert cluster.address.startswith("127.0.0.1:"), cluster.address
            ray.init(address=cluster.address, logging_level="ERROR")
            run(scratch / "warm-out", warm, engine="ray")  # the Ray workers started outside the timing
            res[label] = min(run(scratch / label, engine="ray") for _ in range(2))
        finally:
            ray.shutdown()
            cluster.shutdown()
    same = {p.name: p.read_bytes() for p in (scratch / "ray_2x1").iterdir()}
    res["identical"] = float(same == {p.name: p.read_bytes() for p in (scratch / "local-2").iterdir()})
    return res


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def windows(folder: Path, seq_len: int, batch: int, seconds: float) -> None:
    """Window serving vs a memcpy of the same bytes, vs the best gather of rows of the same size at random
    offsets (``np.take`` of contiguous rows: what the memory system gives for this access pattern), and
    vs nanoGPT's get_batch, all over the same token stream in RAM."""
    rng = np.random.default_rng(0)
    ds = TokenDataset(folder, seq_len=seq_len)
    ds_ram = TokenDataset(folder, seq_len=seq_len, storage="ram")
    length = seq_len + 1
    shards = sorted(folder.glob("train-[0-9]*.npy"))  # (not train-docs-*: sorted names are the stream's order)
    src = np.concatenate([np.load(p, allow_pickle=False) for p in shards])
    rows = src[: len(src) // length * length].reshape(-1, length)
    out = torch.empty((batch, length), dtype=ds.sample_dtype)
    dst = out.numpy()

    def rate(step) -> float:  # windows per second
        return timed_rate(lambda: (step(), batch)[1], seconds)

    def memcpy() -> None:
        a = int(rng.integers(0, len(src) - dst.size))
        np.copyto(dst.reshape(-1), src[a:a + dst.size])

    def row_gather() -> None:
        np.take(rows, rng.integers(0, len(rows), batch), axis=0, out=dst, mode="clip")

    def nanogpt() -> None:  # nanoGPT train.py get_batch, CPU part
        data = np.load(shards[0], mmap_mode="r")  # "recreate np.memmap every batch ..."
        ix = torch.randint(len(data) - seq_len - 1, (batch,))
        torch.stack([torch.from_numpy(data[i:i + seq_len + 1].astype(np.int64)) for i in ix.tolist()])

    from fastdata.datasets import window_copy
    compiled = window_copy.kernel(wait=True) is not None  # compiled before any timing (numba's cache after)

    gathers = {}
    for storage in ("mmap", "ram"):  # get_batch without the compiled copy: the path it replaces
        gathers[storage] = TokenDataset(folder, seq_len=seq_len, storage=storage)
        gathers[storage]._compiled()
        gathers[storage]._copy.usable = False

    def served(d: TokenDataset) -> float:
        return rate(lambda: d.get_batch(rng.integers(0, len(d), batch), out=out))

    r = {"memcpy": rate(memcpy), "row gather": rate(row_gather), "TokenDataset mmap": served(ds),
         "TokenDataset ram": served(ds_ram), "gather mmap": served(gathers["mmap"]),
         "gather ram": served(gathers["ram"]), "nanoGPT get_batch": rate(nanogpt)}
    gb = length * ds.np_dtype.itemsize / 1e9
    print(f"windows of {length} tokens ({length * ds.np_dtype.itemsize} B), batch {batch}, stream of "
          f"{ds.num_tokens:,} tokens")
    print(f"  {'row':<20} {'windows/s':>12} {'GB/s':>6} {'x memcpy':>9} {'x row gather':>13}")
    for name, v in r.items():
        print(f"  {name:<20} {v:>12,.0f} {v * gb:>6.2f} {v / r['memcpy']:>8.2f}x {v / r['row gather']:>12.2f}x")
    print(f"  TokenDataset mmap is {r['TokenDataset mmap'] / r['nanoGPT get_batch']:.1f}x nanoGPT's get_batch; "
          f"target (issue 7): >= 0.5x memcpy")
    print(f"  compiled copy {'in use' if compiled else 'NOT available (no numba): the rows are the gather'}: "
          f"get_batch / the gather: mmap {r['TokenDataset mmap'] / r['gather mmap']:.2f}x, "
          f"ram {r['TokenDataset ram'] / r['gather ram']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=20)
    ap.add_argument("--seq-len", type=int, nargs="*", default=[1024, 4096], help="none: no window rows")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--ray", action="store_true", help="also tokenise on a 1- and 2-node Ray cluster here")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fastdata-bench-text-"))
    try:
        docs = corpus(scratch / "c.jsonl", args.mb)
        mb = (scratch / "c.jsonl").stat().st_size / 1e6
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.train_from_iterator(docs[:2000], trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"]))
        bpe.save(str(scratch / "bpe.json"))
        cores = os.cpu_count() or 1
        print(f"fastdata {fastdata.__version__}, torch {torch.__version__}, {cores} cores, corpus {mb:.1f} MB "
              f"({len(docs)} documents)")
        print(f"{'tokenizer':<8} {'naive MB/s':>11} {'fastdata 1w':>12} {f'fastdata {cores}w':>12} {'1w/naive':>9} "
              f"{f'{cores}w/naive':>9}")
        for name, spec, encode in (("bytes", "bytes", lambda d: d.encode("utf-8")),
                                   ("bpe", str(scratch / "bpe.json"), lambda d: bpe.encode(d).ids)):
            eos = load_tokenizer(spec).eos_id
            t_naive = timed(lambda: naive(docs, encode, eos, scratch / f"naive-{name}.bin"))
            times = {}
            for w in (1, cores):
                out = scratch / f"{name}-w{w}"
                times[w] = timed(lambda: preprocess_text(TextPreprocessConfig(
                    src=scratch / "c.jsonl", out=out, tokenizer=spec, workers=w, val_fraction=0.0, progress=False)))
            print(f"{name:<8} {mb / t_naive:>11.1f} {mb / times[1]:>12.1f} {mb / times[cores]:>12.1f} "
                  f"{t_naive / times[1]:>8.2f}x {t_naive / times[cores]:>8.2f}x")
        for seq_len in args.seq_len:
            windows(scratch / "bytes-w1", seq_len, args.batch, args.seconds)
        if args.ray:
            if importlib.util.find_spec("ray") is None:
                print("ray rows skipped: pip install 'fastdata[ray]'")
            else:
                r = ray_rows(scratch / "c.jsonl", scratch / "ray")
                print(f"bytes tokenizer, MB/s: local pool 1 worker {mb / r['local_1']:.1f}, 2 workers "
                      f"{mb / r['local_2']:.1f} ({r['local_1'] / r['local_2']:.2f}x) | Ray 1 node x 1 CPU "
                      f"{mb / r['ray_1x1']:.1f}, 2 nodes x 1 CPU {mb / r['ray_2x1']:.1f} "
                      f"({r['ray_1x1'] / r['ray_2x1']:.2f}x; the local pool's own 1 -> 2: the ceiling) | Ray 2 nodes "
                      f"/ local 2 workers {r['local_2'] / r['ray_2x1']:.2f}x, byte-identical: {bool(r['identical'])}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
