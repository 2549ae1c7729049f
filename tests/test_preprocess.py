"""``fastdata preprocess images`` end to end: real files in, shards/LMDB out, through the CLI."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import AWKWARD_BAD, AWKWARD_GOOD, disk_of, journaled_units, kill_when_journaled, started_while_held
from PIL import Image

from fastdata.cli.main import main
from fastdata.imaging import decode_file as decode
from fastdata.preprocess import parallel


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastdata", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_npy_output_values_labels_and_manifest(awkward_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["preprocess", "images", str(awkward_folder), str(out), "--size", "24", "--shard-size", "4",
                 "--workers", "1", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "skipped 3" in err and "truncated.jpg" in err and "Traceback" not in err
    m = json.loads((out / "manifest.json").read_text())
    # shard k holds what decoded of source positions [4k, 4k + 4): the 3 bad files of ñandú (positions
    # 10, 11, 12 in sorted order) shorten shards 2 and 3, which makes the layout format version 3
    assert m["format"] == "fastdata.images.npy" and m["format_version"] == 3
    assert m["num_samples"] == len(AWKWARD_GOOD) and m["sample_shape"] == [24, 24, 3] and m["dtype"] == "|u1"
    assert m["classes"] == ["a_modes", "b_exif", "ñandú"] and m["class_counts"] == [7, 3, 1]
    assert sorted(s["path"] for s in m["skipped"]) == AWKWARD_BAD
    assert [s["samples"] for s in m["shards"]] == [4, 4, 2, 1]
    shards = sorted(out.glob("images-*.npy"))
    assert [p.name for p in shards] == [f"images-0000{k}.npy" for k in range(4)]
    images = np.concatenate([np.load(p, mmap_mode="r") for p in shards])  # plain numpy, no fastdata
    labels = np.concatenate([np.load(p) for p in sorted(out.glob("labels-*.npy"))])
    assert images.shape == (11, 24, 24, 3) and images.dtype == np.uint8 and labels.dtype == np.dtype("<i8")
    assert labels.tolist() == [0] * 7 + [1] * 3 + [2]
    for i, rel in enumerate(AWKWARD_GOOD):  # sample i is the i-th good file, pixels as decode gives them
        assert np.array_equal(images[i], decode.load_array(awkward_folder / rel, 24, "center-crop")), rel
    assert images[1].min() == images[1].max() == 100  # gray.png
    assert not (out / ".fastdata-partial").exists() and not list(out.glob("*.tmp"))


def test_lmdb_output_records_and_labels(awkward_folder, tmp_path):
    out = tmp_path / "lm"
    assert main(["preprocess", "images", str(awkward_folder), str(out), "--format", "lmdb", "--size", "32",
                 "--workers", "1", "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "fastdata.images.lmdb" and m["num_samples"] == len(AWKWARD_GOOD)
    assert np.load(out / "labels.npy").tolist() == [0] * 7 + [1] * 3 + [2]
    assert m["format_version"] == 4 and m["lmdb_shards"] == [{"path": "images-00000.lmdb", "samples": 11}]
    env = lmdb.open(str(out / "images-00000.lmdb"), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        keys = [k for k, _ in txn.cursor()]
        assert keys == [b"%012d" % i for i in range(len(AWKWARD_GOOD))]
        rot6 = Image.open(io.BytesIO(txn.get(keys[AWKWARD_GOOD.index("b_exif/rot6.jpg")])))
    assert rot6.format == "JPEG" and rot6.size == (48, 32)  # upright 60x40 -> shorter side 32, aspect kept
    assert np.abs(np.asarray(rot6, int)[4:12, 4:18].mean(axis=(0, 1)) - (255, 0, 0)).max() < 25  # red top-left


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_output_is_identical_for_1_and_2_workers(photo_folder, tmp_path, fmt, monkeypatch):
    (photo_folder / "class_1" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    outs = []
    for w, method in ((1, "fork"), (2, "fork"), (2, "spawn")):  # spawn: pixels come back pickled
        monkeypatch.setattr(parallel, "_start_method", lambda: method)
        out = tmp_path / f"w{w}-{method}"
        assert main(["preprocess", "images", str(photo_folder), str(out), "--size", "32", "--shard-size", "5",
                     "--format", fmt, "--workers", str(w), "--quiet"]) == 0
        outs.append(tree_bytes(out))
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) >= 3  # lmdb: images-K.lmdb, labels.npy, manifest.json


def test_shuffle_stores_the_samples_in_the_seeds_order_for_any_worker_count(photo_folder, tmp_path, monkeypatch):
    from fastdata.datasets.images import FastDataset

    monkeypatch.setattr(parallel, "_start_method", lambda: "fork")
    plain, outs = tmp_path / "plain", []
    assert main(["preprocess", "images", str(photo_folder), str(plain), "--size", "16", "--shard-size", "5",
                 "--workers", "1", "--quiet"]) == 0
    for w in (1, 2):
        out = tmp_path / f"w{w}"
        assert main(["preprocess", "images", str(photo_folder), str(out), "--size", "16", "--shard-size", "5",
                     "--workers", str(w), "--shuffle", "7", "--quiet"]) == 0
        outs.append(tree_bytes(out))
    assert outs[0] == outs[1]
    a, b = FastDataset(plain, storage="ram"), FastDataset(tmp_path / "w1", storage="ram")
    perm = np.random.default_rng(7).permutation(len(a))  # sample i is the source's perm[i] (Source.shuffled)
    assert np.array_equal(b.targets, a.targets[perm]) and not np.array_equal(b.targets, a.targets)
    assert all(np.array_equal(b[i][0].numpy(), a[int(perm[i])][0].numpy()) for i in range(len(a)))
    assert json.loads((tmp_path / "w1" / "manifest.json").read_text())["params"]["shuffle_seed"] == 7
    first = b.targets[:5]  # a folder is stored class after class; shuffled, a shard holds several classes
    assert len(set(a.targets[:5].tolist())) == 1 and len(set(first.tolist())) > 1
    assert main(["preprocess", "images", str(photo_folder), str(tmp_path / "w1"), "--size", "16", "--shard-size",
                 "5", "--quiet"]) != 0  # another order is other arguments: refused without --overwrite


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_killed_run_resumes_to_identical_output(tmp_path, fmt):
    from fastdata.cli.synthetic import make_image_folder

    src = tmp_path / "src"
    make_image_folder(src, num_classes=2, per_class=60, sizes=((640, 480), (480, 640)))
    args = [str(src), "--size", "48", "--shard-size", "8", "--format", fmt, "--workers", "1", "--quiet"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main(["preprocess", "images", args[0], str(ref), *args[1:]]) == 0
    command = [sys.executable, "-m", "fastdata", "preprocess", "images", args[0], str(out), *args[1:]]
    kill_when_journaled(command, out, 3)
    journaled = journaled_units(out)
    kept = {f["path"]: (out / f["path"]).stat().st_ino for u in journaled for f in u["files"]
            if not (fmt == "lmdb" and f["path"].startswith("labels-"))}  # (gone once labels.npy is written)
    assert len(journaled) >= 3
    assert main(["preprocess", "images", args[0], str(out), *args[1:]]) == 0
    assert tree_bytes(out) == tree_bytes(ref)
    # the units the journal recorded were kept, not rewritten (LMDB shards too, since they are final files)
    assert all((out / name).stat().st_ino == ino for name, ino in kept.items())


def test_rerun_same_args_is_noop_other_args_refused_unless_overwrite(photo_folder, tmp_path):
    out = tmp_path / "out"

    def args(*extra: str) -> list[str]:
        return ["preprocess", "images", str(photo_folder), str(out), "--quiet", *extra]

    assert main(args("--size", "16")) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(args("--size", "16")) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    r = run_cli(*args("--size", "20"))
    assert r.returncode == 1 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    assert np.load(out / "images-00000.npy", mmap_mode="r").shape[1:] == (16, 16, 3)  # refused: untouched
    assert main(args("--size", "20", "--overwrite")) == 0
    assert np.load(out / "images-00000.npy", mmap_mode="r").shape[1:] == (20, 20, 3)


def test_a_second_run_on_the_same_output_waits_for_the_first(photo_folder, tmp_path):
    """NOTE [one writer]: while OUT is held, another preprocess into it says so and waits, writing nothing."""
    from fastdata.preprocess import journal

    out, ref = tmp_path / "out", tmp_path / "ref"
    args = [str(photo_folder), "--size", "16", "--quiet"]
    assert main(["preprocess", "images", args[0], str(ref), *args[1:]]) == 0
    with journal.exclusive(out):
        (proc,), _ = started_while_held(out, [["preprocess", "images", args[0], str(out), *args[1:]]])
        time.sleep(0.5)
        assert proc.poll() is None and list(out.iterdir()) == []  # waiting, nothing written
    assert proc.wait(timeout=120) == 0
    assert tree_bytes(out) == tree_bytes(ref)


def test_a_forked_child_does_not_keep_the_output_held(tmp_path):
    """NOTE [one writer]: a process forked while OUT is held (a worker) does not hold it once the run ends."""
    from fastdata.preprocess import journal

    out = tmp_path / "out"
    with journal.exclusive(out):
        child = os.fork()
        if child == 0:  # lives on past the run, as an orphaned worker would
            time.sleep(30)
            os._exit(0)
    try:
        t0 = time.monotonic()
        probe = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                                "from fastdata.preprocess import journal\nwith journal.exclusive(Path(sys.argv[1])): "
                                "print('held')", str(out)], capture_output=True, text=True, timeout=20)
        assert probe.stdout == "held\n" and "waiting" not in probe.stderr and time.monotonic() - t0 < 20
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


@pytest.mark.slow
def test_a_killed_run_takes_its_workers_and_its_hold_on_the_output_with_it(tmp_path):
    """kill -9 of a run ends its worker processes (which used to wait on their queue forever) and frees OUT
    for the rerun (NOTE [one writer])."""
    from fastdata.cli.synthetic import make_image_folder

    src, out = tmp_path / "src", tmp_path / "out"
    make_image_folder(src, num_classes=2, per_class=60, sizes=((640, 480),))
    command = [sys.executable, "-m", "fastdata", "preprocess", "images", str(src), str(out), "--size", "32",
               "--shard-size", "8", "--workers", "2", "--quiet"]
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not journaled_units(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                  text=True).stdout.split()]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        assert len(workers) == 2
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in workers)  # gone with their run
        r = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "waiting" not in r.stderr, r.stderr
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert main(["verify", str(out), "--quiet"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["images", "text"])
def test_runs_started_together_on_one_output_give_one_intact_dataset(tmp_path, kind):
    """Every rank of a torchrun job calling the preprocess: one writes, the others wait and find it done."""
    from fastdata.cli.synthetic import make_image_folder
    from fastdata.preprocess import journal

    src = tmp_path / "src"
    if kind == "images":
        make_image_folder(src, num_classes=2, per_class=60, sizes=((640, 480), (480, 640)))
        args = ["preprocess", "images", str(src), "--size", "48", "--shard-size", "8", "--workers", "2", "--quiet"]
    else:
        src.mkdir()
        rng = random.Random(0)
        for i in range(40):
            (src / f"{i}.txt").write_text(" ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(20_000)))
        args = ["preprocess", "text", str(src), "--tokenizer", "bytes", "--shard-tokens", "50000", "--quiet"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main([*args[:3], str(ref), *args[3:]]) == 0
    # started while the test holds OUT, so all three are waiting when it is released and race for it
    with journal.exclusive(out):
        procs, lines = started_while_held(out, [[*args[:3], str(out), *args[3:]]] * 3)
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0], lines
    assert tree_bytes(out) == tree_bytes(ref)
    assert main(["verify", str(out), "--quiet"]) == 0


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_images_without_labels_make_a_dataset_that_opens(tmp_path, fmt):
    """Records and Parquet rows of images alone (no label, no other field) were written as an (image, class)
    dataset without labels: preprocess said OK and the dataset could not be opened (ValueError, KeyError)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    colours = [(200, 10, 10), (10, 200, 10), (10, 10, 200)]
    blobs = []
    for k, c in enumerate(colours):
        Image.new("RGB", (16, 16), c).save(tmp_path / f"{k}.png")
        blobs.append((tmp_path / f"{k}.png").read_bytes())
    (tmp_path / "r.jsonl").write_text("".join(json.dumps({"image": f"{k}.png"}) + "\n" for k in range(3)))
    pq.write_table(pa.table({"image": pa.array(blobs, pa.binary())}), tmp_path / "p.parquet")
    from fastdata.datasets.images import FastDataset

    for name in ("r.jsonl", "p.parquet"):
        out = tmp_path / f"out-{name}"
        assert main(["preprocess", "images", str(tmp_path / name), str(out), "--size", "8", "--format", fmt,
                     "--workers", "1", "--quiet"]) == 0
        batch = FastDataset(out).get_batch(np.arange(3))
        assert list(batch) == ["image"] and batch["image"].shape == (3, 8, 8, 3)
        got = batch["image"].float().mean(dim=(1, 2)).numpy()
        assert np.abs(got - np.array(colours, dtype=np.float32)).max() < 8, got  # (JPEG in LMDB: near)


