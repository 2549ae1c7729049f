"""Faults on the preparation side: a killed ``--overwrite`` keeps the old dataset (NOTE [overwrite] in
fastdata/preprocess/journal.py), with real subprocesses killed by SIGKILL."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from conftest import journaled_units, kill_when_journaled, started_while_held

from fastdata.cli.main import main
from fastdata.preprocess import journal

pytestmark = pytest.mark.faults


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _commands(kind: str, src: Path) -> tuple[list[str], list[str]]:
    """(the old dataset's arguments, the new one's) without OUT: ``preprocess KIND SRC`` then OUT then options."""
    if kind == "text":
        base = ["preprocess", "text", str(src)]
        return [*base, "--shard-tokens", "50000", "--quiet"], [*base, "--shard-tokens", "20000", "--quiet"]
    base = ["preprocess", "images", str(src)]
    opts = ["--shard-size", "8", "--format", kind, "--workers", "1", "--quiet"]
    return [*base, "--size", "16", *opts], [*base, "--size", "40", *opts]


def _source(kind: str, root: Path) -> Path:
    if kind == "text":
        root.mkdir()
        rng = random.Random(0)
        for i in range(200):
            (root / f"{i:03d}.txt").write_text(" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(20_000)))
        return root
    from fastdata.cli.synthetic import make_image_folder

    make_image_folder(root, num_classes=2, per_class=60, sizes=((640, 480), (480, 640)))
    return root


def _with_out(args: list[str], out: Path) -> list[str]:
    return [*args[:3], str(out), *args[3:]]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["npy", "lmdb", "text"])
def test_a_killed_overwrite_leaves_the_old_dataset_and_its_rerun_replaces_it(tmp_path, kind):
    src = _source(kind, tmp_path / "src")
    old_args, new_args = _commands(kind, src)
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert main(_with_out(old_args, out)) == 0
    assert main(_with_out(new_args, ref)) == 0
    before = tree_bytes(out)
    staging = journal.staging_dir(out)

    kill_when_journaled([sys.executable, "-m", "fastdata", *_with_out(new_args, out), "--overwrite"], staging, 2)
    assert tree_bytes(out) == before  # not a byte of the old dataset changed
    assert main(["verify", str(out), "--quiet"]) == 0
    _load_one(out, kind)
    units = journaled_units(staging)
    # the units' files that stay in the dataset: npy shards, LMDB shards (an LMDB shard's labels-K.npy goes once
    # labels.npy is written; token lengths live in the partial)
    kept = {f["path"]: (staging / f["path"]).stat().st_ino for u in units for f in u["files"]
            if (staging / f["path"]).exists() and not (kind == "lmdb" and f["path"].startswith("labels-"))}

    assert main([*_with_out(new_args, out), "--overwrite"]) == 0  # resumes in the staging folder, then swaps
    assert tree_bytes(out) == tree_bytes(ref)
    assert all((out / name).stat().st_ino == ino for name, ino in kept.items())  # resumed, and moved, not copied
    assert kind == "text" or len(kept) >= 2
    assert not staging.exists() and not (tmp_path / ".out.fastdata-old").exists()
    assert main(["verify", str(out), "--quiet"]) == 0


def _load_one(out: Path, kind: str) -> None:
    if kind == "text":
        from fastdata.datasets.tokens import TokenDataset

        assert len(TokenDataset(out, seq_len=16)) > 0
    else:
        from fastdata.datasets.images import FastDataset

        ds = FastDataset(out)
        x, _ = ds[len(ds) - 1]
        assert 16 in tuple(x.shape)  # the old dataset's size


def test_an_overwrite_keeps_serving_readers_of_the_old_dataset_and_leaves_nothing_beside(photo_folder, tmp_path):
    import numpy as np

    from fastdata.datasets.images import FastDataset

    out = tmp_path / "out"
    args = ["preprocess", "images", str(photo_folder), str(out), "--workers", "1", "--quiet"]
    assert main([*args, "--size", "16"]) == 0
    old = FastDataset(out, storage="mmap")
    first = old[0][0].numpy().copy()
    assert main([*args, "--size", "24", "--overwrite"]) == 0
    assert np.array_equal(old[0][0].numpy(), first)  # its maps still hold the old files' pages
    assert tuple(FastDataset(out)[0][0].shape) != tuple(first.shape)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "photos"]  # no staging or old folder left


@pytest.mark.slow
def test_overwrites_started_together_give_one_intact_dataset(photo_folder, tmp_path):
    """NOTE [one writer]: runs waiting on OUT while an overwrite swaps a new folder in wait on the new one."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    args = [str(photo_folder), "--size", "16", "--shard-size", "8", "--workers", "1", "--quiet"]
    assert main(["preprocess", "images", args[0], str(ref), *args[1:]]) == 0
    assert main(["preprocess", "images", args[0], str(out), "--size", "20", "--quiet"]) == 0
    with journal.exclusive(out):
        procs, lines = started_while_held(out, [["preprocess", "images", args[0], str(out), *args[1:],
                                                 "--overwrite"]] * 3)
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0], lines
    assert tree_bytes(out) == tree_bytes(ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "photos", "ref"]


