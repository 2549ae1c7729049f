"""A manifest's files and shards held as columns (NOTE [compact manifest]): what they say is unchanged, and
what they hold per row is a few bytes, not a dict."""
from __future__ import annotations

import gc
import hashlib
import json
import pickle
import random
import tracemalloc
from pathlib import Path

import pytest

from fastdata.formats.manifest import (IMAGES_NPY, load_manifest, manifest_digest, new_manifest, total_bytes,
                                       write_manifest)
from fastdata.formats.rows import Rows, column, compact_rows, has_columns, lookup, pairs, present, rows_by
from fastdata.formats.rows_json import canonical_pieces


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest_of(k: int) -> str:
    return hashlib.sha256(str(k).encode()).hexdigest()


def test_rows_read_back_as_the_rows_they_were_made_of():
    rows = [{"path": f"images-{k:05d}.npy", "bytes": 1000 + k * 7, "sha256": digest_of(k)} for k in range(20_000)]
    rows[3]["path"] = "sub/ünïcode-名前.npy"  # a path longer than the others, not ASCII
    compact = compact_rows(rows)
    assert isinstance(compact, Rows) and len(compact) == len(rows)
    assert compact == rows and compact.to_list() == rows
    assert compact[0] == rows[0] and compact[-1] == rows[-1] and compact[3] == rows[3]
    assert compact[10:13] == rows[10:13] and compact[::5000] == rows[::5000]
    assert compact.column("path") == [r["path"] for r in rows]
    assert compact.ints("bytes").tolist() == [r["bytes"] for r in rows]
    with pytest.raises(IndexError):
        compact[len(rows)]
    with pytest.raises(ValueError):
        compact.ints("bytes")[0] = 1  # read-only
    assert compact.find("path", "images-12345.npy") == 12345
    assert compact.find("path", "sub/ünïcode-名前.npy") == 3
    assert compact.find("path", "images-00003.npy") is None  # (renamed above)
    assert compact.find("path", "images-12345.np") is None and compact.find("path", "images-12345.npy\0") is None
    again = pickle.loads(pickle.dumps(compact))
    assert again == rows and again.find("path", "images-19999.npy") == 19999
    assert "".join(canonical_pieces({"files": compact, "n": 1})) == canonical({"files": rows, "n": 1})


def test_equal_length_paths_are_searched_in_place():
    rows = compact_rows([{"path": f"s-{k:04d}", "n": k} for k in (5, 1, 3, 1)])
    assert [rows.find("path", f"s-{k:04d}") for k in (1, 3, 5, 2)] == [1, 2, 0, None]  # (the first of two)
    assert lookup(rows)("s-0003") == {"path": "s-0003", "n": 3} and lookup(rows)("s-0002") is None
    as_list = [{"path": "a", "n": 1}, {"path": "a", "n": 2}]
    assert lookup(as_list)("a") == {"path": "a", "n": 1}
    for form in (as_list, compact_rows(as_list)):  # many at once: the first row of each, the absent left out
        assert rows_by(form, ["a", "b"]) == {"a": {"path": "a", "n": 1}}
    wide = [{"path": f"p{k}é" * (k % 3 + 1), "bytes": k, "sha256": digest_of(k)} for k in range(50)]
    assert compact_rows(wide).take([49, 0, 7, 7]) == [wide[49], wide[0], wide[7], wide[7]]
    assert rows_by(compact_rows(wide), [w["path"] for w in wide[::-3]]) == {w["path"]: w for w in wide[::-3]}


def test_a_few_lookups_search_the_buffer_then_the_column_is_sorted():
    # an open looks up one file (its labels): a search of the buffer, no order of a million paths kept
    names = ["x-labels.npy", "", "labels.npy.bak", "", "labels.npy", "labels.npy", "a"]
    rows = compact_rows([{"path": p, "n": k} for k, p in enumerate(names)])
    assert rows.find("path", "labels.npy") == 4 and rows._index == {}  # (found inside three rows first)
    assert [rows.find("path", p) for p in ("a", "labels", "x-labels.npy", "")] == [6, None, 0, 1]
    assert "path" in rows._index  # ("" cannot be searched for: it was answered by the sorted column ...)
    rows = compact_rows([{"path": p, "n": k} for k, p in enumerate(names)])
    for _ in range(10):  # ... as every lookup after the first few is
        assert rows.find("path", "labels.npy") == 4 and rows.find("path", "zzz") is None
    assert "path" in rows._index
    crowded = compact_rows([{"path": f"{k}-labels.npy"} for k in range(500)] + [{"path": "labels.npy"}])
    assert crowded.find("path", "labels.npy") == 500  # (more than 64 rows hold it: sorted at once)
    assert "path" in crowded._index