def test_on_error_fail_names_the_file_without_traceback_and_skip_takes_the_run_over(awkward_folder, tmp_path):
    """The error says to rerun with --on-error skip; that rerun was refused as a run with other arguments
    (only --overwrite went on, making the finished shards again): it takes them over."""
    args = ["--workers", "1", "--shard-size", "4", "--quiet"]
    r = run_cli("preprocess", "images", awkward_folder, tmp_path / "o", "--on-error", "fail", *args)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fastdata: error:")]
    assert len(lines) == 1 and "empty.png" in lines[0] and "rerun with --on-error skip" in lines[0]
    assert not (tmp_path / "o" / "manifest.json").exists()
    from fastdata.preprocess import journal

    done = [f["path"] for u in journal.load(journal.partial_dir(tmp_path / "o")).units for f in u["files"]]
    assert done  # (the shards before the class holding the empty file)
    stamps = {name: (tmp_path / "o" / name).stat().st_ino for name in done}
    assert main(["preprocess", "images", str(awkward_folder), str(tmp_path / "o"), *args]) == 0
    assert {name: (tmp_path / "o" / name).stat().st_ino for name in done} == stamps  # kept, not made again
    assert main(["preprocess", "images", str(awkward_folder), str(tmp_path / "ref"), *args]) == 0
    assert tree_bytes(tmp_path / "o") == tree_bytes(tmp_path / "ref")


