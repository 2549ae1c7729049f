"""``fastdata verify`` / ``inspect`` and the manifest reader's refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdata.cli.main import main
from fastdata.errors import ChecksumError, FormatError, VersionError
from fastdata.formats.manifest import load_manifest


@pytest.fixture(params=["npy", "lmdb"])
def dataset(request, photo_folder, tmp_path) -> Path:
    out = tmp_path / "ds"
    assert main(["preprocess", "images", str(photo_folder), str(out), "--size", "16", "--shard-size", "16",
                 "--format", request.param, "--workers", "1", "--quiet"]) == 0
    return out


def _data_file(ds: Path) -> Path:
    return ds / ("images-00001.npy" if (ds / "images-00001.npy").exists() else "images-00000.lmdb")


def test_verify_intact(dataset, capsys):
    assert main(["verify", str(dataset), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_catches_a_flipped_byte(dataset, capsys):
    f = _data_file(dataset)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert main(["verify", str(dataset), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f.name in err and "mismatch" in err


def test_verify_catches_truncated_and_missing_files(dataset, capsys):
    f = _data_file(dataset)
    f.write_bytes(f.read_bytes()[:-10])
    (dataset / "labels-00000.npy" if (dataset / "labels-00000.npy").exists() else dataset / "labels.npy").unlink()
    assert main(["verify", str(dataset), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"{f.name}: " in err and "truncated" in err and "missing" in err


def test_verify_a_node_cache_counts_absent_files_but_catches_damaged_ones(dataset, capsys):
    (dataset / ".source.json").write_text(json.dumps({"url": "s3://bucket/ds", "id": "x", "created": 0}))
    f = _data_file(dataset)
    f.unlink()  # evicted, or never fetched: a streamed file is fetched and checked when read
    assert main(["verify", str(dataset), "--quiet"]) == 0
    assert "1 not in this node cache" in capsys.readouterr().out
    g = next(p for p in sorted(dataset.iterdir()) if p.suffix in (".npy", ".lmdb") and p != f)
    g.write_bytes(g.read_bytes()[:-10])
    assert main(["verify", str(dataset), "--quiet"]) == 1
    assert f"{g.name}: " in capsys.readouterr().err
    (dataset / ".source.json").unlink()  # an ordinary folder: the absent file is a problem again
    assert main(["verify", str(dataset), "--quiet"]) == 1
    assert f"{f.name}: missing" in capsys.readouterr().err


def test_a_file_evicted_between_its_stat_and_its_hash_is_absent_not_a_traceback(dataset, capsys, monkeypatch):
    """A node cache evicts while verify runs: the file was there at the stat, gone at the open
    (a bare FileNotFoundError)."""
    import fastdata.formats.integrity as integrity

    (dataset / ".source.json").write_text(json.dumps({"url": "s3://bucket/ds", "id": "x", "created": 0}))
    victim, real = _data_file(dataset), integrity.hash_file

    def evicted_first(path, *args, **kwargs):
        if path.name == victim.name:
            path.unlink()  # (the cache of a job reading it, right after verify's stat)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(integrity, "hash_file", evicted_first)
    assert main(["verify", str(dataset), "--quiet", "--workers", "1"]) == 0  # (absent: fetched when read)
    assert not victim.exists() and capsys.readouterr().err == ""


def test_a_dataset_replaced_while_it_is_verified_is_said_so_not_damaged(dataset, photo_folder, capsys, monkeypatch):
    """An overwrite swapped the folder under a verify: every file of two intact datasets was reported
    "truncated or replaced"."""
    import fastdata.formats.integrity as integrity

    real, fmt = integrity.check_file, "lmdb" if (dataset / "images-00000.lmdb").exists() else "npy"
    swapped = []

    def overwritten_first(root, entry, **kwargs):
        if not swapped:  # (another terminal remakes it with other parameters meanwhile)
            swapped.append(main(["preprocess", "images", str(photo_folder), str(dataset), "--size", "24",
                                 "--shard-size", "16", "--format", fmt, "--workers", "1", "--quiet", "--overwrite"]))
        return real(root, entry, **kwargs)
    monkeypatch.setattr(integrity, "check_file", overwritten_first)
    assert main(["verify", str(dataset), "--quiet", "--workers", "1"]) == 1 and swapped == [0]
    assert "was replaced while it was verified" in capsys.readouterr().err
    monkeypatch.setattr(integrity, "check_file", real)
    assert main(["verify", str(dataset), "--quiet"]) == 0


def test_the_verify_command_holds_one_manifest_as_columns(tmp_path, capsys):
    """`fastdata verify` held the manifest as plain JSON while `verify` parsed it again (2.8 GB at 10^6
    shards): the command keeps its counts, the check its columns. 10^4 shards of empty files here."""
    import hashlib
    import tracemalloc

    from fastdata.formats.manifest import IMAGES_NPY, new_manifest, write_manifest

    empty, files, shards = hashlib.sha256(b"").hexdigest(), [], []
    for k in range(10_000):
        names = {"images": f"images-{k:05d}.npy", "labels": f"labels-{k:05d}.npy"}
        for name in names.values():
            (tmp_path / name).touch()
            files.append({"path": name, "bytes": 0, "sha256": empty})
        shards.append({**names, "samples": 1})
    write_manifest(tmp_path, new_manifest(IMAGES_NPY, num_samples=10_000, classes=["a"], class_counts=[10_000],
                                          sample_shape=[8, 8, 3], dtype="|u1", label_dtype="<i8", layout="NHWC",
                                          shard_size=1, shards=shards, files=files))
    tracemalloc.start()
    try:
        assert main(["verify", str(tmp_path), "--quiet", "--workers", "2"]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "OK, 20000 files intact" in capsys.readouterr().out
    assert peak / len(files) < 1100, peak / len(files)  # (866 bytes a file; two copies: 1,341)


def test_files_hashed_at_once_give_the_same_problems_in_the_manifests_order(dataset, capsys):
    from fastdata.formats.integrity import verify

    files = [e["path"] for e in load_manifest(dataset)["files"]]
    flipped, cut, gone = (dataset / files[i] for i in (0, 2, 3))
    data = bytearray(flipped.read_bytes())
    data[len(data) // 3] ^= 0x40
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-7])
    gone.unlink()
    one = verify(dataset, workers=1)
    assert [p.split(":")[0] for p in one] == [files[0], files[2], files[3]]
    assert verify(dataset, workers=4) == verify(dataset) == one
    seen = []
    verify(dataset, seen.append, workers=3)  # blocks hashed, reported from the worker threads
    entries = load_manifest(dataset)["files"]
    assert sum(seen) == sum(e["bytes"] for e in entries if e["path"] != files[3])  # (the cut file: as if whole)
    assert main(["verify", str(dataset), "--quiet", "--workers", "0"]) == 1
    assert "--workers must be a positive integer" in capsys.readouterr().err


def _edit_manifest(ds: Path, **changes) -> None:
    m = json.loads((ds / "manifest.json").read_text())
    m.update(changes)
    (ds / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("where", [0, -1])
@pytest.mark.parametrize("bad", ["../../../etc/passwd", "/etc/passwd", "", "sub/../../x", "a/..", ".."])
def test_manifest_paths_may_not_escape_the_folder(dataset, capsys, bad, where):
    from fastdata.datasets.images import FastDataset

    m = json.loads((dataset / "manifest.json").read_text())
    m["files"][where]["path"] = bad
    (dataset / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="not a plain relative path"):
        load_manifest(dataset)
    with pytest.raises(FormatError, match="not a plain relative path"):  # (the columns a dataset keeps)
        FastDataset(dataset)
    assert main(["verify", str(dataset), "--quiet"]) == 1
    assert "refusing" in capsys.readouterr().err


def test_paths_are_refused_by_their_text_not_by_a_look_alike():
    # whole-buffer tests find the paths to check; each found one is checked by `plain_relative`, so a name
    # with two dots in it, or a slash inside, is served like any other
    import random

    from fastdata._io import plain_relative
    from fastdata.formats.rows import compact_rows, suspect_paths

    rng = random.Random(3)
    for trial in range(300):
        paths = ["".join(rng.choice("ab./é") for _ in range(rng.randrange(0, 7))) for _ in range(rng.randrange(1, 30))]
        rows = compact_rows([{"path": p, "bytes": 1} for p in paths])
        suspects = suspect_paths(rows)
        assert suspects == [p for p in paths if not p or p.startswith("/") or ".." in p], trial
        for p in paths:
            if p not in suspects:
                plain_relative(Path("."), p)  # (raises for a path that escapes)


_SHA = "0" * 64


@pytest.mark.parametrize("entry", [
    {"path": "x.npy", "sha256": _SHA}, {"path": "x.npy", "bytes": "12", "sha256": _SHA},
    {"path": 3, "bytes": 1, "sha256": _SHA}, {"path": "x.npy", "bytes": -1, "sha256": _SHA},
    {"path": "x.npy", "bytes": 2 ** 63, "sha256": _SHA}, "x.npy", {"path": "x.npy", "bytes": 1},
    {"path": "x.npy", "bytes": 1, "sha256": 5}])
def test_a_file_listed_without_its_path_size_and_checksum_is_refused(dataset, entry, capsys):
    """(Without its sha256: verify and push raised a bare KeyError.)"""
    m = json.loads((dataset / "manifest.json").read_text())
    m["files"].append(entry)
    (dataset / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="as a file, not a path, its size in bytes and its sha256"):
        load_manifest(dataset)
    assert main(["verify", str(dataset), "--quiet"]) == 1 and "Traceback" not in capsys.readouterr().err


def test_a_manifest_of_another_shape_is_one_line(dataset, tmp_path, capsys):
    """A format given as a list (TypeError: unhashable) or JSON nested 10^5 deep (RecursionError)."""
    m = json.loads((dataset / "manifest.json").read_text())
    (dataset / "manifest.json").write_text(json.dumps({**m, "format": [m["format"]]}))
    with pytest.raises(FormatError, match="unknown format"):
        load_manifest(dataset)
    (dataset / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match="is not valid JSON .*nested too deeply"):
        load_manifest(dataset)
    assert main(["verify", str(dataset), "--quiet"]) == 1 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.pop("tokenizer"), "its tokenizer None is not"),
    (lambda m: m["tokenizer"].update(eos_id="x"), "is not a spec, kind, definition_sha256, vocab_size and an end"),
    (lambda m: m["tokenizer"].update(eos_id=300), "end-of-document id below it"),
    (lambda m: m["splits"]["train"]["shards"][0].update(path="gone.npy"), "names 'gone.npy' as a shard, but its "
                                                                            "files do not list it")])
def test_a_token_manifest_with_a_damaged_tokenizer_or_an_unlisted_shard_is_refused(tmp_path, edit, needle, capsys):
    """A missing tokenizer block or a non-numeric id raised KeyError/ValueError in train and inspect; a shard
    the files do not list was opened unchecked (a bare FileNotFoundError when absent)."""
    from fastdata.datasets.tokens import TokenDataset

    (tmp_path / "a.txt").write_text("".join(f"document {i} " * 30 + "\n\n" for i in range(20)))
    assert main(["preprocess", "text", str(tmp_path / "a.txt"), str(tmp_path / "tok"), "--tokenizer", "bytes",
                 "--quiet"]) == 0
    m = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    edit(m)
    (tmp_path / "tok" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=needle):
        TokenDataset(tmp_path / "tok", "train", 16)
    assert main(["inspect", str(tmp_path / "tok")]) in (0, 1) and "Traceback" not in capsys.readouterr().err


def test_sizes_by_one_stat_a_file_agree_with_a_walk_of_each_path(tmp_path):
    from fastdata._io import contained_sizes, contained_stat

    root, outside = tmp_path / "ds", tmp_path / "outside"
    (root / "sub" / "deeper").mkdir(parents=True)
    outside.mkdir()
    (root / "a.npy").write_bytes(b"x" * 5)
    (root / "sub" / "b.npy").write_bytes(b"x" * 7)
    (root / "sub" / "deeper" / "c").write_bytes(b"")
    (root / "folder.npy").mkdir()
    (root / "inside.npy").symlink_to("sub/b.npy")
    (root / "linked").symlink_to("sub")
    (outside / "d.npy").write_bytes(b"x" * 9)
    names = ["a.npy", "sub/b.npy", "sub/deeper/c", "folder.npy", "inside.npy", "linked/b.npy", "absent.npy",
             "sub/absent", "a.npy/under-a-file", ".", "sub", "a..b"]
    want = []
    for rel in names:
        st = contained_stat(root, rel)
        want.append(-1 if st is None else st.st_size if st.st_mode & 0o170000 == 0o100000 else -2)
    assert contained_sizes(root, names).tolist() == want == [5, 7, 0, -2, 7, 7, -1, -1, -1, -2, -2, -1]
    (root / "away.npy").symlink_to(outside / "d.npy")
    (root / "away").symlink_to(outside)
    refused = ["away.npy", "away/d.npy", "..", "", "/etc/passwd", "sub/../..", 7]
    assert contained_sizes(root, ["a.npy", *refused]).tolist() == [5] + [-3] * len(refused)
    for rel in refused:  # (-3: contained_stat says why)
        with pytest.raises(FormatError, match="outside|not a plain relative path"):
            contained_stat(root, rel)


@pytest.mark.parametrize("extra", [0, 1500])
def test_present_files_are_checked_alike_by_a_stat_each_or_a_listing_first(tmp_path, extra):
    """`check_sizes(present_only=True)` (a streamed dataset's cache folder: most files absent) lists the
    folder first past 1,000 names and stats only what it holds: the same files found, the same refusals."""
    from fastdata.errors import ChecksumError
    from fastdata.storage.shards import check_sizes

    root, outside = tmp_path / "cache", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    files = [{"path": f"absent-{k:05d}.npy", "bytes": 3} for k in range(extra)]
    for name, size in (("a.npy", 5), ("sub/b.npy", 7), ("c.npy", 2)):
        (root / name).write_bytes(b"x" * size)
        files.append({"path": name, "bytes": size})
    files += [{"path": "gone.npy", "bytes": 4}, {"path": "sub/gone.npy", "bytes": 4}]
    manifest = {"files": files}
    assert check_sizes(root, manifest, present_only=True) == ["a.npy", "sub/b.npy", "c.npy"]
    assert check_sizes(root, manifest, present_only=True, skip={"c.npy"}) == ["a.npy", "sub/b.npy"]
    (root / "c.npy").write_bytes(b"x")  # truncated
    with pytest.raises(ChecksumError, match="c.npy has 1 bytes"):
        check_sizes(root, manifest, present_only=True)
    (root / "c.npy").unlink()
    (root / "c.npy").mkdir()  # a folder where the file should be
    with pytest.raises(FormatError, match="c.npy is missing"):
        check_sizes(root, manifest, present_only=True)
    (root / "c.npy").rmdir()
    (outside / "c.npy").write_bytes(b"xx")
    (root / "c.npy").symlink_to(outside / "c.npy")  # a link out of the folder
    with pytest.raises(FormatError, match="outside"):
        check_sizes(root, manifest, present_only=True)


_UNLISTABLE = """
import os, sys
from pathlib import Path
from fastdata.storage.shards import check_sizes
root, extra = Path(sys.argv[1]), int(sys.argv[2])
if os.geteuid() == 0:  # (root reads any folder: the check runs as nobody)
    os.setgid(65534)
    os.setuid(65534)
else:
    os.chmod(root, 0o300)  # this user may enter it, not list it
files = [{"path": f"absent-{k:05d}.npy", "bytes": 3} for k in range(extra)] + [{"path": "a.npy", "bytes": 5}]
print(check_sizes(root, {"files": files}, present_only=True))
"""


@pytest.mark.parametrize("extra", [0, 1500])
def test_a_folder_that_may_be_entered_but_not_listed_is_checked_by_stats(extra):
    """A folder its reader may enter but not list: the stat of each file serves it (an O_PATH descriptor),
    and so does the listing path past 1,000 names, by falling back to it (it raised PermissionError)."""
    import os
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(dir="/tmp"))  # (not under the 0700 folders of pytest: nobody must reach it)
    try:
        os.chmod(base, 0o755)
        root = base / "ds"
        root.mkdir()
        (root / "a.npy").write_bytes(b"x" * 5)
        os.chmod(root / "a.npy", 0o644)
        os.chmod(root, 0o711)
        r = subprocess.run([sys.executable, "-c", _UNLISTABLE, str(root), str(extra)], capture_output=True,
                           text=True, cwd=Path(__file__).parent.parent)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "['a.npy']"
    finally:
        os.chmod(base / "ds", 0o755)
        shutil.rmtree(base)


def test_the_first_problem_in_the_manifests_order_is_the_one_named(dataset, tmp_path):
    # every file is stat'd before any size is compared: a later link out of the folder must not hide an
    # earlier truncated file (nor turn its error into another)
    from fastdata.datasets.images import FastDataset

    data = sorted(p for p in dataset.iterdir() if p.name.startswith("images-"))
    first, later = data[0], data[-1]
    (tmp_path / "elsewhere").write_bytes(later.read_bytes())
    later.unlink()
    later.symlink_to(tmp_path / "elsewhere")
    whole = first.read_bytes()
    first.write_bytes(whole[:-1])
    with pytest.raises(ChecksumError, match=rf"{first.name} has \d+ bytes but the manifest says"):
        FastDataset(dataset)
    first.write_bytes(whole)
    with pytest.raises(FormatError, match=f"'{later.name}' resolves to .*outside"):
        FastDataset(dataset)


def test_a_link_that_leaves_the_folder_is_refused_one_that_stays_is_served(dataset, tmp_path):
    """NOTE [manifest paths]: a manifest is checked by its text when loaded; a data file replaced by a link is
    refused when opened if the link leads outside the folder (its bytes never read), served if it stays."""
    from fastdata.datasets.images import FastDataset

    f = _data_file(dataset)
    want = FastDataset(dataset).get_batch(np.arange(40))
    moved = dataset / "moved" / f.name  # inside the folder, behind a link
    moved.parent.mkdir()
    f.rename(moved)
    f.symlink_to(Path("moved") / f.name)
    got = FastDataset(dataset).get_batch(np.arange(40))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    outside = tmp_path / "elsewhere" / f.name  # the same bytes, outside: refused all the same
    outside.parent.mkdir()
    moved.rename(outside)
    f.unlink()
    f.symlink_to(outside)
    load_manifest(dataset)  # (the text is plain: loading it reads no file)
    with pytest.raises(FormatError, match="outside"):
        FastDataset(dataset).get_batch(np.arange(40))
    assert main(["verify", str(dataset), "--quiet"]) == 1
    if f.suffix == ".lmdb":  # a store is opened at its first read: a link planted after the open is refused then
        f.unlink()
        outside.rename(f)
        ds = FastDataset(dataset)
        f.rename(outside)
        f.symlink_to(outside)
        with pytest.raises(FormatError, match="outside"):
            ds.get_batch(np.arange(40))


def _shards_key(m: dict) -> str:
    return "shards" if "shards" in m else "lmdb_shards"


def _uneven(m: dict) -> None:  # the same total, another split between shards: rows would land elsewhere
    shards = m[_shards_key(m)]
    shards[0]["samples"] -= 1
    shards[-1]["samples"] += 1


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(shard_size=0), "shard_size is 0"),
    (lambda m: m.update(shard_size=14), "shards hold [16, 16, 10] samples, not 42 samples in shards of 14"),
    (_uneven, "shards hold [15, 16, 11] samples, not 42"),
    (lambda m: m.update(num_samples=43), "not 43 samples"),
    (lambda m: m.update(num_samples=-1), "num_samples is -1"),
    (lambda m: m.pop("classes"), "'classes' is not a list"),
    (lambda m: m[_shards_key(m)][1].pop("samples"), "is not a list of shards with sample counts"),
], ids=["shard_size_0", "shard_size_other", "uneven", "count", "negative", "classes", "no_samples"])
def test_a_manifest_whose_numbers_cannot_describe_its_files_is_refused(dataset, edit, needle, capsys):
    m = json.loads((dataset / "manifest.json").read_text())
    edit(m)
    (dataset / "manifest.json").write_text(json.dumps(m))
    if m["format"].endswith("lmdb") and edit is _uneven:  # version 4: shards may be short; their stores say
        from fastdata.datasets.images import FastDataset  # how many records they hold

        with pytest.raises(FormatError, match=r"images-00000\.lmdb holds 16 records, the manifest says 15"):
            FastDataset(dataset).get_batch(np.arange(4))
        assert main(["verify", str(dataset), "--quiet"]) == 1  # (which verify finds before any read)
        assert "images-00000.lmdb: holds 16 records, the manifest says 15" in capsys.readouterr().err
        return
    with pytest.raises(FormatError, match="the manifest is damaged") as err:
        load_manifest(dataset)
    assert needle in str(err.value)
    assert main(["verify", str(dataset), "--quiet"]) == 1
    out = capsys.readouterr().err
    assert needle in out and len(out.strip().splitlines()) == 1 and "Traceback" not in out


def _labels_key(m: dict) -> str:
    return "labels" if m["format"].endswith("lmdb") else "all_labels"


_KEY_CASES = [  # (LMDB only, edit, what the message says)
    (False, lambda m: m.update(skipped=3), "'skipped' (the list of inputs left out) is 3"),
    (False, lambda m: m.update(class_counts=None), "class_counts None is not a count for each of its 3 classes"),
    (False, lambda m: m.update(class_counts=[14, 14]), "class_counts [14, 14] is not a count for each of its 3 "
                                                       "classes"),
    (False, lambda m: m.update(class_counts=[14, -1, 14]), "class_counts [14, -1, 14] is not a count"),
    (False, lambda m: m.update({_labels_key(m): "x"}), "names 'x' as the file of every sample's label, but its files "
                                                       "do not list it"),
    (False, lambda m: m.update({_labels_key(m): 3}), "(the file of every sample's label) is 3"),
    (True, lambda m: m.pop("labels"), "'labels' (the file of every sample's label) is missing"),
    (True, lambda m: m.pop("max_short_side"), "max_short_side (the stored images' largest shorter side, in pixels) "
                                              "is missing"),
    (True, lambda m: m.update(max_short_side=0), "max_short_side (the stored images' largest shorter side, in "
                                                 "pixels) is 0"),
    (True, lambda m: m.update(max_side="80"), "max_side (the stored images' largest longer side, in pixels) is '80'"),
]
_KEY_IDS = ["skipped", "class_counts_null", "class_counts_short", "class_counts_negative", "labels_unlisted",
            "labels_not_a_name", "labels_missing", "max_short_side_missing", "max_short_side_0", "max_side_text"]


# The LMDB-only keys (an npy dataset made before all_labels has none: it reads each shard's labels) run on LMDB only.
@pytest.mark.parametrize("dataset, edit, needle", [
    pytest.param(fmt, edit, needle, id=f"{name}-{fmt}")
    for (lmdb_only, edit, needle), name in zip(_KEY_CASES, _KEY_IDS)
    for fmt in (("lmdb",) if lmdb_only else ("npy", "lmdb"))], indirect=["dataset"])
def test_a_manifest_with_a_damaged_key_beside_its_numbers_is_one_line_naming_the_key(dataset, edit, needle, capsys):
    """inspect raised TypeError tracebacks (skipped as a number, class_counts null); an LMDB without max_short_side
    failed at its first batch inside torch; a labels file the files do not list was a bare FileNotFoundError, a
    missing one a KeyError 'shards'."""
    from fastdata.datasets.images import FastDataset

    m = json.loads((dataset / "manifest.json").read_text())
    edit(m)
    (dataset / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="the manifest is damaged; re-run `fastdata preprocess`") as err:
        load_manifest(dataset)
    assert needle in str(err.value)
    with pytest.raises(FormatError) as err:
        FastDataset(dataset).get_batch([0, 1])
    assert needle in str(err.value)
    for cmd in (["inspect", str(dataset)], ["inspect", str(dataset), "--json"], ["verify", str(dataset), "--quiet"]):
        assert main(cmd) == 1
        out = capsys.readouterr().err
        assert needle in out and len(out.strip().splitlines()) == 1 and "Traceback" not in out


def test_verify_compares_each_lmdb_stores_record_count_with_the_manifest(photo_folder, tmp_path, capsys):
    """Counts moved between shards (the same total): every checksum matched and verify said OK, then reads failed
    with "the manifest is damaged". One read-only open a store, shared with a reader open in the process."""
    from fastdata.datasets.images import FastDataset
    from fastdata.formats.integrity import verify

    ds = tmp_path / "ds"
    assert main(["preprocess", "images", str(photo_folder), str(ds), "--size", "16", "--shard-size", "16",
                 "--format", "lmdb", "--workers", "1", "--quiet"]) == 0
    m = json.loads((ds / "manifest.json").read_text())
    assert [s["samples"] for s in m["lmdb_shards"]] == [16, 16, 10]
    m["lmdb_shards"][0]["samples"], m["lmdb_shards"][2]["samples"] = 15, 11
    (ds / "manifest.json").write_text(json.dumps(m))
    reader = FastDataset(ds)
    assert reader.get_batch([20])[0].shape == (1, 16, 16, 3)  # (its store 1 is open in this process)
    want = ["images-00000.lmdb: holds 16 records, the manifest says 15 (the manifest is damaged: re-run "
            "`fastdata preprocess`, or restore the dataset's own manifest.json)",
            "images-00002.lmdb: holds 10 records, the manifest says 11 (the manifest is damaged: re-run "
            "`fastdata preprocess`, or restore the dataset's own manifest.json)"]
    assert verify(ds) == want
    assert main(["verify", str(ds), "--quiet"]) == 1
    assert capsys.readouterr().err.splitlines()[1:] == [f"  {line}" for line in want]
    with pytest.raises(FormatError, match=r"images-00000\.lmdb holds 16 records, the manifest says 15"):
        reader.get_batch([0])  # (what a read says of it)
    assert reader.get_batch([20])[0].shape == (1, 16, 16, 3)  # (the store verify opened too: still served)
    (ds / "images-00001.lmdb").write_bytes(b"x" * (ds / "images-00001.lmdb").stat().st_size)
    assert [p.split(":")[0] for p in verify(ds)] == ["images-00001.lmdb"] + [w.split(":")[0] for w in want]


@pytest.mark.parametrize("change, needle", [({"dtype": "<f4"}, "image dtype '<f4'"),
                                            ({"sample_shape": [16, 16]}, "sample_shape [16, 16]")])
def test_an_npy_manifest_with_another_pixel_layout_is_refused(photo_folder, tmp_path, change, needle):
    out = tmp_path / "ds"
    assert main(["preprocess", "images", str(photo_folder), str(out), "--size", "16", "--quiet"]) == 0
    _edit_manifest(out, **change)
    with pytest.raises(FormatError, match="the manifest is damaged") as err:
        load_manifest(out)
    assert needle in str(err.value)


def test_newer_format_version_is_refused_naming_the_writer(dataset):
    _edit_manifest(dataset, format_version=99, fastdata_version="9.9.9")
    with pytest.raises(VersionError, match=r"version 99 was written by fastdata 9\.9\.9.*upgrade fastdata"):
        load_manifest(dataset)


def test_not_a_dataset(tmp_path, capsys):
    (tmp_path / "plain").mkdir()
    assert main(["inspect", str(tmp_path / "plain")]) == 1
    assert "no manifest.json" in capsys.readouterr().err
    (tmp_path / "plain" / "manifest.json").write_text("{not json")
    assert main(["verify", str(tmp_path / "plain")]) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_inspect_text_and_json(dataset, capsys):
    assert main(["inspect", str(dataset)]) == 0
    text = capsys.readouterr().out
    assert "samples:   42" in text and "class_2" in text and "MiB" in text
    assert main(["inspect", str(dataset), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] == 42 and info["classes"] == {"class_0": 14, "class_1": 14, "class_2": 14}
    assert info["bytes"] == sum(p.stat().st_size for p in dataset.iterdir() if p.name != "manifest.json")
    assert info["params"]["size"] == 16


def test_python_dash_m_and_version():
    r = subprocess.run([sys.executable, "-m", "fastdata", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("fastdata ")


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--per-class", "8"]) == 0
    out = capsys.readouterr().out
    assert "preprocessed 32 images" in out and "verify: OK" in out and "FastLoader" in out and "total time" in out


def test_inspect_names_no_classes_or_label_dtype_for_a_dataset_without_class_labels(tmp_path, capsys):
    from PIL import Image

    src = tmp_path / "src"
    for sub in ("images", "masks"):
        (src / sub).mkdir(parents=True)
    for i in range(3):  # a segmentation set: masks, no class labels
        Image.new("RGB", (24, 24), (9 * i, 90, 200)).save(src / "images" / f"{i}.png")
        Image.new("L", (24, 24), i).save(src / "masks" / f"{i}.png")
    assert main(["preprocess", "images", str(src), str(tmp_path / "seg"), "--size", "16", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "seg")]) == 0
    text = capsys.readouterr().out
    assert "field:     mask: mask" in text  # (before: "label_dtype:  <i8" and "classes:   0")
    assert not [line for line in text.splitlines() if line.startswith(("label_dtype:", "classes:"))]


@pytest.mark.parametrize("args, name, what", [(["verify", ""], "path", "a folder, a file or a URL"),
                                              (["inspect", ""], "path", "a folder, a file or a URL"),
                                              (["push", "", "URL"], "data", "a dataset folder"),
                                              (["bench", "", "--seconds", "1", "--model", "none", "--device", "cpu",
                                                "--quiet"], "data", "a dataset folder")])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(indexed_datasets, tmp_path, monkeypatch, capsys,
                                                                 args, name, what):
    monkeypatch.chdir(indexed_datasets["npy"])  # (an unset variable: verify, inspect, push and bench read this)
    args = [a.replace("URL", (tmp_path / "pushed").as_uri()) for a in args]
    with pytest.raises(SystemExit) as caught:
        main(args)
    assert caught.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"fastdata {args[0]}: error: argument {name}: an empty path: "
                                                        f"give {what}")
    assert not (tmp_path / "pushed").exists()


def test_demo_remakes_its_jpegs_when_they_are_not_what_this_run_writes(tmp_path, capsys):
    from fastdata.cli import demo
    from fastdata.cli.synthetic import make_image_folder
    from fastdata.errors import ConfigError

    out, names = tmp_path / "demo", [f"class_{c}/img_{i:04d}.jpg" for c in range(4) for i in range(2)]
    make_image_folder(out / "jpeg", per_class=3, sizes=((40, 30),))  # an earlier run's: 3 per class
    assert main(["demo", "--out", str(out), "--per-class", "2"]) == 0
    text = capsys.readouterr().out
    assert "writing 8 JPEG files" in text and "preprocessed 8 images" in text  # (before: 12, 4 of them stale)
    assert sorted(p.relative_to(out / "jpeg").as_posix() for p in (out / "jpeg").rglob("*") if p.is_file()) == names
    made = {p: p.stat().st_mtime_ns for p in (out / "jpeg").rglob("*.jpg")}
    assert demo._demo_images(out, 4, 2, 0) == out / "jpeg" and capsys.readouterr().out == ""  # the same: reused
    assert {p: p.stat().st_mtime_ns for p in (out / "jpeg").rglob("*.jpg")} == made
    demo._demo_images(out, 4, 2, 1)  # another seed: the same names, other pixels
    assert capsys.readouterr().out.startswith("writing 8 JPEG files")
    (out / "jpeg" / "notes.txt").write_text("mine")  # a file the demo does not write: refused, kept
    with pytest.raises(ConfigError, match="holds files the demo does not write \\(notes.txt\\)"):
        demo._demo_images(out, 4, 3, 0)
    assert (out / "jpeg" / "notes.txt").read_text() == "mine"


def test_demo_out_a_file_is_one_line_not_a_traceback(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["demo", "--out", str(afile)]) == 1  # (a NotADirectoryError traceback)
    assert capsys.readouterr().err == (f"fastdata: error: demo folder {afile} is a file: give the demo a folder to "
                                       "work in (fastdata demo --out DIR)\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "jpeg").write_text("mine")  # a file where the demo's JPEG folder goes
    assert main(["demo", "--out", str(tmp_path / "out"), "--per-class", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fastdata: error: cannot write {tmp_path / 'out' / 'jpeg'}: Not a directory; a file stands")
    assert err.count("\n") == 1 and afile.read_text() == (tmp_path / "out" / "jpeg").read_text() == "mine"
