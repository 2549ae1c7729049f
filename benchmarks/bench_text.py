"""Text: tokenisation throughput and window serving, fastdata vs the usual code, in the same run.

1. Tokenising a JSONL corpus (MB of text per second) with the bytes tokenizer and a BPE trained here:
   fastdata preprocess text (1 worker, all workers) vs a naive per-document loop with the same tokenizer
   (``ids.extend(encode(doc))``, then one ``np.array(ids, uint16)`` saved to disk).
2. Serving (B, seq_len + 1) windows: TokenDataset.get_batch vs a memcpy of the same bytes (the ceiling)
   vs nanoGPT's get_batch (a new np.memmap every batch, a Python list of windows, torch.stack).
Targets (issue 7): TokenDataset >= 0.5x memcpy.

    python benchmarks/bench_text.py [--mb 20] [--seq-len 1024] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import fastdata
from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text
from fastdata.tokenize import load_tokenizer
from fastdata.tokens import TokenDataset


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


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
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
        ds = TokenDataset(scratch / "bytes-w1", seq_len=args.seq_len)
        path = scratch / "bytes-w1" / "train-00000.npy"
        n_tokens = ds.num_tokens
        rng = np.random.default_rng(0)
        out = torch.empty((args.batch, args.seq_len + 1), dtype=ds.sample_dtype)
        src = np.ones(n_tokens, np.uint16)
        dst = np.empty(args.batch * (args.seq_len + 1), np.uint16)

        def rate(step) -> float:
            step()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                step()
                n += args.batch
            return n / (time.perf_counter() - t0)

        def memcpy() -> None:
            a = int(rng.integers(0, n_tokens - len(dst)))
            np.copyto(dst, src[a:a + len(dst)])

        def ours() -> None:
            ds.get_batch(rng.integers(0, len(ds), args.batch), out=out)

        def nanogpt() -> None:  # nanoGPT train.py get_batch, CPU part
            data = np.load(path, mmap_mode="r")  # "recreate np.memmap every batch to avoid a memory leak"
            ix = torch.randint(len(data) - args.seq_len - 1, (args.batch,))
            torch.stack([torch.from_numpy(data[i:i + args.seq_len + 1].astype(np.int64)) for i in ix.tolist()])

        r_mem, r_ours, r_nano = rate(memcpy), rate(ours), rate(nanogpt)
        ds_ram = TokenDataset(scratch / "bytes-w1", seq_len=args.seq_len, storage="ram")
        r_ram = rate(lambda: ds_ram.get_batch(rng.integers(0, len(ds_ram), args.batch), out=out))
        tok_b = (args.seq_len + 1) * 2 / 1e9
        print(f"windows of {args.seq_len + 1} tokens, batch {args.batch}: memcpy {r_mem:,.0f} windows/s "
              f"({r_mem * tok_b:.2f} GB/s), TokenDataset mmap {r_ours:,.0f} ({r_ours / r_mem:.2f}x memcpy, "
              f"target >= 0.5), ram {r_ram:,.0f} ({r_ram / r_mem:.2f}x), nanoGPT get_batch {r_nano:,.0f} "
              f"(TokenDataset mmap {r_ours / r_nano:.1f}x faster)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