@pytest.mark.parametrize("disk", ["slow", "fast", "full"])
def test_a_failed_run_keeps_the_shards_its_commit_thread_was_writing(tmp_path, monkeypatch, disk):
    """A unit handed to the commit thread before a file failed to decode was written, then dropped from the
    journal (made again by the rerun, though the error says the shards made so far are kept): on a busy
    machine every unit ("slow": a commit that takes a while). So was a unit whose commit had ended just
    before the failing chunk ("fast"), and the units committed before a commit that failed ("full")."""
    import errno
    import time

    from fastdata.errors import DiskFullError
    from fastdata.formats import base
    from fastdata.preprocess import journal

    committed, append, calls = base._committed, base.UnitWriter.append, []

    def slow(commit, then):
        calls.append(1)
        time.sleep(0.3)
        if disk == "full" and len(calls) == 3:
            raise DiskFullError(f"{errno.ENOSPC}: no space left on the device")
        return committed(commit, then)

    def settled_first(self, *a, **kw):  # (every commit under way ends before the next chunk is written)
        for _, future in self._pending:
            future.exception()
        return append(self, *a, **kw)

    src = tmp_path / "src"  # two units of good images, then one led by a file that does not decode
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
    for i in range(8):
        Image.fromarray(np.full((20, 20, 3), i * 20, np.uint8)).save(src / "a" / f"{i}.png")
    (src / "b" / "0bad.jpg").write_bytes(b"not a jpeg")
    for i in range(1, 4):
        Image.fromarray(np.full((20, 20, 3), i, np.uint8)).save(src / "b" / f"{i}.png")
    monkeypatch.setattr(base, "_committed", slow)
    if disk == "fast":
        monkeypatch.setattr(base.UnitWriter, "append", settled_first)
    args = [str(src), str(tmp_path / "o"), "--workers", "1", "--shard-size", "4", "--size", "8", "--quiet"]
    assert main(["preprocess", "images", *args, *(["--on-error", "fail"] if disk != "full" else [])]) == 1
    done = journal.load(journal.partial_dir(tmp_path / "o")).units
    assert [u["index"] for u in done] == [0, 1] and [u["source_end"] for u in done] == [4, 8]
    assert all((tmp_path / "o" / f["path"]).is_file() for u in done for f in u["files"])
    calls.clear()
    monkeypatch.setattr(base, "_committed", committed)
    assert main(["preprocess", "images", *args]) == 0  # (the unit holding the bad files: made by the rerun)
    assert main(["preprocess", "images", str(src), str(tmp_path / "ref"), *args[2:]]) == 0
    assert tree_bytes(tmp_path / "o") == tree_bytes(tmp_path / "ref")