def test_many_lookups_at_once_agree_with_one_at_a_time():
    """`Rows.find_many` (the node cache's sizes of 10^6 shards: one sorted search): paths of unequal widths
    (sorted from the buffer, padded as numpy pads), empty, non-ASCII, longer than any row, with a NUL."""
    rng = random.Random(3)
    for _ in range(300):
        paths = ["".join(rng.choice("ab/é.-") for _ in range(rng.randint(0, 7))) for _ in range(rng.randint(1, 40))]
        rows = compact_rows([{"path": p, "bytes": k} for k, p in enumerate(paths)])
        probes = paths[::-1] + ["zz", "a", "é", "", "ab" * 9, "a\0", "b\0b"]
        want = [paths.index(p) if p in paths else -1 for p in probes]
        assert rows.find_many("path", probes).tolist() == want, (paths, probes)
        assert [rows.find("path", p) for p in probes] == [None if w < 0 else w for w in want]
    same = compact_rows([{"path": f"s-{k:04d}", "bytes": k} for k in range(100)])  # (the buffer itself)
    assert same.find_many("path", ["s-0099", "s-0000", "s-0100", "s-00"]).tolist() == [99, 0, -1, -1]


@pytest.mark.parametrize("rows", [
    [{"a": 1}, {"a": 2, "b": 3}],  # different keys
    [{"a": 1}, {"a": True}],  # a bool is not an int here
    [{"a": 1}, {"a": 1.5}],
    [{"a": 1}, {"a": 2 ** 63}],  # past int64
    [{"a": "x"}, {"a": ["x"]}],
    [{"a": "x"}, {"a": None}],
    [{"a": 1}, "not a dict"],
    [{}, {}],
    [],
])
def test_lists_that_columns_cannot_hold_stay_lists(rows):
    assert compact_rows(rows) is rows


def test_digests_are_packed_only_when_they_come_back_the_same():
    cases = {"lower": digest_of(1), "upper": digest_of(2).upper(), "spaced": digest_of(3)[:62] + " 0",
             "not hex": "g" * 64, "short": "ab" * 31}
    for name, value in cases.items():
        rows = [{"sha256": value}, {"sha256": digest_of(4)}]
        compact = compact_rows(rows)
        assert isinstance(compact, Rows), name
        assert compact == rows and compact.column("sha256") == [value, digest_of(4)], name
        assert compact.find("sha256", value) == 0, name


def test_random_lists_round_trip_exactly():
    rng = random.Random(7)
    pools = {"int": lambda: rng.choice([0, -1, 2 ** 63 - 1, -2 ** 63, rng.randrange(-10 ** 6, 10 ** 6)]),
             "text": lambda: "".join(rng.choice("ab/é\0 \u2603x.-\"\\\n%") for _ in range(rng.randrange(0, 9))),
             "hex": lambda: digest_of(rng.randrange(1000)),
             "any": lambda: rng.choice([1, "1", True, None, 1.0, [1], {"a": 1}])}
    for trial in range(300):
        keys = rng.sample(["path", "bytes", "sha256", "samples", "x"], rng.randrange(1, 5))
        kinds = {k: rng.choice(list(pools)) for k in keys}
        rows = [{k: pools[kinds[k]]() for k in keys} for _ in range(rng.randrange(1, 40))]
        compact = compact_rows(rows)
        assert compact == rows, (trial, kinds)
        assert "".join(canonical_pieces([compact, {"r": compact}])) == canonical([rows, {"r": rows}]), trial
        if isinstance(compact, Rows):
            for k in keys:
                if all(type(r[k]) is str for r in rows):
                    for v in {r[k] for r in rows}:
                        i = compact.find(k, v)
                        assert i is not None and rows[i][k] == v and all(r[k] != v for r in rows[:i]), (trial, v)


def test_has_columns_present_and_pairs_read_rows_and_lists_alike():
    rows = [{"path": "a", "samples": 3}, {"path": "b", "samples": 0}, {"path": "c", "samples": 9}]
    for form in (rows, compact_rows(rows)):
        two = pairs(form, "path", "samples")
        assert list(two) == [("a", 3), ("b", 0), ("c", 9)] and len(two) == 3
        assert two[1] == ("b", 0) and two[-1] == ("c", 9) and two[1:] == [("b", 0), ("c", 9)]
        with pytest.raises(IndexError):
            two[3]
        assert has_columns(form, ints=("samples",), texts=("path",))
        assert not has_columns(form, ints=("path",)) and not has_columns(form, texts=("samples",))
        assert not has_columns(form, ints=("missing",))
        assert present(form, "path") == ["a", "b", "c"] and present(form, "labels") == []
        assert column(form, "labels", None) == [None] * 3 and column(form, "path", None) == ["a", "b", "c"]
    assert not has_columns(compact_rows([{"samples": -1}]), ints=("samples",))
    assert column([{"a": 1}, {}], "a", 0) == [1, 0]
    assert not has_columns("not rows", ints=("samples",))


