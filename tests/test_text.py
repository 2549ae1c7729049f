"""Text preprocessing and TokenDataset: exact round trips, shards, determinism, resume, bad input."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import journaled_units, kill_when_journaled

from fastdata.cli.main import main
from fastdata.datasets.tokens import TokenDataset, shard_of, splitmix
from fastdata.errors import ConfigError, FormatError
from fastdata.formats.tokenizer import load_tokenizer
from fastdata.preprocess.text_tasks import file_seed, is_val

WORDS = "the quick brown fox jumps over a lazy dog ünïcödé 数据 loader — token shard window €".split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) + ("\n" if i % 3 else "") for i in range(n)]


def write_jsonl(path: Path, docs: list[str], gz: bool = False) -> Path:
    data = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def stream(out: Path, split: str) -> np.ndarray:
    m = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.load(out / s["path"]) for s in m["splits"][split]["shards"]])


def jsonl_val(docs: list[str], fraction: float, file_index: int = 0, seed: int = 0) -> np.ndarray:
    """Which of a `write_jsonl` file's documents go to val: a hash of the file's place in the source and each
    line's byte offset (NOTE [text pieces] 4)."""
    sizes = [len((json.dumps({"text": d}, ensure_ascii=False) + "\n").encode()) for d in docs]
    return is_val(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64), fraction, file_seed(seed, file_index))


def docs_of(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(tokens == eos)
    return np.split(tokens, cuts + 1)[:-1]


def preprocess(src: Path, out: Path, *extra: str) -> None:
    assert main(["preprocess", "text", str(src), str(out), "--quiet", "--workers", "1", *extra]) == 0


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 1000), "its shards hold"),
    (lambda m: m.update(dtype="<i8"), "token dtype '<i8'"),
    (lambda m: m.pop("splits"), "no 'splits'"),
], ids=["tokens", "dtype", "splits"])
def test_a_token_manifest_that_cannot_describe_its_shards_is_refused(tmp_path, edit, needle):
    from fastdata.errors import FormatError

    out = tmp_path / "out"
    preprocess(write_jsonl(tmp_path / "d.jsonl", make_docs(200)), out, "--shard-tokens", "1000")
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    (out / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="the manifest is damaged") as err:  # before: IndexError or KeyError
        TokenDataset(out, seq_len=16)
    assert needle in str(err.value)


@pytest.mark.parametrize("claimed", [1000, 1 << 42])
@pytest.mark.parametrize("storage", ["mmap", "ram", "shm"])
def test_a_shard_whose_token_count_is_not_its_files_is_refused_in_every_storage(tmp_path, storage, claimed):
    """storage="shm" built its copy's header from the manifest's counts and its size from the files: a shard
    claiming fewer tokens than it holds was served cut short, and 2^42 tokens left a copy naming that shape
    in the shm folder; storage="ram" asked numpy for 8 TiB before comparing."""
    from fastdata.errors import FormatError
    from fastdata.storage import shm

    out = tmp_path / "out"
    preprocess(write_jsonl(tmp_path / "d.jsonl", make_docs(200)), out, "--shard-tokens", "100000")
    m = json.loads((out / "manifest.json").read_text())
    assert len(m["splits"]["train"]["shards"]) == 1
    m["splits"]["train"]["shards"][0]["tokens"] = m["splits"]["train"]["tokens"] = claimed
    (out / "manifest.json").write_text(json.dumps(m))
    folder = tmp_path / "shm"
    folder.mkdir(0o700)
    kw = {"shm_dir": folder} if storage == "shm" else {}
    with pytest.raises(FormatError, match="the manifest is damaged|holds .* the manifest says"):
        TokenDataset(out, seq_len=16, storage=storage, verify=True, **kw)
    if storage == "shm":
        assert shm.list_copies(folder) == []


@pytest.mark.parametrize("gz", [False, True])
def test_bytes_round_trip_across_many_shards(tmp_path, gz):
    docs = make_docs(300)
    src = write_jsonl(tmp_path / ("d.jsonl.gz" if gz else "d.jsonl"), docs, gz)
    out = tmp_path / "out"
    preprocess(src, out, "--val-fraction", "0.2", "--shard-tokens", "700")
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "fastdata.tokens" and m["format_version"] == 2 and m["dtype"] == "<u2"
    assert m["tokenizer"]["eos_id"] == 256
    assert len(m["splits"]["train"]["shards"]) > 10  # documents spread over many shards...
    # (plain: cut into ~16 byte ranges read by their own tasks; gzipped: one task reads it whole)
    val = jsonl_val(docs, 0.2)
    for split, want in (("train", [d for d, v in zip(docs, val) if not v]),
                        ("val", [d for d, v in zip(docs, val) if v])):
        got = [bytes(d[:-1].astype(np.uint8)).decode() for d in docs_of(stream(out, split), 256)]
        assert got == want  # ...and not one byte lost at their boundaries
        assert m["splits"][split]["documents"] == len(want)
        for sh in m["splits"][split]["shards"]:  # each shard's documents start where its offsets say
            tokens, starts = np.load(out / sh["path"]), np.load(out / sh["docs"])
            assert starts.dtype == np.int64 and len(starts) == sh["documents"] + 1 and starts[0] == 0
            assert starts[-1] == sh["tokens"] == len(tokens)
            assert np.array_equal(np.flatnonzero(tokens == 256) + 1, starts[1:])
    assert 0 < len([v for v in val if v]) < len(docs)