def test_a_ctrl_c_while_the_last_units_are_committed_keeps_them(tmp_path, monkeypatch):
    """A Ctrl-C while finish() waited for the commit thread marked the unit under way as a failed commit, so
    it was dropped from the journal (and made again by the rerun) although its commit completed."""
    import _thread
    import threading
    import time

    from fastdata.formats import base
    from fastdata.preprocess import journal

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(8):
        Image.fromarray(np.full((20, 20, 3), i * 20, np.uint8)).save(src / f"{i}.png")
    committed, finish, finishing, calls = base._committed, base.UnitWriter.finish, threading.Event(), []

    def interrupted(commit, then):  # (the last unit's commit: Ctrl-C while the run waits for it)
        calls.append(1)
        if len(calls) == 2 and finishing.wait(10):
            _thread.interrupt_main()
            time.sleep(0.3)
        return committed(commit, then)

    def marked_finish(self, *a, **kw):
        finishing.set()
        return finish(self, *a, **kw)

    monkeypatch.setattr(base, "_committed", interrupted)
    monkeypatch.setattr(base.UnitWriter, "finish", marked_finish)
    args = [str(tmp_path / "src"), str(tmp_path / "o"), "--workers", "1", "--shard-size", "4", "--size", "8", "--quiet"]
    assert main(["preprocess", "images", *args]) == 130
    assert [u["source_end"] for u in journal.load(journal.partial_dir(tmp_path / "o")).units] == [4, 8]


def _file(p: Path) -> Path:
    p.write_text("x")
    return p


def _dir(p: Path) -> Path:
    p.mkdir()
    return p