def many_shard_manifest(root: Path, shards: int) -> dict:
    """A manifest of an npy dataset of ``shards`` shards (the files are never read: only the manifest)."""
    files, listed = [], []
    for k in range(shards):
        images, labels = f"images-{k:07d}.npy", f"labels-{k:07d}.npy"
        files += [{"path": images, "bytes": 4096 + k, "sha256": digest_of(k)},
                  {"path": labels, "bytes": 160, "sha256": digest_of(-k)}]
        listed.append({"images": images, "labels": labels, "samples": 4})
    files.append({"path": "labels.npy", "bytes": 128 + 32 * shards, "sha256": digest_of(-1)})
    manifest = new_manifest(IMAGES_NPY, num_samples=4 * shards, classes=["a"], class_counts=[4 * shards],
                            sample_shape=[8, 8, 3], dtype="|u1", label_dtype="<i8", layout="NHWC", shard_size=4,
                            shards=listed, files=files, all_labels="labels.npy")
    root.mkdir()
    write_manifest(root, manifest)
    return manifest


def test_a_manifest_of_many_shards_holds_columns_not_a_dict_a_row(tmp_path):
    # Parsed JSON kept ~1.2 KB a shard (three dicts, their strings) in every rank and in every spawned
    # DataLoader worker: 1.2 GB at a million shards. Columns keep its bytes: ~200 B a shard here.
    from fastdata.storage.opening import open_path

    shards = 100_000
    plain = many_shard_manifest(tmp_path / "ds", shards)
    gc.collect()
    tracemalloc.start()
    try:
        manifest = open_path(tmp_path / "ds", (IMAGES_NPY,)).manifest  # what a dataset keeps
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(manifest["files"], Rows) and isinstance(manifest["shards"], Rows)
    assert held / shards < 300, f"{held / shards:.0f} B a shard"
    assert manifest["files"] == plain["files"] and manifest["shards"] == plain["shards"]
    assert total_bytes(manifest) == sum(f["bytes"] for f in plain["files"])
    raw = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert manifest_digest(manifest) == hashlib.sha256(canonical(raw).encode()).hexdigest()
    assert len(pickle.dumps(manifest, protocol=pickle.HIGHEST_PROTOCOL)) / shards < 200
    # load_manifest itself gives plain JSON data, for users who change or write it
    loaded = load_manifest(tmp_path / "ds")
    assert type(loaded["files"]) is list and json.loads(json.dumps(loaded)) == raw