def test_hf_bpe_trained_here_round_trips(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    docs = make_docs(200, seed=1)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    out = tmp_path / "out"
    preprocess(src, out, "--tokenizer", str(tmp_path / "tokenizer.json"), "--val-fraction", "0",
               "--shard-tokens", "900")
    m = json.loads((out / "manifest.json").read_text())
    eos = tok.token_to_id("<|endoftext|>")
    assert m["tokenizer"]["kind"] == "huggingface" and m["tokenizer"]["eos_id"] == eos
    got = [tok.decode(d[:-1].tolist()) for d in docs_of(stream(out, "train"), eos)]
    assert got == docs
    assert m["bytes_per_token"] > 1.5  # BPE merges: fewer tokens than bytes
    with pytest.raises(FormatError, match="tokenised with"):
        TokenDataset(out, seq_len=8, tokenizer="bytes")
    TokenDataset(out, seq_len=8, tokenizer=str(tmp_path / "tokenizer.json"))  # the same tokenizer: accepted
    ours = load_tokenizer(str(tmp_path / "tokenizer.json"))  # fastdata's wrapper decodes what it encoded
    assert [ours.decode(ids) for ids in ours.encode_batch(docs)] == docs


def test_bytes_tokenizer_decodes_what_it_encodes_and_drops_the_end_of_document():
    tok = load_tokenizer("bytes")
    texts = ["plain", "ünïcødé ✓", ""]
    ids = tok.encode_batch(texts)
    assert [tok.decode(i) for i in ids] == texts
    assert tok.decode(list(ids[0]) + [tok.eos_id] + list(ids[1])) == "plain" + texts[1]


@pytest.fixture
def token_folder(tmp_path) -> Path:
    out = tmp_path / "tok"
    preprocess(write_jsonl(tmp_path / "d.jsonl", make_docs(400)), out, "--val-fraction", "0.1",
               "--shard-tokens", "1000")
    return out


@pytest.mark.parametrize("storage", ["mmap", "ram", "shm"])
def test_windows_are_shifted_by_one_and_match_the_stream(token_folder, tmp_path, storage):
    kw = {"shm_dir": tmp_path / "shm"} if storage == "shm" else {}
    if storage == "shm":
        (tmp_path / "shm").mkdir()
    ds = TokenDataset(token_folder, "train", seq_len=50, storage=storage, **kw)
    s = stream(token_folder, "train")
    assert len(ds) == (len(s) - 51) // 50 + 1
    idx = [0, 1, 19, 20, len(ds) - 1, 7]  # includes windows across the 1000-token shard boundaries
    x, y = ds.get_batch(idx)
    assert x.dtype == torch.uint16 and x.shape == (6, 50)
    for row, i in enumerate(idx):
        assert np.array_equal(x[row].numpy(), s[i * 50: i * 50 + 50])
        assert np.array_equal(y[row].numpy(), s[i * 50 + 1: i * 50 + 51])
    xi, yi = ds[3]
    assert xi.dtype == torch.int64 and torch.equal(xi[1:], yi[:-1])
    buf = torch.full((8, 51), 7, dtype=torch.uint16)  # into a given buffer (FastLoader's ring): the same rows
    xb, yb = ds.get_batch(idx, out=buf)
    assert torch.equal(xb, x) and torch.equal(yb, y) and xb.data_ptr() == buf.data_ptr()
    assert (buf[6:] == 7).all()  # rows past the batch untouched
    for bad in (torch.empty((8, 50), dtype=torch.uint16), torch.empty((3, 51), dtype=torch.uint16),
                torch.empty((8, 51), dtype=torch.int64), torch.empty((51, 8), dtype=torch.uint16).t()):
        with pytest.raises(ConfigError, match="out must be"):
            ds.get_batch(idx, out=bad)


def test_stride_and_random_windows(token_folder):
    s = stream(token_folder, "train")
    ds = TokenDataset(token_folder, seq_len=32, stride=8)
    assert np.array_equal(ds[5][0].numpy(), s[40:72])
    rnd = TokenDataset(token_folder, seq_len=32, random_windows=True, seed=3)
    starts = rnd.starts(np.arange(len(rnd)))
    assert starts.min() >= 0 and starts.max() <= len(s) - 33 and len(np.unique(starts)) > len(rnd) * 0.9
    assert np.array_equal(rnd.starts(np.arange(10)), TokenDataset(token_folder, seq_len=32, random_windows=True,
                                                                  seed=3).starts(np.arange(10)))
    x, _ = rnd.get_batch([4])
    assert np.array_equal(x[0].numpy(), s[starts[4]:starts[4] + 32])
    idx = np.arange(len(rnd))  # every random window, many across shard boundaries, into a buffer
    x, _ = rnd.get_batch(idx, out=torch.empty((len(idx), 33), dtype=torch.uint16))
    assert np.array_equal(x.numpy(), s[starts[:, None] + np.arange(32)])


def test_fastloader_and_dataloader_serve_token_windows(token_folder):
    from fastdata.gpu.prefetch import CUDAPrefetcher
    from fastdata.loading.loader import FastLoader

    ds = TokenDataset(token_folder, seq_len=40)
    seen = []
    for x, y in CUDAPrefetcher(FastLoader(ds, 16, seed=1), device="cpu"):
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
        seen += [tuple(r.tolist()) for r in x]
    all_rows = [tuple(ds[i][0].tolist()) for i in range(len(ds))]
    assert sorted(seen) == sorted(all_rows)
    batches = list(torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2))
    assert sum(len(b[0]) for b in batches) == len(ds) and batches[0][0].dtype == torch.int64