BAD_ARGS = {  # name: (source, output, what the one-line error says)
    "missing source": (lambda t, ok: t / "missing", lambda t: t / "o", "does not exist"),
    "empty source": (lambda t, ok: _dir(t / "e"), lambda t: t / "o", "no class sub-folders"),
    "output is a file": (lambda t, ok: ok, lambda t: _file(t / "f"), "not a folder"),
    "output under a file": (lambda t, ok: ok, lambda t: _file(t / "f") / "sub", "cannot create output folder"),
    "output holds other files": (lambda t, ok: ok, lambda t: _file(_dir(t / "busy") / "mine.txt").parent, "not empty"),
    # a rerun read the output as a class folder, and refused the same arguments as "another source"
    "output inside the source": (lambda t, ok: ok, lambda t: t / "photos" / "ds", "inside the source folder"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_arguments_give_one_line_errors(photo_folder, tmp_path, case):
    make_src, make_out, needle = BAD_ARGS[case]
    out = make_out(tmp_path)
    r = run_cli("preprocess", "images", make_src(tmp_path, photo_folder), out, "--quiet")
    assert r.returncode == 1 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    if case == "output holds other files":
        assert [p.name for p in out.iterdir()] == ["mine.txt"]  # nothing of the user's touched, nothing added
    if case == "output inside the source":
        assert not out.exists()


def test_bad_csv_row_is_one_line_error(tmp_path):
    (tmp_path / "l.csv").write_text("a.jpg,1\n../../x.jpg,2\n")
    r = run_cli("preprocess", "images", tmp_path / "l.csv", tmp_path / "o")
    assert r.returncode == 1 and "l.csv:2" in r.stderr and "Traceback" not in r.stderr


def test_quiet_prints_the_summary_only_when_files_were_skipped(photo_folder, tmp_path, capsys):
    args = [str(photo_folder), "--size", "16", "--workers", "1"]
    assert main(["preprocess", "images", args[0], str(tmp_path / "q"), *args[1:], "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # (the skipped case: test_npy_output_values_labels_and_manifest)
    assert main(["preprocess", "images", args[0], str(tmp_path / "v"), *args[1:]]) == 0
    assert "42 samples in 3 classes" in capsys.readouterr().err


@pytest.mark.parametrize("resize", ["squash", "pad"])
def test_lmdb_without_fields_refuses_a_resize_it_would_ignore(photo_folder, tmp_path, capsys, resize):
    """LMDB records of plain images keep their aspect: --resize squash|pad wrote the default's bytes without a
    word, and a rerun with another --resize was "already complete"."""
    out = tmp_path / "out"
    assert main(["preprocess", "images", str(photo_folder), str(out), "--format", "lmdb", "--resize", resize,
                 "--size", "16", "--workers", "1", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"--resize {resize} makes S x S samples, and {photo_folder} has no fields" in err and "Traceback" not in err
    assert not out.exists() or not (out / "manifest.json").exists()


def test_invalid_option_values(photo_folder, tmp_path, capsys):
    assert main(["preprocess", "images", str(photo_folder), str(tmp_path / "o"), "--shard-size", "0"]) == 1
    assert "shard_size=0" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_full_disk_is_a_clear_error_and_the_rerun_resumes(photo_folder, tmp_path, fmt):
    """LMDB reports a write that came up short as an I/O error: it too says the disk is full, and what to do."""
    out, ref = tmp_path / "out", tmp_path / "ref"

    def args(dest: Path) -> list[str]:
        return ["preprocess", "images", str(photo_folder), str(dest), "--size", "32", "--shard-size", "8",
                "--workers", "1", "--quiet", "--format", fmt]

    small_disk = disk_of(20_000)  # no file may grow past 20 kB; a shard is 8 x 32 x 32 x 3 = 24.6 kB
    r = subprocess.run([sys.executable, "-m", "fastdata", *args(out)], capture_output=True, text=True,
                       preexec_fn=small_disk, timeout=300)
    assert r.returncode == 1 and "no space left" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "rerun the same command" in r.stderr, r.stderr
    assert not (out / "manifest.json").exists() and not list(out.glob("images-*"))  # nothing looks finished
    assert main(args(out)) == 0 and main(args(ref)) == 0
    assert tree_bytes(out) == tree_bytes(ref)


def test_an_lmdb_write_error_is_judged_by_the_room_left(tmp_path, monkeypatch):
    """LMDB gives no errno: its OS words ("No space left"), or EIO for a write that came up short. The test
    above covers the file size limit; a full disk (free space under the store's map) and a real I/O error
    are told apart by the room left."""
    import errno
    import shutil
    from collections import namedtuple

    from fastdata.formats import lmdb_store

    usage = namedtuple("usage", "total used free")
    short = Exception("mdb_txn_commit: Input/output error")
    for free, want in ((1 << 10, errno.ENOSPC), (1 << 40, errno.EIO)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(1 << 41, 0, free))
        assert lmdb_store._write_errno(short, tmp_path / "x.lmdb.tmp", 1 << 20) == want
    assert lmdb_store._write_errno(Exception("No space left on device"), tmp_path / "x", 1) == errno.ENOSPC


def _fill_slot(task: tuple[int, float], k: int | None) -> bytes | None:
    """A task that writes its index into its shared slot (or returns it where there is none)."""
    i, delay = task
    time.sleep(delay)
    view = parallel.slot(k)
    if view is None:
        return bytes([i % 256]) * 64
    view[:] = bytes([i % 256]) * len(view)
    return None


@pytest.mark.parametrize("workers,method", [(1, "fork"), (2, "fork"), (3, "fork"), (2, "spawn")])
def test_ordered_map_slots_hold_each_result_until_the_next_is_asked_for(workers, method, monkeypatch):
    monkeypatch.setattr(parallel, "_start_method", lambda: method)  # spawn (macOS, Windows): no shared slots
    rng = random.Random(workers)
    tasks = [(i, rng.random() * 0.004) for i in range(80)]
    seen, shared = [], []
    for result, view in parallel.ordered_map(_fill_slot, tasks, workers, slot_bytes=64):
        time.sleep(0.002)  # a slow consumer: the workers run ahead into the other slots meanwhile
        seen.append(result if view is None else bytes(view))
        shared.append(view is not None)
        assert result is None or view is None
    assert seen == [bytes([i]) * 64 for i in range(80)]
    assert all(shared) if method == "fork" else not any(shared)


def test_hashing_writer_digest_matches_the_file_for_large_and_small_writes(tmp_path):
    import hashlib

    from fastdata._io import HashingWriter

    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (3 << 20, 100, 1 << 20, 5, 2 << 20)]
    w = HashingWriter(tmp_path / "f.bin")
    for part in parts:
        w.write(part)
        part[:] = 0  # the caller may reuse its buffer as soon as write() returns
    entry = w.commit()
    data = (tmp_path / "f.bin").read_bytes()
    assert entry["bytes"] == len(data) == sum(len(p) for p in parts) and not (tmp_path / "f.bin.tmp").exists()
    assert entry["sha256"] == hashlib.sha256(data).hexdigest() and data[:8] != bytes(8)
    aborted = HashingWriter(tmp_path / "g.bin")
    aborted.write(parts[0])
    aborted.abort()
    assert not list(tmp_path.glob("g.bin*"))



@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, 4 << 20, (4 << 20) + 1, (9 << 20) + 3])
def test_hash_file_matches_hashlib_at_block_boundaries(tmp_path, size):
    import hashlib

    from fastdata._io import hash_file

    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f.bin").write_bytes(data)
    blocks: list[int] = []
    assert hash_file(tmp_path / "f.bin", blocks.append) == hashlib.sha256(data).hexdigest()
    assert sum(blocks) == size and all(b > 0 for b in blocks)

def _die_at_three(i: int, k: int | None) -> int:
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    return i


def test_a_killed_worker_is_a_clear_error_not_a_hang():
    from fastdata.errors import FastdataError

    got = []
    with pytest.raises(FastdataError, match="worker died .* rerun the same command"):
        for result, _ in parallel.ordered_map(_die_at_three, range(10), 2, slot_bytes=64):
            got.append(result)
    assert got == list(range(len(got))) and len(got) <= 3  # results before the death, in order


class _Finalised:
    """A parent's object in a reference cycle whose finaliser notes which process ran it (NOTE [fork and
    finalisers]): a thread pool's destructor would join threads only the parent has."""

    def __init__(self, path: Path) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect_in_worker(i: int) -> int:
    import gc

    gc.collect()  # as any allocation in a worker thread may start a collection
    return i


def test_forked_workers_never_finalise_the_parents_garbage(tmp_path):
    import gc

    log = tmp_path / "finalised"
    gc.disable()  # no automatic collection here: the cycle is still there when the workers are forked
    try:
        _Finalised(log)  # unreachable at once, but kept by its cycle until a collection
        assert list(parallel.ordered_map(_collect_in_worker, range(8), 2)) == list(range(8))
    finally:
        gc.enable()
    gc.collect()
    assert log.read_text().split() == [str(os.getpid())]  # finalised here, before the fork, once


def _slow_unit_writer(fail_at: int = -1):
    """A UnitWriter of 2-sample units whose commits take a while; unit ``fail_at``'s fails like a full disk."""
    from fastdata.formats.base import UnitWriter

    class Writer(UnitWriter):
        aborted = False

        def _open_unit(self) -> None:
            pass

        def _write(self, samples) -> None:
            pass

        def _seal(self, labels):
            index = self.index

            def commit():
                time.sleep(0.02)
                if index == fail_at:
                    raise OSError(28, "No space left on device")
                return [{"path": f"unit-{index}", "labels": labels.tolist()}]
            return commit

        def _abort_unit(self) -> None:
            self.aborted = True
    return Writer(2)


def test_units_are_flushed_in_the_background_and_come_back_in_order():
    w = _slow_unit_writer()
    first = w.append(list(range(7)), np.arange(7), np.arange(7))  # closes units 0..2, flushed meanwhile
    rest = w.finish()  # closes unit 3 (one sample) and waits for all
    records = first + rest
    assert [r["index"] for r in records] == [0, 1, 2, 3] and [r["source_end"] for r in records] == [2, 4, 6, 7]
    assert [f["labels"] for r in records for f in r["files"]] == [[0, 1], [2, 3], [4, 5], [6]]
    failing = _slow_unit_writer(fail_at=1)
    with pytest.raises(OSError, match="No space"):
        failing.append(list(range(6)), np.arange(6), np.arange(6))
        failing.finish()
    failing.abort()  # waits for what is under way, removes the unit in progress
    assert failing.aborted


def test_lmdb_max_side_keeps_the_aspect_with_the_longer_side_at_most_s_and_decodes(tmp_path):
    """``--resize max-side``: FFCV's max_resolution. Upright sizes (EXIF turned), never upscaled."""
    from conftest import quadrants, save_with_orientation

    from fastdata.datasets.images import FastDataset
    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.formats.manifest import load_manifest

    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    Image.fromarray(quadrants(640, 480)).save(src / "1_wide.jpg", quality=95)
    save_with_orientation(src / "2_turned.jpg", quadrants(300, 500), 6)  # stored 500x300, upright 300x500
    Image.fromarray(quadrants(50, 30)).save(src / "3_small.png")
    Image.fromarray(quadrants(100, 64)).save(src / "4_exact.png")
    out = tmp_path / "out"
    assert main(["preprocess", "images", str(tmp_path / "src"), str(out), "--format", "lmdb", "--resize", "max-side",
                 "--size", "64", "--quality", "95", "--quiet"]) == 0
    manifest = load_manifest(out)
    assert manifest["max_side"] == 64 and manifest["params"]["resize"] == "max-side"
    records = open_lmdb(out, manifest).get_many(range(4))
    stored = [Image.open(io.BytesIO(r)) for r in records]
    assert [im.size for im in stored] == [(64, 48), (38, 64), (50, 30), (64, 41)]
    top_left = [np.asarray(im.convert("RGB"))[2, 2].astype(int) for im in stored]
    assert all(np.abs(px - (255, 0, 0)).max() < 40 for px in top_left)  # upright: red stays top-left
    ds = FastDataset(out, size=32, crop="random")
    x, y = ds.get_batch(np.arange(4), draw=(0, 0, 0, 0))
    assert tuple(x.shape) == (4, 32, 32, 3) and y.tolist() == [0, 0, 0, 0]
    centre = FastDataset(out, size=32)[0][0].numpy()
    assert np.abs(centre[1, 1].astype(int) - (255, 0, 0)).max() < 40  # centre crop of the wide record
    r = run_cli("preprocess", "images", tmp_path / "src", tmp_path / "npy", "--resize", "max-side", "--quiet")
    assert r.returncode == 1 and "--format lmdb" in r.stderr and "Traceback" not in r.stderr


def test_the_journal_appends_a_line_per_unit_and_a_torn_last_line_is_dropped(tmp_path):
    """Recording a unit appends one line (the file is never rewritten, so the millionth unit costs what the
    first did); a line torn by a crash is ignored and a resume compacts the file."""
    from fastdata.preprocess import journal

    out = tmp_path / "out"
    out.mkdir()
    jr, partial = journal.resume(out, "fp")
    path = partial / journal.JOURNAL_NAME
    inode = path.stat().st_ino
    skipped = []
    for k in range(1000):
        skipped.append({"index": 10 * k + 3, "path": f"{k}.jpg", "reason": "bad"})
        before = path.stat().st_size
        jr.add({"index": k, "source_end": 10 * (k + 1), "samples": 9, "files": []}, skipped, partial)
        line = path.read_bytes()[before:]
        assert line.endswith(b"\n") and line.count(b"\n") == 1 and len(line) < 200
    assert path.stat().st_ino == inode
    with open(path, "ab") as f:
        f.write(b'{"unit": {"index": 1000, "sour')  # a crash in the middle of the next line
    again = journal.load(partial)
    assert again.fingerprint == "fp" and again.units == jr.units and again.skipped == skipped
    assert again.source_end == 10000 and again.num_samples == 9000
    jr2, _ = journal.resume(out, "fp")
    assert jr2.units == jr.units and path.read_bytes().count(b"\n") == 1001
    assert journal.resume(out, "another")[0].units == []  # other arguments start afresh


def test_a_resume_writes_the_journal_in_one_pass_over_the_skipped_files(tmp_path):
    """Each resume writes the journal afresh: every unit scanned the whole skipped list, 10^6 units x 10^6
    skipped files (LAION with 0.1 % undecodable) hours of a resume. One pass, each unit's files a slice."""
    from fastdata.preprocess import journal

    class Counted(list):
        passes = 0

        def __iter__(self):
            type(self).passes += 1
            return super().__iter__()

    units = [{"index": k, "source_end": 10 * (k + 1), "samples": 9, "files": []} for k in range(3000)]
    skipped = Counted({"index": i, "path": f"{i}.jpg", "reason": "bad"} for i in range(3, 30000, 7))
    jr = journal.Journal("fp", units, skipped)
    Counted.passes = 0
    jr.save(tmp_path)
    assert Counted.passes <= 2  # (one sort, one list of the indices)
    again = journal.load(tmp_path)
    assert again.units == units and again.skipped == list(skipped)
    lines = [json.loads(ln) for ln in (tmp_path / journal.JOURNAL_NAME).read_text().splitlines()[1:]]
    assert all(10 * k <= s["index"] < 10 * (k + 1) for k, ln in enumerate(lines) for s in ln["skipped"])


def test_a_resume_reads_only_the_newest_units_files_and_checks_every_size(tmp_path, monkeypatch):
    """A resume of a run that wrote terabytes must not hash them all first: sizes for every unit, sha256 for
    the newest two; a unit of the wrong size or (among the newest) the wrong bytes is redone with all after it."""
    from fastdata._io import write_bytes_atomic
    from fastdata.formats import integrity
    from fastdata.preprocess import journal

    out = tmp_path / "out"
    out.mkdir()

    def run_of(n: int) -> journal.Journal:
        jr, partial = journal.resume(out, "fp")
        for k in range(len(jr.units), n):
            f = write_bytes_atomic(out / f"images-{k:05d}.npy", bytes([k]) * 1000)
            jr.add({"index": k, "source_end": k + 1, "samples": 1, "files": [f]}, [], partial)
        return jr
    run_of(10)
    hashed = []
    real = integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda path, *a: hashed.append(Path(path).name) or real(path, *a))
    assert len(journal.resume(out, "fp")[0].units) == 10
    assert sorted(hashed) == ["images-00008.npy", "images-00009.npy"]  # only the newest two read
    flip = bytearray((out / "images-00009.npy").read_bytes())
    flip[500] ^= 1
    (out / "images-00009.npy").write_bytes(bytes(flip))  # the newest unit's bytes changed, not its size
    assert len(journal.resume(out, "fp")[0].units) == 9
    run_of(10)
    (out / "images-00004.npy").write_bytes(b"short")  # an older unit's size changed: it and all after are redone
    assert len(journal.resume(out, "fp")[0].units) == 4
    run_of(10)
    (out / "images-00002.npy").write_bytes(bytes([7]) * 1000)  # an older unit, same size: kept (its sha256 stays
    assert len(journal.resume(out, "fp")[0].units) == 10      # the journal's, so `fastdata verify` finds it)


@pytest.mark.parametrize("fmt", ["npy", "lmdb"])
def test_a_shard_whose_samples_all_failed_is_empty_and_the_dataset_reads_whole(tmp_path, fmt):
    """Shard k holds what decoded of source positions [k*S, (k+1)*S): two bad files filling shard 2 leave it
    empty; every sample is still served exactly once, by index, in order and through windowed shuffles."""
    from fastdata import FastDataset, FastLoader

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    for i in range(4):
        Image.new("RGB", (20, 20), (40 * i + 10, 0, 0)).save(src / "a" / f"{i}.png")
    (src / "a" / "4.png").write_bytes(b"bad")
    (src / "a" / "5.png").write_bytes(b"bad")
    for i in range(3):
        Image.new("RGB", (20, 20), (0, 40 * i + 10, 0)).save(src / "b" / f"{i}.png")
    out = tmp_path / "out"
    assert main(["preprocess", "images", str(src), str(out), "--size", "8", "--shard-size", "2", "--format", fmt,
                 "--quiet"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert [s["samples"] for s in m[("shards" if fmt == "npy" else "lmdb_shards")]] == [2, 2, 0, 2, 1]
    assert m["format_version"] == (3 if fmt == "npy" else 4) and main(["verify", str(out), "--quiet"]) == 0
    ds = FastDataset(out)
    x, y = ds.get_batch(np.arange(7))
    assert y.tolist() == [0] * 4 + [1] * 3 and ds.shard_bounds().tolist() == [0, 2, 4, 4, 6, 7]

    def ids(xb) -> list[int]:  # each sample's own colour: a/i is 10 + 40i red, b/i as much green
        px = xb[:, 4, 4, :2].int()
        return [int(round((r - 10) / 40)) if r > g else 4 + int(round((g - 10) / 40)) for r, g in px.tolist()]
    assert ids(x) == list(range(7))
    for window in (None, 2):
        served = [i for xb, _ in FastLoader(ds, batch_size=2, shuffle=True, shuffle_window=window, seed=3)
                  for i in ids(xb)]
        assert sorted(served) == list(range(7))  # exactly once
