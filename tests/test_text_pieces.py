"""preprocess text in pieces (NOTE [text pieces]): parts of a file hold each document once, a cut file names its
lines as a whole read does, and the driver's plan and records stay small at the size of the largest corpora."""
from __future__ import annotations

import dataclasses
import gc
import gzip
import json
import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from test_text import docs_of, jsonl_bytes, make_docs, stream

from fastdata.cli.main import main
from fastdata.errors import ConfigError
from fastdata.formats.tokenizer import load_tokenizer
from fastdata.preprocess import documents, journal
from fastdata.preprocess.documents import Part, PartDocuments, TextFile, piece_bytes, plan_pieces, text_files
from fastdata.preprocess.text_tasks import TextPlan, piece_task


def whole_and_parts(path: Path, parts: int, field: str = "text") -> tuple[list, list]:
    """The file's documents read whole, and read as ``parts`` parts with each part's lines shifted by the lines
    of the parts before it (as the driver does)."""
    f = text_files(path)[0]
    whole = list(PartDocuments(Part(f, 0), field))
    joined, before = [], 0
    for k in range(parts):
        docs = PartDocuments(Part(f, 0, k, parts), field)
        joined += [(key, line + before if line else 0, text, reason) for key, line, text, reason in docs]
        before += docs.lines
    return whole, joined