def test_identical_output_for_1_and_2_workers(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    for i, d in enumerate(make_docs(60)):
        (src / f"{i:03d}.txt").write_text(d * 50)
    outs = []
    for w in ("1", "2"):
        assert main(["preprocess", "text", str(src), str(tmp_path / w), "--workers", w, "--shard-tokens", "20000",
                     "--quiet"]) == 0
        outs.append({p.name: p.read_bytes() for p in sorted((tmp_path / w).iterdir())})
    assert outs[0] == outs[1] and len(outs[0]) > 6


@pytest.mark.slow
def test_killed_run_resumes_to_identical_output(tmp_path):
    src = tmp_path / "docs"
    src.mkdir()
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghij klmnopqrstuvwxyz \n", dtype=np.uint8)
    for i in range(30):
        (src / f"{i:03d}.txt").write_bytes(letters[rng.integers(0, len(letters), 1_500_000)].tobytes())
    # first in the source: a JSON Lines file cut into 5 parts, bad lines in its later parts, so the resumed run
    # must number them from the journaled parts' line counts (NOTE [text pieces] 5)
    lines = [json.dumps({"text": letters[rng.integers(0, 27, 300)].tobytes().decode()}).encode() + b"\n"
             for _ in range(25_000)]
    bad = [9_000, 15_000, 24_000]
    for i in bad:
        lines[i] = b"{not json\n"
    (src / "000.jsonl").write_bytes(b"".join(lines))
    args = ["--workers", "1", "--shard-tokens", "400000", "--quiet", "--val-fraction", "0.1"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main(["preprocess", "text", str(src), str(ref), *args]) == 0
    m = json.loads((ref / "manifest.json").read_text())
    assert [(e["file"], e["line"]) for e in m["skipped"]] == [("000.jsonl", i + 1) for i in bad]
    kill_when_journaled([sys.executable, "-m", "fastdata", "preprocess", "text", str(src), str(out), *args], out, 1)
    assert len(journaled_units(out)) < 5  # killed inside the cut file's parts
    assert main(["preprocess", "text", str(src), str(out), *args]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in ref.iterdir()}


def test_bad_documents_are_skipped_and_reported(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", ["good one", "good two"])
    with open(src / "a.jsonl", "ab") as f:
        f.write(b'{"text": "bad utf8 \xff\xfe"}\n' + b"not json at all\n" + b'{"title": "no text"}\n'
                + b'{"text": 5}\n' + b'{"text": "fine"}\n')
    (src / "b.txt").write_bytes(b"")
    (src / "c.txt").write_text("a whole file document")
    out = tmp_path / "out"
    assert main(["preprocess", "text", str(src), str(out), "--val-fraction", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped_count"] == 5 and m["splits"]["train"]["documents"] == 4
    where = [(e["file"], e["line"], e["reason"].split(" (")[0]) for e in m["skipped"]]
    assert where == [("a.jsonl", 3, "invalid UTF-8 at byte 19"), ("a.jsonl", 4, "invalid JSON"),
                     ("a.jsonl", 5, "missing field 'text'"), ("a.jsonl", 6, "field 'text' is not a string"),
                     ("b.txt", 0, "empty document")]
    assert "a.jsonl:3" in err and "skipped 5" in err
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "text", str(src), str(tmp_path / "o2"),
                        "--on-error", "fail", "--quiet"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "a.jsonl:3: invalid UTF-8" in r.stderr


def test_quiet_prints_the_summary_only_when_documents_were_skipped(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", ["good one", "good two"])
    assert main(["preprocess", "text", str(src), str(tmp_path / "q"), "--val-fraction", "0", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["preprocess", "text", str(src), str(tmp_path / "v"), "--val-fraction", "0"]) == 0
    assert "2 documents" in capsys.readouterr().err


def test_offsets_beyond_2_31_and_2_32():
    offsets = np.array([0, 3_000_000_000, 6_000_000_000, 9_500_000_000], dtype=np.int64)
    starts = np.array([0, 2**31 + 5, 2_999_999_999, 3_000_000_000, 2**32 + 7, 9_499_999_999], dtype=np.int64)
    assert shard_of(starts, offsets).tolist() == [0, 0, 0, 1, 1, 2]
    span = np.uint64(9_500_000_000)
    r = splitmix(1, np.arange(2**33, 2**33 + 1000, dtype=np.uint64)) % span
    assert r.max() > 2**32 and r.max() < 9_500_000_000  # offsets reach past 2**32 and stay in range
    assert is_val(np.array([2**40, 2**40 + 1]), 0.5, 0).dtype == bool


def test_inspect_verify_and_tiktoken_offline(token_folder, capsys):
    assert main(["inspect", str(token_folder)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer: bytes" in out and "documents" in out and "source bytes/token" in out
    assert main(["verify", str(token_folder), "--quiet"]) == 0
    r = subprocess.run([sys.executable, "-m", "fastdata", "preprocess", "text", str(token_folder / "x.txt"),
                        str(token_folder.parent / "o"), "--tokenizer", "tiktoken:gpt2"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and ("never downloads" in r.stderr or
                                                                   "pip install tiktoken" in r.stderr)


@pytest.mark.slow
def test_gpt_tiny_lowers_the_loss_on_repetitive_text(tmp_path):
    docs = ["the cat sat on the mat. " * 20] * 40
    out = tmp_path / "tok"
    preprocess(write_jsonl(tmp_path / "d.jsonl", docs), out, "--val-fraction", "0.1")
    log = tmp_path / "log.jsonl"
    assert main(["train", str(out), "--model", "gpt-tiny", "--seq-len", "32", "--batch-size", "16", "--max-steps",
                 "120", "--epochs", "1000", "--lr", "0.003", "--optimizer", "adamw", "--schedule", "constant",
                 "--device", "cpu", "--log-every", "20", "--val-every", "1000", "--val-every-steps", "120",
                 "--log-file", str(log), "--quiet"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    train = [r["loss"] for r in records if r["event"] == "train"]
    val = [r for r in records if r["event"] == "val"]
    # The first interval averages the untrained model (~3.1); 9 distinct characters alone give ~2.15 (the
    # unigram plateau); below that the model has learnt the repetition.
    assert train[-1] < 0.6 * train[0] and train[-1] < 1.9
    assert len(val) == 1 and val[0]["val_perplexity"] < 6
    for r in (r for r in records if r["event"] == "train"):  # windows/s and tokens/s, 32 targets per window
        assert r["tokens_per_s"] == pytest.approx(32 * r["samples_per_s"])


def test_damaged_token_shards_are_refused(token_folder):
    from fastdata.errors import ChecksumError

    name = json.loads((token_folder / "manifest.json").read_text())["splits"]["train"]["shards"][2]["path"]
    shard = token_folder / name
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"{name} does not match its checksum"):
        TokenDataset(token_folder, seq_len=16, storage="ram")  # ram hashes while it reads
    with pytest.raises(ChecksumError, match=rf"{name} does not match"):
        TokenDataset(token_folder, seq_len=16, verify=True)
    TokenDataset(token_folder, seq_len=16)  # mmap checks sizes only, by default
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(ChecksumError, match=rf"{name} has .* truncated"):
        TokenDataset(token_folder, seq_len=16)


def test_parquet_rows_are_documents_with_the_jsonl_files_tokens(tmp_path, capsys):
    # FineWeb's layout: a folder of Parquet files with a "text" column, read a batch of rows at a time
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = make_docs(120)
    (tmp_path / "j").mkdir()
    write_jsonl(tmp_path / "j" / "a.jsonl", docs)
    (tmp_path / "p").mkdir()
    for part, rows in enumerate((docs[:50], docs[50:])):
        pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), tmp_path / "p" / f"{part}.parquet",
                       row_group_size=16)
    preprocess(tmp_path / "j" / "a.jsonl", tmp_path / "from-jsonl", "--val-fraction", "0", "--shard-tokens", "700")
    preprocess(tmp_path / "p", tmp_path / "from-parquet", "--val-fraction", "0.2", "--shard-tokens", "700")
    all_docs = docs_of(stream(tmp_path / "from-jsonl", "train"), 256)
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in all_docs] == docs
    # a Parquet row goes to val by a hash of its file's place and its row (both files cut by row groups)
    val = np.concatenate([is_val(np.arange(50, dtype=np.uint64), 0.2, file_seed(0, 0)),
                          is_val(np.arange(70, dtype=np.uint64), 0.2, file_seed(0, 1))])
    for split, want in (("train", ~val), ("val", val)):
        got = docs_of(stream(tmp_path / "from-parquet", split), 256)
        assert [d.tobytes() for d in got] == [d.tobytes() for d, v in zip(all_docs, want) if v]
    # bad rows are skipped and named by file and row (from 1); a file without the column is named once
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pa.table({"text": ["one", None, "", "two"]}), bad / "a.parquet")
    pq.write_table(pa.table({"body": ["no text column"]}), bad / "b.parquet")
    (bad / "c.parquet").write_bytes(b"PAR1 not a parquet file")
    assert main(["preprocess", "text", str(bad), str(tmp_path / "out"), "--val-fraction", "0", "--quiet"]) == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["splits"]["train"]["documents"] == 2
    assert [(e["file"], e["line"], e["reason"].split(" (")[0]) for e in m["skipped"]] == [
        ("a.parquet", 2, "missing field 'text'"), ("a.parquet", 3, "empty document"),
        ("b.parquet", 0, "no column 'text'"), ("c.parquet", 0, "unreadable")]
    assert "skipped 4" in capsys.readouterr().err


# -- zstandard (.jsonl.zst: The Pile, SlimPajama, RedPajama) and JSON Lines named .json.gz (C4, Dolma) ------------
def zst(data: bytes, frames: int = 1) -> bytes:
    """``data`` as ``frames`` zstd frames one after another (pzstd's output), cut at byte positions mid-line."""
    zstandard = pytest.importorskip("zstandard")
    cuts = np.linspace(0, len(data), frames + 1).astype(int)
    return b"".join(zstandard.ZstdCompressor(write_checksum=True).compress(data[a:b])
                    for a, b in zip(cuts[:-1], cuts[1:]))


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()


def same_shards(want: Path, got: Path) -> None:
    """The same documents in each split, in order (a plain file is cut into parts, a compressed one is not: the
    pieces, so the shards' bounds, differ)."""
    for split in ("train", "val"):
        a, b = stream(want, split), stream(got, split)
        assert a.dtype == b.dtype and np.array_equal(a, b) and len(docs_of(a, 256)) > (10 if split == "train" else 0)


@pytest.mark.parametrize("name, frames", [("d.jsonl.zst", 1), ("d.jsonl.zst", 7), ("d.json.gz", 0),
                                          ("d.json.zst", 1)], ids=["jsonl.zst", "frames", "json.gz", "json.zst"])
def test_zstd_and_json_gz_files_give_the_jsonl_files_tokens(tmp_path, name, frames):
    data = jsonl_bytes(make_docs(300))
    (tmp_path / "d.jsonl").write_bytes(data)
    (tmp_path / name).write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else zst(data, frames))
    args = ("--val-fraction", "0.2", "--shard-tokens", "700")
    preprocess(tmp_path / "d.jsonl", tmp_path / "want", *args)
    preprocess(tmp_path / name, tmp_path / "got", *args)
    same_shards(tmp_path / "want", tmp_path / "got")


def test_hostile_json_lines_are_skipped_and_counted_not_the_end_of_the_run(tmp_path):
    """A lone surrogate (a "\\ud800" escape), an integer of 5,000 digits and arrays nested 10^5 deep each
    stopped the run with a traceback (UnicodeEncodeError, ValueError, RecursionError); each is one skipped
    document, and the others are the tokens of the same file without them."""
    docs = make_docs(30)
    good = jsonl_bytes(docs)
    bad = [b'{"text": "a\\ud800b"}\n', b'{"text": "x", "n": ' + b"7" * 5000 + b"}\n",
           b'{"text": "y", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"]
    lines = good.splitlines(keepends=True)
    (tmp_path / "bad.jsonl").write_bytes(b"".join(lines[:10] + bad[:2] + lines[10:20] + bad[2:] + lines[20:]))
    (tmp_path / "good.jsonl").write_bytes(good)
    preprocess(tmp_path / "bad.jsonl", tmp_path / "got", "--val-fraction", "0")
    preprocess(tmp_path / "good.jsonl", tmp_path / "want", "--val-fraction", "0")
    assert np.array_equal(stream(tmp_path / "got", "train"), stream(tmp_path / "want", "train"))
    m = json.loads((tmp_path / "got" / "manifest.json").read_text())
    assert m["skipped_count"] == 3 and [e["line"] for e in m["skipped"]] == [11, 12, 23], m["skipped"]
    assert "lone surrogate" in m["skipped"][0]["reason"] and "4300 digits" in m["skipped"][1]["reason"]
    assert "RecursionError" in m["skipped"][2]["reason"]


def test_a_damaged_zstd_frame_keeps_the_documents_of_the_frames_before_it(tmp_path):
    """Frames one after another, the last one damaged: every document of the whole frames before it is kept
    (as gzip keeps what it read before the damage), the damage counted once (before: none were kept)."""
    zstandard = pytest.importorskip("zstandard")
    docs = make_docs(40)
    first, rest = jsonl_bytes(docs[:30]), jsonl_bytes(docs[30:])
    damaged = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(rest))
    for k in range(12, len(damaged) - 8):
        damaged[k] ^= 0x5A
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(first) +
                                           bytes(damaged))
    (tmp_path / "want.jsonl").write_bytes(first)
    preprocess(tmp_path / "d.jsonl.zst", tmp_path / "got", "--val-fraction", "0")
    preprocess(tmp_path / "want.jsonl", tmp_path / "want", "--val-fraction", "0")
    got = stream(tmp_path / "got", "train")
    assert np.array_equal(got[:len(stream(tmp_path / "want", "train"))], stream(tmp_path / "want", "train"))
    m = json.loads((tmp_path / "got" / "manifest.json").read_text())
    assert any("unreadable" in e["reason"] for e in m["skipped"]), m["skipped"]


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "parts"])
def test_a_damaged_parquet_row_group_costs_its_own_rows_only_and_is_counted(tmp_path, cut):
    """The last of four row groups damaged: read whole, the batch spanning row groups lost the 30 good rows
    with it; cut into parts, the part holding it dropped its rows without a word (an OSError taken for a file
    part 0 had reported). Both keep the three good row groups' documents and count the damaged one."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = [f"document number {i} " + "lorem ipsum " * 5 for i in range(40)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet", row_group_size=10, compression="snappy",
                   use_dictionary=False)
    start = pq.ParquetFile(tmp_path / "a.parquet").metadata.row_group(3).column(0).data_page_offset
    data = bytearray((tmp_path / "a.parquet").read_bytes())
    for k in range(start + 40, start + 200):
        data[k] ^= 0x5A
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.parquet").write_bytes(bytes(data))
    pq.write_table(pa.table({"text": docs[:30]}), tmp_path / "want.parquet", row_group_size=10)
    extra = ("--val-fraction", "0", *(("--shard-tokens", "1") if cut else ()))
    preprocess(tmp_path / "src", tmp_path / "got", *extra)
    preprocess(tmp_path / "want.parquet", tmp_path / "want", "--val-fraction", "0")
    assert np.array_equal(stream(tmp_path / "got", "train"), stream(tmp_path / "want", "train"))
    m = json.loads((tmp_path / "got" / "manifest.json").read_text())
    assert m["skipped_count"] == 1 and "row group 3 (rows 31 to 40 lost" in m["skipped"][0]["reason"], m["skipped"]


def test_a_folder_of_txt_zst_files_gives_the_txt_files_tokens(tmp_path):
    for kind in ("txt", "zst"):
        (tmp_path / kind).mkdir()
    for i, d in enumerate(make_docs(40)):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(d * 20)
        (tmp_path / "zst" / f"{i:03d}.txt.zst").write_bytes(zst((d * 20).encode()))
    for kind in ("txt", "zst"):
        preprocess(tmp_path / kind, tmp_path / f"out-{kind}", "--val-fraction", "0.2", "--shard-tokens", "2000")
    same_shards(tmp_path / "out-txt", tmp_path / "out-zst")


def test_a_hugging_face_folder_is_read_without_its_dataset_info_json(tmp_path, capsys):
    src = tmp_path / "c4"
    (src / "en").mkdir(parents=True)
    # one JSON object with a "text" key: read as JSON Lines it would be one more document
    (src / "dataset_info.json").write_text(json.dumps({"text": "the dataset card", "splits": {}}) + "\n")
    (src / "en" / "c4-train.00000-of-00002.json.gz").write_bytes(gzip.compress(jsonl_bytes(["a", "b"]), mtime=0))
    (src / "en" / "c4-train.00001-of-00002.json.zst").write_bytes(zst(jsonl_bytes(["c"])))
    assert main(["preprocess", "text", str(src), str(tmp_path / "out"), "--val-fraction", "0", "--quiet"]) == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["source"]["files"] == 2 and m["splits"]["train"]["documents"] == 3 and m["skipped_count"] == 0
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs_of(stream(tmp_path / "out", "train"), 256)] \
        == ["a", "b", "c"]
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "dataset_info.json").write_text("{}\n")
    for bad, says in ((tmp_path / "only", "holds no .txt"), (tmp_path / "only" / "dataset_info.json", "is not one of")):
        assert main(["preprocess", "text", str(bad), str(tmp_path / "o2"), "--quiet"]) == 1
        assert says in capsys.readouterr().err
    assert not (tmp_path / "o2" / "manifest.json").exists()


def test_a_cut_short_zst_is_skipped_and_named_as_a_cut_short_gz_is(tmp_path, capsys):
    good = make_docs(50, seed=1)
    cut_gz = [f"gz: {d}" for d in make_docs(3000, seed=2)]  # ~450 KB: several 128 KiB blocks, half of them read
    cut_zst = [f"zst: {d}" for d in make_docs(3000, seed=3)]
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(jsonl_bytes(good))
    gz_bytes, zst_bytes = gzip.compress(jsonl_bytes(cut_gz), mtime=0), zst(jsonl_bytes(cut_zst))
    (src / "b.jsonl.gz").write_bytes(gz_bytes[:len(gz_bytes) // 2])
    (src / "c.jsonl.zst").write_bytes(zst_bytes[:len(zst_bytes) // 2])
    (src / "d.jsonl.zst").write_bytes(b"not zstandard at all\n" * 10)
    (src / "e.jsonl.zst").write_bytes(zst_bytes[:3])  # cut inside the frame's header
    (src / "f.jsonl").write_bytes(jsonl_bytes(good[:5]))
    out = tmp_path / "out"
    assert main(["preprocess", "text", str(src), str(out), "--val-fraction", "0", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    ended = "unreadable (Compressed file ended before the end-of-stream marker was reached)"
    assert [(e["file"], e["line"]) for e in m["skipped"]] == [(n, 0) for n in ("b.jsonl.gz", "c.jsonl.zst",
                                                                                "d.jsonl.zst", "e.jsonl.zst")]
    assert [e["reason"] for e in m["skipped"]][:2] == [ended, ended] and m["skipped"][3]["reason"] == ended
    assert m["skipped"][2]["reason"].startswith("unreadable (") and "zstd" in m["skipped"][2]["reason"]
    got = [bytes(d[:-1].astype(np.uint8)).decode() for d in docs_of(stream(out, "train"), 256)]
    assert got[:50] == good and got[-5:] == good[:5]  # the other files' documents, in order
    kept_gz = [d for d in got[50:-5] if d.startswith("gz: ")]
    kept_zst = got[50 + len(kept_gz):-5]
    assert kept_gz == cut_gz[:len(kept_gz)] and kept_zst == cut_zst[:len(kept_zst)]  # what came before the cut
    assert 0 < len(kept_zst) < len(cut_zst)
    assert "c.jsonl.zst: unreadable" in capsys.readouterr().err
    assert main(["preprocess", "text", str(src / "c.jsonl.zst"), str(tmp_path / "o2"), "--on-error", "fail",
                 "--quiet"]) == 1
    assert "c.jsonl.zst: unreadable (Compressed file ended" in capsys.readouterr().err


def test_bad_lines_inside_a_jsonl_zst_are_named_by_line(tmp_path, capsys):
    data = (jsonl_bytes(["good one", "good two"]) + b"not json at all\n" + b'{"text": "bad utf8 \xff"}\n'
            + b'{"title": "no text"}\n' + jsonl_bytes(["fine"]))
    (tmp_path / "d.jsonl.zst").write_bytes(zst(data, frames=4))  # frame ends inside lines
    out = tmp_path / "out"
    assert main(["preprocess", "text", str(tmp_path / "d.jsonl.zst"), str(out), "--val-fraction", "0",
                 "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert [(e["file"], e["line"], e["reason"].split(" (")[0]) for e in m["skipped"]] == [
        ("d.jsonl.zst", 3, "invalid JSON"), ("d.jsonl.zst", 4, "invalid UTF-8 at byte 19"),
        ("d.jsonl.zst", 5, "missing field 'text'")]
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs_of(stream(out, "train"), 256)] == [
        "good one", "good two", "fine"]
    assert "d.jsonl.zst:3: invalid JSON" in capsys.readouterr().err


def test_a_jsonl_zst_is_decompressed_as_it_is_read(tmp_path):
    import tracemalloc

    from fastdata.preprocess.documents import Part, PartDocuments, text_files

    rng = np.random.default_rng(0)
    n, width = 50_000, 160  # 8.7 MB of JSON Lines, ~5 MB compressed (random letters)
    rows = np.empty((n, width + 13), np.uint8)
    rows[:, :10] = np.frombuffer(b'{"text": "', np.uint8)
    rows[:, 10:-3] = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", np.uint8)[rng.integers(0, 27, (n, width))]
    rows[:, -3:] = np.frombuffer(b'"}\n', np.uint8)
    (tmp_path / "big.jsonl.zst").write_bytes(zst(rows.tobytes()))
    files = text_files(tmp_path / "big.jsonl.zst")
    tracemalloc.start()
    try:
        count = sum(1 for _, _, text, _ in PartDocuments(Part(files[0], 0), "text") if text is not None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == n
    assert peak < 2 << 20, peak  # a few 64 KiB steps in memory, never the 8.7 MB


def test_jsonl_zst_and_json_gz_at_a_url_give_the_local_runs_bytes(s3, tmp_path, monkeypatch):
    from fastdata.preprocess import url_reads
    from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text

    root = tmp_path / "pile"
    (root / "train").mkdir(parents=True)
    (root / "dataset_info.json").write_text(json.dumps({"text": "not a document"}) + "\n")
    (root / "train" / "00.jsonl.zst").write_bytes(zst(jsonl_bytes(make_docs(400, seed=4)) + b"not json\n", 3))
    (root / "train" / "01.json.gz").write_bytes(gzip.compress(jsonl_bytes(make_docs(100, seed=5)), mtime=0))
    url = s3("pile")
    for p in sorted(root.rglob("*")):
        if p.is_file():
            s3.client.put_object(Bucket="pile", Key=f"p/{p.relative_to(root).as_posix()}", Body=p.read_bytes())
    monkeypatch.setattr(url_reads, "_READ_BLOCK", 4096)  # the .zst comes in many ranged reads

    def run(src, out: str) -> dict:
        return preprocess_text(TextPreprocessConfig(src=src, out=tmp_path / out, shard_tokens=2000, val_fraction=0.2,
                                                    progress=False, workers=1))
    local, remote = run(root, "local"), run(f"{url}/p", "remote")
    assert {f["path"]: f["sha256"] for f in remote["files"]} == {f["path"]: f["sha256"] for f in local["files"]}
    assert local["source"]["files"] == remote["source"]["files"] == 2
    assert remote["skipped"] == local["skipped"] == [{"file": "train/00.jsonl.zst", "line": 401,
                                                      "reason": "invalid JSON (Expecting value)"}]
    one = run(f"{url}/p/train/00.jsonl.zst", "remote1")  # one file at a URL
    assert one["splits"]["train"]["documents"] + one["splits"]["val"]["documents"] == 400


def test_zst_without_zstandard_names_the_extra_before_writing(tmp_path, monkeypatch, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(jsonl_bytes(make_docs(20)))
    (src / "b.jsonl.zst").write_bytes(zst(jsonl_bytes(make_docs(20))))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` raises ImportError
    assert main(["preprocess", "text", str(src), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'fastdata[text]'" in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("*.npy"))
    preprocess(src / "a.jsonl", tmp_path / "plain")  # no .zst: zstandard is never imported


def test_a_degenerate_zst_is_read_in_small_steps(tmp_path):
    # runs of one byte compress ~10,000x: a 64 KiB feed would decompress into gigabytes at once
    zstandard = pytest.importorskip("zstandard")
    import tracemalloc

    from fastdata.preprocess.documents import Part, PartDocuments, text_files

    blank = (b" " * (64 << 10) + b"\n") * 4096  # 256 MB of blank lines, 64 KiB each
    (tmp_path / "nl.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(blank))
    assert len(blank) // (tmp_path / "nl.jsonl.zst").stat().st_size > 5000
    tracemalloc.start()
    docs = list(PartDocuments(Part(text_files(tmp_path / "nl.jsonl.zst")[0], 0), "text"))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [d[3] for d in docs] == ["empty file"] and peak < 64 << 20, peak


def byte_bpe(path: Path, special: list[str], plain: list[str] = ()) -> Path:
    """A GPT-2-like tokenizer.json made here: byte-level BPE without merges (one token a byte), with ``special``
    tokens and ``plain`` (not special) added tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                                          []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    tok.add_tokens(list(plain))
    tok.save(str(path))
    return path


def test_a_document_quoting_the_end_of_document_token_keeps_it_as_text(tmp_path):
    docs = ["a doc that quotes <|endoftext|> in its text", "and <|pad|> too", "second"]
    spec = str(byte_bpe(tmp_path / "tokenizer.json", ["<|endoftext|>", "<|pad|>"]))
    out = tmp_path / "out"
    preprocess(write_jsonl(tmp_path / "d.jsonl", docs), out, "--tokenizer", spec, "--val-fraction", "0")
    ours = load_tokenizer(spec)
    got = docs_of(stream(out, "train"), ours.eos_id)  # before: 4 end-of-document ids for 3 documents
    assert [ours.decode(d[:-1]) for d in got] == docs
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["documents"] == len(got) == 3


def test_an_end_of_document_token_added_as_plain_text_is_never_made_from_text(tmp_path):
    ours = load_tokenizer(str(byte_bpe(tmp_path / "tokenizer.json", [], plain=["</s>"])))
    ids = ours.encode_batch(["quoting </s> here"])[0]
    assert ours.eos_id not in ids and ours.decode(ids) == "quoting </s> here"


def test_a_tokenizer_whose_model_spells_the_end_of_document_token_is_refused(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "</s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "</s>" is one word of the model's vocabulary
    tok.save(str(tmp_path / "tokenizer.json"))
    # refused at loading, before any work (a run of hours died at the first document quoting it)
    with pytest.raises(ConfigError, match="end-of-document token '</s>' \\(id 2\\)"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_tokenizers_without_encode_special_tokens_are_refused_by_name(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    from fastdata.errors import MissingDependencyError

    spec = str(byte_bpe(tmp_path / "tokenizer.json", ["<|endoftext|>"]))
    real = tokenizers.Tokenizer

    class Old:  # tokenizers 0.15.0: no encode_special_tokens
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            if name == "encode_special_tokens":
                raise AttributeError(name)
            return getattr(self._tok, name)

        @staticmethod
        def from_str(s):
            return Old(real.from_str(s))
    monkeypatch.setattr(tokenizers, "Tokenizer", Old)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tokenizers>=0.15.1'"):
        load_tokenizer(spec)


def test_a_vocabulary_with_a_gap_sizes_the_dtype_by_its_highest_id(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 100)}, "</s>": 70000}  # 101 entries
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).vocab_size == 70001  # before: 101, so uint16
    out = tmp_path / "out"
    preprocess(write_jsonl(tmp_path / "d.jsonl", ["w1 w2 w3", "w99"]), out, "--tokenizer",
               str(tmp_path / "tokenizer.json"), "--val-fraction", "0")
    m = json.loads((out / "manifest.json").read_text())
    assert m["dtype"] == "<u4" and m["tokenizer"]["vocab_size"] == 70001
    assert stream(out, "train").tolist() == [1, 2, 3, 70000, 99, 70000]


def word_level(path: Path, words: list[str]) -> Path:
    """A tokenizer.json made here: one id a whitespace-separated word (in ``words``' order), then
    ``<|endoftext|>`` as a special token."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path))
    return path


@pytest.mark.parametrize("pad", ["<pad>", "<|endoftext|>"])
def test_truncation_and_padding_saved_in_a_tokenizer_json_are_not_applied(tmp_path, pad):
    tokenizers = pytest.importorskip("tokenizers")
    spec = word_level(tmp_path / "tokenizer.json", ["hello", "world", "foo", "bar", "[UNK]", "<pad>"])
    tok = tokenizers.Tokenizer.from_file(str(spec))  # as a pipeline with max_length saves it (common on the Hub)
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=tok.token_to_id(pad), pad_token=pad)
    tok.save(str(spec))
    out = tmp_path / "out"
    # before: the first document cut to 8 ids, the others padded with id 5; with pad = eos a ConfigError
    preprocess(write_jsonl(tmp_path / "d.jsonl", ["hello world " * 10, "foo", "bar bar"]), out, "--tokenizer",
               str(spec), "--val-fraction", "0")
    assert stream(out, "train").tolist() == [0, 1] * 10 + [6, 2, 6, 3, 3, 6]


def test_a_tokenizer_json_edited_between_runs_of_one_process_is_loaded_afresh(tmp_path):
    import hashlib

    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    spec = tmp_path / "tokenizer.json"
    word_level(spec, ["[UNK]", "hello", "world"])
    preprocess(tmp_path / "d.jsonl", tmp_path / "first", "--tokenizer", str(spec), "--val-fraction", "0")
    assert stream(tmp_path / "first", "train").tolist() == [1, 2, 3]
    word_level(spec, ["[UNK]", "world", "hello", "extra"])  # edited: eos is 4 now
    for workers in ("1", "2"):  # in this process, and in workers forked from it
        out = tmp_path / f"second-{workers}"
        # before: ConfigError "... is not the one this run started with ... give every node the same tokenizer"
        preprocess(tmp_path / "d.jsonl", out, "--tokenizer", str(spec), "--val-fraction", "0", "--workers", workers)
        assert stream(out, "train").tolist() == [2, 1, 4]
        m = json.loads((out / "manifest.json").read_text())
        assert m["tokenizer"]["definition_sha256"] == hashlib.sha256(spec.read_bytes()).hexdigest()


def test_a_byte_order_mark_opening_a_file_is_no_text(tmp_path):
    body = "".join(json.dumps({"text": d}) + "\r\n" for d in ["first", "second"]).encode()
    for name, bom in (("plain", b""), ("bom", b"\xef\xbb\xbf")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.jsonl").write_bytes(bom + body)
        (tmp_path / name / "b.jsonl.gz").write_bytes(gzip.compress(bom + body, mtime=0))
        (tmp_path / name / "c.txt").write_bytes(bom + b"plain text")
        (tmp_path / name / "d.txt").write_bytes(bom + b"\n")  # a mark and a blank line: an empty document
        preprocess(tmp_path / name, tmp_path / f"{name}-out", "--val-fraction", "0")
    ms = [json.loads((tmp_path / f"{n}-out" / "manifest.json").read_text()) for n in ("plain", "bom")]
    assert [m["skipped_count"] for m in ms] == [1, 1]  # d.txt alone (before: a.jsonl:1 and b.jsonl.gz:1 too)
    # the same tokens (before: EF BB BF in c.txt's); keys after the mark are 3 bytes later, so val may differ
    assert np.array_equal(stream(tmp_path / "plain-out", "train"), stream(tmp_path / "bom-out", "train"))


def test_a_train_split_left_empty_by_val_fraction_says_so(tmp_path, capsys):
    (tmp_path / "one.txt").write_text("hello world")
    argv = ["preprocess", "text", str(tmp_path / "one.txt"), str(tmp_path / "out"), "--quiet", "--workers", "1"]
    assert main([*argv, "--val-fraction", "0.5", "--seed", "1"]) == 1
    err = capsys.readouterr().err
    assert "train split" in err and "went to the validation split" in err and "lower --val-fraction" in err
    assert "no usable documents" not in err  # before: "... (first problem: ?: no text)"
    assert main([*argv, "--val-fraction", "0", "--overwrite"]) == 0  # what it says to do works


@pytest.mark.parametrize("stride", [-1, 0, 2.5, True, "8"])
def test_a_bad_stride_is_refused_by_name(token_folder, stride):
    # before: -1 a bare ValueError from len(), 2.5 a TypeError at the first batch, 0 silently seq_len
    with pytest.raises(ConfigError, match=f"stride must be .*got stride={stride!r}"):
        TokenDataset(token_folder, seq_len=32, stride=stride)
    with pytest.raises(ConfigError, match="seq_len must be a positive integer, got seq_len=True"):
        TokenDataset(token_folder, seq_len=True)  # (a bool is no length: it read as 1)


def test_a_numpy_integer_stride_is_a_stride(token_folder):
    ds = TokenDataset(token_folder, seq_len=32, stride=np.int64(8))
    assert ds.stride == 8 and type(ds.stride) is int and len(ds) == TokenDataset(token_folder, seq_len=32,
                                                                                  stride=8).__len__()


@pytest.mark.parametrize("which", ["src", "out"])
def test_an_empty_src_or_out_is_refused_not_the_current_folder(tmp_path, monkeypatch, capsys, which):
    from fastdata.preprocess.text import TextPreprocessConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("private notes")  # what an unset $SRC read before
    args = {"src": str(tmp_path / "notes.txt"), "out": str(tmp_path / "out"), which: ""}
    with pytest.raises(ConfigError, match=f"{which} must be a non-empty path"):
        TextPreprocessConfig(**args)
    assert main(["preprocess", "text", args["src"], args["out"], "--quiet", "--workers", "1"]) != 0
    assert f"{which} must be a non-empty path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_tokenizer_path_may_be_a_pathlib_path(tmp_path):
    from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text

    spec = word_level(tmp_path / "tokenizer.json", ["[UNK]", "hello", "world"])
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello world world"}) + "\n")
    config = TextPreprocessConfig(src=tmp_path / "d.jsonl", out=tmp_path / "out", tokenizer=spec, val_fraction=0,
                                  workers=1, progress=False)
    assert config.tokenizer == str(spec)  # before: kept as a Path, an AttributeError in preprocess_text
    assert preprocess_text(config)["tokenizer"]["spec"] == str(spec)
    assert stream(tmp_path / "out", "train").tolist() == [1, 2, 2, 3]
    assert TokenDataset(tmp_path / "out", seq_len=2, tokenizer=spec).eos_id == 3  # before: AttributeError
    with pytest.raises(FormatError, match="tokenised with"):
        TokenDataset(tmp_path / "out", seq_len=2, tokenizer=byte_bpe(tmp_path / "other.json", ["<|endoftext|>"]))
    said = ("tokenizer must be 'bytes', a tokenizer.json path (a str or an os.PathLike) or 'tiktoken:NAME', "
            "got tokenizer=7")
    with pytest.raises(ConfigError) as err:
        TokenDataset(tmp_path / "out", seq_len=2, tokenizer=7)
    assert str(err.value) == said
    with pytest.raises(ConfigError) as err:
        TextPreprocessConfig(src=tmp_path / "d.jsonl", out=tmp_path / "out", tokenizer=7)
    assert str(err.value) == said


@pytest.mark.parametrize("seed", [None, 1.5, "7", -1, True])
def test_a_bad_window_or_split_seed_is_refused_by_name(token_folder, tmp_path, seed):
    from fastdata.preprocess.text import TextPreprocessConfig

    said = f"seed must be a non-negative integer, got seed={seed!r}"
    # before: accepted, then a TypeError at the first batch (-1 and True were taken as seeds)
    with pytest.raises(ConfigError) as err:
        TokenDataset(token_folder, seq_len=32, random_windows=True, seed=seed)
    assert str(err.value) == said
    with pytest.raises(ConfigError) as err:
        TextPreprocessConfig(src=tmp_path / "d.jsonl", out=tmp_path / "out", seed=seed)
    assert str(err.value) == said


def test_a_numpy_integer_seed_is_a_seed(token_folder, tmp_path):
    from fastdata.preprocess.text import TextPreprocessConfig, preprocess_text

    ds = TokenDataset(token_folder, seq_len=32, random_windows=True, seed=np.int64(3))
    plain = TokenDataset(token_folder, seq_len=32, random_windows=True, seed=3)
    assert ds.seed == 3 and type(ds.seed) is int
    assert np.array_equal(ds.starts(np.arange(10)), plain.starts(np.arange(10)))  # before: OverflowError
    assert np.array_equal(splitmix(np.int64(3), np.arange(5)), splitmix(3, np.arange(5)))
    docs = make_docs(50)
    config = TextPreprocessConfig(src=write_jsonl(tmp_path / "d.jsonl", docs), out=tmp_path / "np",
                                  seed=np.int64(3), val_fraction=0.3, workers=1, progress=False)
    assert config.seed == 3 and type(config.seed) is int
    preprocess_text(config)  # before: TypeError, an np.int64 is no JSON
    preprocess(tmp_path / "d.jsonl", tmp_path / "int", "--seed", "3", "--val-fraction", "0.3")
    for split in ("train", "val"):  # the split an int seed makes
        assert np.array_equal(stream(tmp_path / "np", split), stream(tmp_path / "int", split))