def test_without_an_atomic_exchange_the_overwrite_still_replaces_the_dataset(photo_folder, tmp_path, monkeypatch):
    """NOTE [overwrite] rule 4: a file system without RENAME_EXCHANGE gets two renames; the result is the same."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    args = ["preprocess", "images", str(photo_folder), "--workers", "1", "--quiet", "--size"]
    assert main([*args[:3], str(ref), *args[3:], "24"]) == 0
    assert main([*args[:3], str(out), *args[3:], "16"]) == 0
    monkeypatch.setattr(journal, "_exchange", lambda a, b: False)
    assert main([*args[:3], str(out), *args[3:], "24", "--overwrite"]) == 0
    assert tree_bytes(out) == tree_bytes(ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "photos", "ref"]


_DIE_AFTER_MANIFEST = """
import os, signal, sys
import fastdata.preprocess.{module} as m
from fastdata.preprocess.store_out import StoreOut
real = m.write_manifest if {local} else StoreOut.put

def then_die(*args, **kwargs):
    real(*args, **kwargs)
    if {local} or args[-1] == "manifest.json":
        os.kill(os.getpid(), signal.SIGKILL)

if {local}:
    m.write_manifest = then_die
else:
    StoreOut.put = then_die
from fastdata.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("kind", ["lmdb", "npy", "text"])
@pytest.mark.parametrize("where", ["local", "url"])
def test_a_run_killed_after_its_manifest_leaves_what_an_uninterrupted_one_does(tmp_path, kind, where, request):
    """Killed after the manifest, before its clean-up (the journal; an LMDB run's per-shard labels files): a
    rerun found the dataset complete and left both for good."""
    import signal
    import subprocess

    if kind == "text":
        (tmp_path / "src").mkdir()
        for i in range(6):
            (tmp_path / "src" / f"{i}.txt").write_text(f"document {i} " * 300)
        args = ["preprocess", "text", str(tmp_path / "src"), "--shard-tokens", "2000", "--quiet"]
    else:
        from fastdata.cli.synthetic import make_image_folder

        make_image_folder(tmp_path / "src", num_classes=2, per_class=6, sizes=((40, 32),))
        args = ["preprocess", "images", str(tmp_path / "src"), "--size", "16", "--shard-size", "4", "--format", kind,
                "--workers", "1", "--quiet"]
    if where == "url":
        url = request.getfixturevalue("s3")(f"made-{kind}")  # (one server for the module: a bucket each)
        out, ref = url + "/out", url + "/ref"
    else:
        out, ref = str(tmp_path / "out"), str(tmp_path / "ref")
    assert main(_with_out(args, ref)) == 0
    code = _DIE_AFTER_MANIFEST.format(module="text" if kind == "text" else "image_manifest", local=where == "local")
    killed = subprocess.run([sys.executable, "-c", code, *_with_out(args, out)], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert main(_with_out(args, out)) == 0  # complete: its clean-up done now

    def names(at: str) -> set[str]:
        if where == "local":
            return {p.relative_to(at).as_posix() for p in Path(at).rglob("*")}
        from fastdata.storage.object_store import StoreFolder

        return set(StoreFolder(at).listing())

    assert names(out) == names(ref) and not any(journal.PARTIAL_DIR in n for n in names(out))


def test_a_run_killed_while_indexing_tars_resumes_without_listing_them_again(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from test_wds_source import make_tars

    src, out = make_tars(tmp_path / "src", count=40), tmp_path / "out"
    args = ["preprocess", "images", str(src), "--size", "8", "--shard-size", "4", "--workers", "1", "--quiet"]
    assert main([*args, str(tmp_path / "whole")]) == 0
    index = journal.partial_dir(out) / "tar-index"
    proc = subprocess.Popen([sys.executable, "-m", "fastdata", *args, str(out)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and len(list(index.glob("*.summary.json"))) < 3:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(index.glob("*.summary.json"))
    assert 3 <= len(done) < 40 and not (out / "manifest.json").exists()
    # a listed tar's captions changed in place, same size and mtime: a rerun that streamed it again would
    # store the new captions; one that resumes from its index stores the old ones (NOTE [indexed source] rule 4)
    tar0 = src / "00000.tar"
    st = tar0.stat()
    tar0.write_bytes(tar0.read_bytes().replace(b"caption 2", b"caption 8"))
    os.utime(tar0, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main([*args, str(out)]) == 0
    assert tree_bytes(out) == tree_bytes(tmp_path / "whole")


@pytest.mark.parametrize("name", ["fastdata-next", "fastdata-old"])
def test_a_link_planted_beside_out_is_refused_and_what_it_points_to_untouched(photo_folder, tmp_path, capsys, name):
    """NOTE [overwrite] rule 5: a link at the staging (or old) name, to another dataset, planted in a shared
    parent: the overwrite refuses it before any work, and neither dataset changes."""
    out, other = tmp_path / "out", tmp_path / "other"
    args = ["preprocess", "images", str(photo_folder), "--workers", "1", "--quiet", "--size"]
    assert main([*args[:3], str(out), *args[3:], "16"]) == 0
    assert main([*args[:3], str(other), *args[3:], "16"]) == 0
    before, was = tree_bytes(other), tree_bytes(out)
    planted = tmp_path / f".out.{name}"
    planted.symlink_to(other)
    capsys.readouterr()
    assert main([*args[:3], str(out), *args[3:], "24", "--overwrite"]) != 0
    err = capsys.readouterr().err
    assert f"{planted} is a symbolic link" in err and f"remove it (`rm -r {planted}`" in err, err
    assert tree_bytes(other) == before and tree_bytes(out) == was
    assert planted.is_symlink()  # (not ours to remove either)


def test_an_overwrite_builds_in_a_private_folder_and_keeps_outs_mode(photo_folder, tmp_path, monkeypatch):
    """NOTE [overwrite] rule 5: the staging folder is made 0700 (nobody else reads the dataset being built);
    the dataset swapped in gets the mode OUT had."""
    import os
    import stat

    out = tmp_path / "out"
    args = ["preprocess", "images", str(photo_folder), str(out), "--workers", "1", "--quiet", "--size"]
    assert main([*args, "16"]) == 0
    os.chmod(out, 0o750)
    modes, swap = [], journal._swap
    monkeypatch.setattr(journal, "_swap", lambda o, s: modes.append(stat.S_IMODE(s.stat().st_mode)) or swap(o, s))
    assert main([*args, "24", "--overwrite"]) == 0
    assert modes == [0o700] and stat.S_IMODE(out.stat().st_mode) == 0o750


def test_another_users_folder_at_the_staging_name_is_refused(photo_folder, tmp_path, capsys):
    """NOTE [overwrite] rule 5: a folder planted (0777) at the staging name by another user in a shared parent
    would receive the new dataset, readable by them: refused, nothing written into it."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root: the folder of another user is made with os.chown")
    out = tmp_path / "out"
    args = ["preprocess", "images", str(photo_folder), str(out), "--workers", "1", "--quiet", "--size"]
    assert main([*args, "16"]) == 0
    was = tree_bytes(out)
    planted = journal.staging_dir(out)
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    os.chown(planted, 12345, 12345)
    capsys.readouterr()
    assert main([*args, "24", "--overwrite"]) != 0
    err = capsys.readouterr().err
    assert f"{planted} is a folder of user 12345, not of this user (0)" in err and "remove it" in err, err
    assert list(planted.iterdir()) == [] and tree_bytes(out) == was