def _same(a, b) -> bool:
    """Equal, and of the same types and key orders throughout (`Rows` where the other has `Rows`, of the same
    column kinds)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):  # (keys in the same order: what json.dumps writes)
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, Rows):
        return a.keys == b.keys and a.to_list() == b.to_list() and [c[0] for c in a._cols] == [c[0] for c in b._cols]
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("piece", [1, 9, 60, 400, 1 << 23])
def test_a_manifest_compacted_while_it_is_parsed_is_the_manifest_compacted_whole(monkeypatch, piece):
    """NOTE [compact manifest] rule 4: the long lists parsed a piece at a time (pieces of ``piece`` characters,
    down to a row each) give exactly what compacting the parsed JSON gives, for rows whose strings hold a
    row's end (``}, {``), quotes, escapes and non-ASCII text, nested lists of objects, values no column holds
    in some pieces only (ints past int64, bools, a non-dict row, a missing key), keys in another order, text
    and digests in different pieces, any JSON layout; and JSON that json.loads refuses is refused."""
    from fastdata.formats import rows_json
    from fastdata.formats.manifest import compact, parse_manifest

    monkeypatch.setattr(rows_json, "_PIECE", piece)
    rng = random.Random(piece)
    nasty = ['}, {"', "}]", '"}, {', "\\", "\n", "é", "\u2028", "}{", "],[{", 'a"b', "\ud800", "x}\t,\n{y"]

    def text() -> str:
        r = rng.random()
        return digest_of(rng.randrange(10 ** 6)) if r < 0.3 else rng.choice(nasty) if r < 0.5 else f"im-{r}.npy"

    values = {"i": lambda: rng.randrange(10 ** 6) if rng.random() > 0.002 else 2 ** 70, "s": text,
              "h": lambda: digest_of(rng.randrange(10 ** 6)), "n": lambda: [{"x": 1}, {"y": text()}],
              "b": lambda: rng.random() < 0.5}
    for trial in range(60):
        kinds = rng.choice(["sih", "sis", "snh", "sbh", "sih", "sih"])
        files = [{k: values[v]() for k, v in zip(("path", "bytes", "sha256"), kinds)}
                 for _ in range(rng.choice([0, 1, 2, 7, 120]))]
        if files and rng.random() < 0.15:
            files[rng.randrange(len(files))] = rng.choice([5, {"path": "p", "sha256": digest_of(0), "bytes": 1},
                                                           {"path": "p", "bytes": 1}])
        if files and rng.random() < 0.3:  # keys in another order (rows no column holds keep theirs)
            files[-1] = dict(reversed(list(files[-1].items()))) if isinstance(files[-1], dict) else files[-1]
        manifest = {"format": rng.choice(["fastdata.tokens", IMAGES_NPY]), "format_version": 2, "files": files,
                    "shards": [{"images": text(), "samples": rng.randrange(1, 9)} for _ in range(rng.choice([0, 40]))],
                    "other": {"files": [{"a": 1}]}, "lmdb_shards": "not a list",
                    "splits": {"train": {"tokens": 3, "shards": [{"path": text(), "tokens": 3}] * rng.randrange(30)
                                         + [{"tokens": 4, "path": text()}] * rng.randrange(2)}, "val": []}}
        layout = rng.choice([{}, {"indent": 1}, {"indent": "\t"}, {"separators": (" , ", " :  ")}])
        raw = json.dumps(manifest, ensure_ascii=rng.random() < 0.5, **layout)
        assert _same(parse_manifest(raw, columns=True), compact(json.loads(raw))), (trial, kinds)
    long = parse_manifest(json.dumps({"files": [{"path": f"f{k}", "bytes": k} for k in range(500)]}), columns=True)
    assert isinstance(long["files"], Rows) and long["files"].ints("bytes").tolist() == list(range(500))
    for broken in ['\ufeff{"files": []}', '{"files": [{"a": 1},]}', '{"files": [{"a": 1}', '{"files": [{"a": 1}]',
                   '{"files": [{"a": 1}]} x', '{"files" [1]}', "{files: 1}", '{"a": 1,}', "",
                   '{"files": [{"a": "}, {"}, {"b": 2]}', '{"files": [{"a": 1} {"a": 2}]}']:
        with pytest.raises(json.JSONDecodeError) as plain:
            json.loads(broken)
        with pytest.raises(json.JSONDecodeError) as pieces:
            parse_manifest(broken, columns=True)
        assert str(pieces.value) == str(plain.value)  # (the same message, at the same place)


def test_opening_a_manifest_of_many_shards_never_holds_a_dict_a_row(tmp_path):
    """The peak of an open, not only what it keeps: parsed whole, the dicts of every row were there at once
    (1,910 B a shard here, in every rank at once at a job's start); parsed in pieces, 1,001 B."""
    from fastdata.storage.opening import open_path

    shards = 100_000
    many_shard_manifest(tmp_path / "ds", shards)
    gc.collect()
    tracemalloc.start()
    try:
        manifest = open_path(tmp_path / "ds", (IMAGES_NPY,)).manifest
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(manifest["files"], Rows) and peak / shards < 1250, f"{peak / shards:.0f} B a shard"


def test_only_the_lists_a_format_defines_are_compacted(tmp_path):
    plain = many_shard_manifest(tmp_path / "ds", 3)
    write_manifest(tmp_path / "ds", {**plain, "splits": "a key of the user's"})  # (not a token dataset's)
    from fastdata.storage.opening import open_path

    manifest = open_path(tmp_path / "ds", (IMAGES_NPY,)).manifest
    assert isinstance(manifest["files"], Rows) and manifest["splits"] == "a key of the user's"


def test_the_dataset_version_is_the_digest_of_the_manifest_as_written(indexed_datasets, tmp_path):
    # A loader's state names the manifest's sha256: held as columns, a manifest must hash as its JSON did.
    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.tokens import TokenDataset

    from test_text_pieces import many_token_shards

    many_token_shards(tmp_path / "tok", 30, 100)
    for root, ds in [(indexed_datasets["npy"], FastDataset(indexed_datasets["npy"])),
                     (indexed_datasets["lmdb"], FastDataset(indexed_datasets["lmdb"])),
                     (tmp_path / "tok", TokenDataset(tmp_path / "tok", seq_len=15))]:
        raw = json.loads((Path(root) / "manifest.json").read_text())
        assert isinstance(ds.manifest["files"], Rows)
        assert ds.manifest_sha256 == hashlib.sha256(canonical(raw).encode()).hexdigest(), root