def test_parts_of_a_jsonl_file_hold_every_line_once(tmp_path):
    lines = [json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n" for d in make_docs(200, seed=7)]
    lines[10] = b"\n"  # blank lines are no documents, but count as lines
    lines[11] = b"   \n"
    lines[40] = b"not json\n"
    lines[41] = json.dumps({"text": "x" * 5000}).encode() + b"\n"  # longer than many parts: begins in one only
    lines[-1] = lines[-1].rstrip(b"\n")  # no newline at the end
    data = b"".join(lines)
    (tmp_path / "d.jsonl").write_bytes(data)
    for parts in (1, 2, 3, 7, 50, 333, len(data)):
        whole, joined = whole_and_parts(tmp_path / "d.jsonl", parts)
        assert joined == whole, parts
    assert len(whole) == 198 and whole[38][1:] == (41, None, "invalid JSON (Expecting value)")
    keys = np.cumsum([0] + [len(x) for x in lines[:-1]])  # a document's key: its line's byte offset
    assert [k for k, *_ in whole] == [int(keys[i]) for i in range(200) if i not in (10, 11)]


def test_a_byte_order_mark_is_dropped_once_whatever_the_parts(tmp_path):
    lines = [json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n" for d in ["a", "bb", "ccc"] * 5]
    data = b"\xef\xbb\xbf" + b"".join(lines)
    (tmp_path / "d.jsonl").write_bytes(data)
    for parts in (1, 2, 3, 7, 50, len(data)):  # parts that start inside the mark, and many that hold nothing
        whole, joined = whole_and_parts(tmp_path / "d.jsonl", parts)
        assert joined == whole, parts
    assert whole[0] == (0, 1, "a", "")  # before: (0, 1, None, "invalid JSON (Unexpected UTF-8 BOM ...)")
    assert [text for _, _, text, _ in whole] == ["a", "bb", "ccc"] * 5


def test_a_part_boundary_on_a_newline_and_one_inside_a_line(tmp_path):
    first = json.dumps({"text": "a" * 40}).encode() + b"\n"
    second = json.dumps({"text": "b" * 40}).encode() + b"\n"
    assert len(first) == len(second)
    (tmp_path / "d.jsonl").write_bytes(first + second)  # part 1 starts exactly at the second line
    f = text_files(tmp_path / "d.jsonl")[0]
    assert [[t for _, _, t, _ in PartDocuments(Part(f, 0, k, 2), "text")] for k in range(2)] == [["a" * 40],
                                                                                                 ["b" * 40]]
    # parts [0, 35), [35, 70), [70, 106): the second line starts in the middle one, the last holds no start
    assert [[t for _, _, t, _ in PartDocuments(Part(f, 0, k, 3), "text")] for k in range(3)] == [["a" * 40],
                                                                                                 ["b" * 40], []]


def test_parts_of_a_parquet_file_take_its_row_groups_once(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = make_docs(70, seed=3)
    rows[5], rows[30] = None, ""
    pq.write_table(pa.table({"text": rows}), tmp_path / "d.parquet", row_group_size=10)  # 7 row groups
    for parts in (1, 2, 3, 7, 10):
        whole, joined = whole_and_parts(tmp_path / "d.parquet", parts)
        assert joined == whole, parts
    assert [k for k, *_ in whole] == list(range(70)) and whole[5][1:] == (6, None, "missing field 'text'")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "n.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not parquet")
    for name, says in (("n.parquet", "no column 'text'"), ("bad.parquet", "unreadable")):
        whole, joined = whole_and_parts(tmp_path / name, 3)  # a whole-file problem is said once, by part 0
        assert len(whole) == len(joined) == 1 and joined[0][3].startswith(says)


def test_the_plan_groups_small_files_and_cuts_large_ones(tmp_path):
    mib = 1 << 20

    def files(*specs: tuple[str, int]) -> list[TextFile]:
        return [TextFile(f"/x/{n}", n, size, "0") for n, size in specs]
    assert piece_bytes(10 * mib, 1 << 26) == 16 * mib  # small sources: one piece of at least 16 MiB
    assert piece_bytes(64 << 30, 1 << 26) == 256 * mib  # large: 4 bytes per shard token
    assert piece_bytes(4 << 30, 1 << 26) == 64 * mib  # between: a 64th, so 64 workers share it
    plan = list(plan_pieces(files(("a.jsonl", 10 * mib), ("b.txt", 10 * mib), ("c.jsonl", 100 * mib),
                                  ("d.jsonl.zst", 100 * mib), ("e.parquet", 40 * mib), ("f.txt", mib)), 1 << 20))
    assert piece_bytes(261 * mib, 1 << 20) == 4 * mib
    shape = [[(p.file.rel, p.k, p.parts) for p in piece] for piece in plan]
    assert shape[:3] == [[("a.jsonl", k, 3)] for k in range(3)]  # larger than a piece: cut (plain JSON Lines)
    assert shape[3:6] == [[("b.txt", 0, 1)], *[[("c.jsonl", k, 25)] for k in range(2)]]  # .txt: whole
    assert [("d.jsonl.zst", 0, 1)] in shape and shape[-1] == [("f.txt", 0, 1)]  # compressed: whole
    assert sum(1 for s in shape if s[0][0] == "e.parquet") == 10
    many = files(*[(f"{i:07d}.txt", 100) for i in range(5000)])  # tiny files: at most 1024 a piece
    assert [len(p) for p in plan_pieces(many, 1 << 20)] == [1024] * 4 + [904]
    for piece in plan:  # each file part once, in order
        assert all(p.nbytes > 0 for p in piece)
    assert sum(p.nbytes for piece in plan for p in piece) == 261 * mib


def test_a_cut_file_names_bad_lines_as_a_whole_read_does(tmp_path, capsys):
    docs = make_docs(600, seed=5)
    lines = [json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n" for d in docs]
    for i in (4, 299, 597):
        lines[i] = b"not json\n"
    data = b"".join(lines)
    (tmp_path / "plain").mkdir()
    (tmp_path / "gz").mkdir()
    (tmp_path / "plain" / "d.jsonl").write_bytes(data)
    (tmp_path / "plain" / "e.jsonl").write_bytes(b"\n" * 9000)  # cut too, and empty: said once
    (tmp_path / "gz" / "d.jsonl.gz").write_bytes(gzip.compress(data, mtime=0))
    (tmp_path / "gz" / "e.jsonl.gz").write_bytes(gzip.compress(b"\n" * 9000, mtime=0))
    args = ["--val-fraction", "0.2", "--shard-tokens", "700", "--quiet", "--workers", "2"]
    for kind in ("plain", "gz"):
        assert main(["preprocess", "text", str(tmp_path / kind), str(tmp_path / f"out-{kind}"), *args]) == 0
    plain, gz = (json.loads((tmp_path / f"out-{k}" / "manifest.json").read_text()) for k in ("plain", "gz"))
    assert plain["params"]["piece_bytes"] == 2800 and len(plain["splits"]["train"]["shards"]) > 20
    where = [(e["file"].split(".")[0], e["line"], e["reason"]) for e in plain["skipped"]]
    assert where == [("d", 5, "invalid JSON (Expecting value)"), ("d", 300, "invalid JSON (Expecting value)"),
                     ("d", 598, "invalid JSON (Expecting value)"), ("e", 0, "empty file")]
    assert where == [(e["file"].split(".")[0], e["line"], e["reason"]) for e in gz["skipped"]]
    assert plain["skipped_count"] == gz["skipped_count"] == 4
    for split in ("train", "val"):  # the same documents to the same split: keys are offsets in the text
        assert np.array_equal(stream(tmp_path / "out-plain", split), stream(tmp_path / "out-gz", split))
    lines[597] = json.dumps({"text": "fine"}).encode() + b"\n"
    lines[4] = lines[299] = lines[597]
    lines[450] = b'{"text": 7}\n'  # the only bad line, in a later part
    (tmp_path / "one.jsonl").write_bytes(b"".join(lines))
    capsys.readouterr()
    assert main(["preprocess", "text", str(tmp_path / "one.jsonl"), str(tmp_path / "fail"), "--on-error", "fail",
                 *args]) == 1
    assert capsys.readouterr().err.strip() == (
        "fastdata: error: one.jsonl:451: field 'text' is not a string (rerun with --on-error skip to leave such "
        "documents out: it keeps the shards made so far)")
    assert not (tmp_path / "fail" / "manifest.json").exists()
    kept = journal.load(journal.partial_dir(tmp_path / "fail")).units
    assert kept  # (the pieces before the bad line's)
    # doing what it says takes the failed run over (it was refused as a run with other arguments)
    assert main(["preprocess", "text", str(tmp_path / "one.jsonl"), str(tmp_path / "fail"), *args]) == 0
    assert main(["preprocess", "text", str(tmp_path / "one.jsonl"), str(tmp_path / "skip"), *args]) == 0
    made = sorted(p.name for p in (tmp_path / "skip").iterdir())
    assert sorted(p.name for p in (tmp_path / "fail").iterdir()) == made
    assert all((tmp_path / "fail" / name).read_bytes() == (tmp_path / "skip" / name).read_bytes() for name in made)


def test_a_piece_task_sends_back_a_few_hundred_bytes(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(make_docs(300)))
    f = text_files(tmp_path / "d.jsonl")[0]
    bytes_tok = load_tokenizer("bytes")
    plan = TextPlan("bytes", bytes_tok.definition_hash, "text", 0.1, 0, "skip", 1 << 20, 256, 257, "<u2", 7)
    (tmp_path / "out" / ".fastdata-partial").mkdir(parents=True)
    unit = piece_task((plan, 12, [Part(f, 0, 1, 3)], tmp_path / "out"))
    names = sorted(p.name for p in (tmp_path / "out").glob("*.npy"))
    assert names == ["train-0000012-000000.npy", "train-docs-0000012-000000.npy", "val-0000012-000000.npy",
                     "val-docs-0000012-000000.npy"]
    (i, k, parts, lines, found), = unit["parts"]
    assert unit["index"] == 12 and (i, k, parts) == (0, 1, 3) and 90 < lines == found < 110
    assert sum(sh["documents"] for shards in unit["shards"].values() for sh in shards) == found
    assert not list((tmp_path / "out" / ".fastdata-partial").iterdir())  # its staging folder is gone
    line = json.dumps(unit)
    assert len(line) < 1200  # what the driver journals for it, whatever its documents
    tracemalloc.start()  # and what it holds for it until the manifest is written (docs/cluster.md)
    held = [json.loads(line) for _ in range(1000)]
    per_piece = tracemalloc.get_traced_memory()[0] / len(held)
    tracemalloc.stop()
    assert per_piece < 5000, per_piece
    other = dataclasses.replace(plan, definition="0" * 64)  # a node whose tokenizer file differs: refused
    with pytest.raises(ConfigError, match="is not the one this run started with"):
        piece_task((other, 13, [Part(f, 0, 0, 3)], tmp_path / "out"))
    assert not list((tmp_path / "out").glob("*-0000013-*"))


def test_the_plan_of_the_largest_corpora_is_made_as_it_is_needed():
    # FineWeb-sized: 10^5 Parquet files of 2 GB (200 TB, ~10^11 documents). The plan is made lazily: no list of
    # its ~800,000 pieces exists at once, and a task's description (pickled to a worker or a Ray task) is small.
    files = [TextFile(f"s3://fw/data/{i:06d}.parquet", f"data/{i:06d}.parquet", 2 << 30, "e") for i in range(10 ** 5)]
    tracemalloc.start()
    count, biggest = 0, 0
    plan = TextPlan("tiktoken:gpt2", "0" * 64, "text", 0.001, 0, "skip", 1 << 26, 50256, 50257, "<u2", 6)
    for piece in plan_pieces(files, 1 << 26):
        if count % 997 == 0:
            biggest = max(biggest, len(pickle.dumps((plan, count, piece, "s3://out"))))
        count += 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 10 ** 5 * 8 and peak < 1 << 20, peak  # 256 MiB pieces; the plan holds one piece at a time
    assert biggest < 1024, biggest
    # OpenWebText's layout: millions of small .txt files; a piece of at most 1024 of them pickles under 200 KB
    small = [TextFile(f"/owt/{i:08d}.txt", f"{i:08d}.txt", 5000, "1") for i in range(1 << 13)]
    piece = next(plan_pieces(small, 1 << 26))
    assert len(piece) == documents._PIECE_FILES and len(pickle.dumps((plan, 0, piece, Path("/out")))) < 200_000
    tracemalloc.start()  # what the listing holds a file, for paths of OpenWebText's shape
    names = [f"urlsf_subset{i % 21:02d}-{i}_data/{i:07d}-{i * 7919 % 10 ** 9:09d}.txt" for i in range(20_000)]
    listed = [TextFile(f"/data/owt/{n}", n, 5000, str(10 ** 18 + i)) for i, n in enumerate(names)]
    per_file = tracemalloc.get_traced_memory()[0] / len(listed)
    tracemalloc.stop()
    assert per_file < 450, per_file


def test_shards_and_offsets_round_trip_through_the_manifest(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "d.jsonl").write_bytes(jsonl_bytes(make_docs(300)))
    assert main(["preprocess", "text", str(tmp_path / "d.jsonl"), str(out), "--shard-tokens", "700", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    names = {f["path"] for f in m["files"]}
    for split in ("train", "val"):
        shards = m["splits"][split]["shards"]
        assert [s["path"] for s in shards] == sorted(s["path"] for s in shards)  # sorted names keep the order
        assert all({s["path"], s["docs"]} <= names for s in shards)
        assert sum(len(docs_of(np.load(out / s["path"]), 256)) for s in shards) == m["splits"][split]["documents"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names | {"manifest.json"})


def test_a_version_1_dataset_is_still_read(tmp_path):
    # format 1 (before pieces): train-00000.npy ... and one train-docs.npy of offsets into the whole split
    from fastdata._io import write_bytes_atomic
    from fastdata.datasets.tokens import TokenDataset
    from fastdata.formats.base import npy_bytes
    from fastdata.formats.manifest import TOKENS, new_manifest, write_manifest

    out = tmp_path / "v1"
    out.mkdir()
    rng = np.random.default_rng(0)
    streams = {"train": [rng.integers(0, 256, 3000).astype("<u2"), rng.integers(0, 256, 2000).astype("<u2")],
               "val": [rng.integers(0, 256, 500).astype("<u2")]}
    files, splits = [], {}
    for split, parts in streams.items():
        shards = []
        for k, arr in enumerate(parts):
            files.append(write_bytes_atomic(out / f"{split}-{k:05d}.npy", npy_bytes(arr)))
            shards.append({"path": f"{split}-{k:05d}.npy", "tokens": len(arr), "documents": 1})
        offsets = np.array([0, sum(len(a) for a in parts)], dtype="<i8")
        files.append(write_bytes_atomic(out / f"{split}-docs.npy", npy_bytes(offsets)))
        splits[split] = {"tokens": int(offsets[-1]), "documents": 1, "offsets": f"{split}-docs.npy", "shards": shards}
    tok = load_tokenizer("bytes")
    write_manifest(out, new_manifest(TOKENS, version=1, tokenizer=tok.describe(), dtype="<u2", splits=splits,
                                     files=files, params={}, fingerprint="x", source={}, bytes_per_token=1.0,
                                     skipped_count=0, skipped=[]))
    ds = TokenDataset(out, seq_len=100, verify=True)
    whole = np.concatenate(streams["train"])
    x, y = ds.get_batch(np.arange(len(ds)))
    assert np.array_equal(x.numpy(), whole[:len(ds) * 100].reshape(-1, 100).astype(np.uint16))
    assert main(["verify", str(out), "--quiet"]) == 0


def test_a_cut_file_gone_after_listing_is_skipped_once(tmp_path, monkeypatch):
    from fastdata.preprocess import text

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(jsonl_bytes(make_docs(100, seed=1)))
    (src / "b.jsonl").write_bytes(jsonl_bytes(make_docs(300, seed=2)))  # cut into parts, then gone

    def listed_then_gone(where):
        files = text_files(where)
        (src / "b.jsonl").unlink()
        return files
    monkeypatch.setattr(text, "text_files", listed_then_gone)
    m = text.preprocess_text(text.TextPreprocessConfig(src=src, out=tmp_path / "out", shard_tokens=700,
                                                       val_fraction=0, progress=False, workers=1))
    assert m["skipped_count"] == 1 and [(e["file"], e["line"]) for e in m["skipped"]] == [("b.jsonl", 0)]
    assert m["skipped"][0]["reason"].startswith("unreadable") and m["splits"]["train"]["documents"] == 100


def test_a_part_inside_a_very_long_line_skips_it_in_steps(tmp_path):
    line = json.dumps({"text": "x" * (48 << 20)}).encode() + b"\n"  # one 48 MB line, then a short one
    (tmp_path / "d.jsonl").write_bytes(line + jsonl_bytes(["after"]))
    f = text_files(tmp_path / "d.jsonl")[0]
    got = []
    for k in range(1, 8):
        tracemalloc.start()
        got += [t for _, _, t, _ in PartDocuments(Part(f, 0, k, 8), "text")]
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 << 20, (k, peak)  # never the rest of the line at once
    assert got == ["after"]


def many_token_shards(root: Path, count: int, size: int) -> np.ndarray:
    """A format-2 token dataset of ``count`` train shards of ``size`` tokens each; returns the whole stream."""
    from fastdata._io import write_bytes_atomic
    from fastdata.formats.base import npy_bytes
    from fastdata.formats.manifest import TOKENS, new_manifest, write_manifest

    root.mkdir()
    stream = (np.arange(count * size) % 251).astype("<u2")
    files, shards = [], []
    for k in range(count):
        name, docs = f"train-{k:05d}-000000.npy", f"train-docs-{k:05d}-000000.npy"
        files.append(write_bytes_atomic(root / name, npy_bytes(stream[k * size:(k + 1) * size])))
        files.append(write_bytes_atomic(root / docs, npy_bytes(np.array([0, size], "<i8"))))
        shards.append({"path": name, "tokens": size, "documents": 1, "docs": docs})
    write_manifest(root, new_manifest(TOKENS, tokenizer=load_tokenizer("bytes").describe(), dtype="<u2",
                                      splits={"train": {"tokens": count * size, "documents": count, "shards": shards},
                                              "val": {"tokens": 0, "documents": 0, "shards": []}},
                                      files=files, params={}, fingerprint="x", source={}, bytes_per_token=1.0,
                                      skipped_count=0, skipped=[]))
    return stream


def test_more_token_shards_than_memory_mappings_allow_are_mapped_as_read(tmp_path, monkeypatch, caplog):
    # vm.max_map_count (65,530) caps a process's mappings: FineWeb's ~230,000 shards of 64 Mi tokens pass it.
    # Here the room left is made small; the dataset maps shards as batches read them, a bounded number at once.
    from fastdata import _limits
    from fastdata.datasets.tokens import TokenDataset, touched

    gc.collect()  # (no bounded dataset of an earlier test holds a share of the room)
    monkeypatch.setattr(_limits, "limits", lambda: (1 << 20, 1 << 20))  # open files never the binding limit
    stream = many_token_shards(tmp_path / "tok", 1300, 100)
    whole = TokenDataset(tmp_path / "tok", seq_len=249, stride=37)
    assert isinstance(whole._shards, list)  # room for every map: one map each, as before
    reference = whole.get_batch(np.arange(40))[0].numpy().copy()
    whole.close()
    del whole

    def mapped() -> int:  # this folder's files mapped into the process now
        return Path("/proc/self/maps").read_text().count(str(tmp_path / "tok"))
    assert mapped() == 0
    monkeypatch.setattr(_limits, "maps_left", lambda: _limits.MAP_HEADROOM + 1000)
    assert not _limits.room_for_maps(1300) and _limits.room_for_maps(500)
    with caplog.at_level("WARNING"):
        ds = TokenDataset(tmp_path / "tok", seq_len=249, stride=37)
    assert type(ds._shards).__name__ == "ShardMaps" and ds._shards.bound == 500
    assert "memory mappings" in caplog.text
    order = np.random.default_rng(0).permutation(len(ds))
    for lo in range(0, len(ds), 256):  # windows of 250 tokens span up to 4 shards of 100
        idx = order[lo:lo + 256]
        x, y = ds.get_batch(idx)
        want = stream[(idx * 37)[:, None] + np.arange(250)]
        assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:])
        assert mapped() <= 500 + 4  # (+ the maps this batch still reads)
    assert np.array_equal(ds.get_batch(np.arange(40), out=torch.empty((64, 250), dtype=torch.uint16))[0].numpy(),
                          reference)
    first, last = np.array([3, 7, 9]), np.array([3, 10, 9])
    assert touched(first, last).tolist() == [3, 7, 8, 9, 10]
    # a loader's threads each hold the one shard they copy from, not every shard their batch touches
    from fastdata.loading.loader import FastLoader
    seen = 0
    for x, _ in FastLoader(ds, 300, shuffle=True, seed=1, num_threads=4):
        seen += len(x)
        assert mapped() <= 500 + 8, mapped()
    assert seen == len(ds)
    # a second bounded dataset is given what the first has not promised: together they stay under the room
    other = TokenDataset(tmp_path / "tok", seq_len=249, stride=37)
    assert other._shards.bound == (1000 - (500 - len(ds._shards._open))) // 2


def test_a_full_map_count_is_named(tmp_path, monkeypatch):
    import errno

    from fastdata.errors import OutputError
    from fastdata.storage import shards as shard_maps

    many_token_shards(tmp_path / "tok", 3, 100)

    def no_room(*a, **k):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(shard_maps.mmap, "mmap", no_room)
    with pytest.raises(OutputError, match="vm.max_map_count"):
        shard_maps.map_npy(tmp_path / "tok", "train-00000-000000.npy", (100,), np.dtype("<u2"))
