"""``fastdata preprocess ... --ray``: a real 2-node Ray cluster on 127.0.0.1 writes the local run's bytes.

One cluster per module (two nodes of one CPU each: the machine is small and shared); every node and every
driver runs with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` so that all of them use 127.0.0.1 only.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import journaled_units, kill_when_journaled
from PIL import Image

from fastdata.cli.main import main
from fastdata.formats import image_shards
from fastdata.preprocess import ray_pool
from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

pytestmark = pytest.mark.ray
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # every node and driver on 127.0.0.1 (Linux)


@pytest.fixture(scope="module")
def cluster(s3) -> Iterator[str]:
    """A head and one more node, one CPU each; this process connected as a driver. Yields the address.
    Started after the loopback S3 server, so that every Ray worker has its endpoint in its environment."""
    with pytest.MonkeyPatch.context() as mp:  # the setting is this module's only
        for key, value in LOOPBACK.items():
            mp.setenv(key, value)  # before Ray is imported: it reads the setting once, at import
        ray = pytest.importorskip("ray", reason="needs Ray: pip install 'fastdata[ray]'")
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # where an earlier test imported Ray already
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            c.add_node(num_cpus=1)
            c.wait_for_nodes()
            assert c.address.startswith("127.0.0.1:"), c.address
            ray.init(address=c.address, logging_level="ERROR")
            yield c.address
        finally:
            ray.shutdown()
            c.shutdown()


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def jpeg_bytes(seed: int, w: int = 48, h: int = 40) -> bytes:
    import io

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def image_folder(root: Path, n: int = 22, bad: int = 7) -> Path:
    """``n`` small JPEGs in two classes, sample ``bad`` (in source order) not an image."""
    for i in range(n):
        d = root / ("cat" if i < n // 2 else "dog")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(b"not a jpeg" if i == bad else jpeg_bytes(i, 48 + i, 40 + 2 * i))
    return root


def run(src: Path, out: Path, engine: str, address: str | None = None, **kw) -> dict:
    return preprocess_images(ImagePreprocessConfig(src=src, out=out, size=16, shard_size=4, workers=1,
                                                   progress=False, engine=engine, ray_address=address, **kw))


@pytest.mark.parametrize("fmt, shuffle", [("npy", None), ("lmdb", None), ("npy", 5)])
def test_an_image_folder_with_a_bad_image_gives_the_local_bytes(cluster, tmp_path, fmt, shuffle):
    src = image_folder(tmp_path / "src")
    run(src, tmp_path / "local", "local", format=fmt, shuffle_seed=shuffle)
    m = run(src, tmp_path / "ray", "ray", cluster, format=fmt, shuffle_seed=shuffle)
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
    assert m["num_samples"] == 21 and [s["path"] for s in m["skipped"]] == ["cat/007.jpg"]


def test_records_with_fields_give_the_local_bytes_in_lmdb(cluster, tmp_path):
    from test_fields import make_scenes

    records = make_scenes(tmp_path, 9, sizes=((64, 64), (90, 70)), jpeg_big=False)
    records[4]["mask"] = "masks/none.png"  # a bad record: skipped, shifting the shards after it
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run(tmp_path / "r.jsonl", tmp_path / "local", "local", format="lmdb")
    m = run(tmp_path / "r.jsonl", tmp_path / "ray", "ray", cluster, format="lmdb")
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
    assert m["num_samples"] == 8 and len(m["fields"]) > 3 and [s["path"] for s in m["skipped"]] == [records[4]["image"]]


def test_parquet_files_give_the_local_bytes_with_a_bad_row_listed(cluster, tmp_path):
    pytest.importorskip("pyarrow")
    from test_parquet_source import write_parts

    src = write_parts(tmp_path / "src", [5, 7], empty=(6,))  # row 1 of the second file: no image bytes
    run(src, tmp_path / "local", "local", format="lmdb")
    m = run(src, tmp_path / "ray", "ray", cluster, format="lmdb")
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
    assert m["num_samples"] == 11 and [s["path"] for s in m["skipped"]] == ["part-01.parquet#1"]
    assert m["classes"] == ["cat", "dog", "eel"] and [f["name"] for f in m["fields"]][:3] == ["image", "label", "score"]


def test_text_with_a_bpe_tokenizer_gives_the_local_bytes(cluster, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from test_text import make_docs, write_jsonl
    from tokenizers import models, pre_tokenizers, trainers

    docs = make_docs(80, seed=2)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "d.jsonl", docs[:40] + ["", ""] + docs[40:])  # two empty documents
    args = ["preprocess", "text", str(src), "--tokenizer", str(tmp_path / "tokenizer.json"), "--shard-tokens",
            "700", "--val-fraction", "0.2", "--quiet", "--workers", "1"]
    assert main([*args[:3], str(tmp_path / "local"), *args[3:]]) == 0
    assert main([*args[:3], str(tmp_path / "ray"), *args[3:], "--ray", cluster]) == 0
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
    m = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert m["skipped_count"] == 2 and len(m["splits"]["train"]["shards"]) > 3


class FifoFeeder:
    """Serves ``data`` to every reader of the FIFO ``path`` while running (one reader at a time)."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data, self.stop = path, data, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:  # opens only once a reader waits (ENXIO before): the loop can stop
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                assert exc.errno == errno.ENXIO
                time.sleep(0.005)
                continue
            os.set_blocking(fd, True)
            try:
                os.write(fd, self.data)
            except BrokenPipeError:  # the reader was killed
                pass
            os.close(fd)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def fifo_folder(root: Path, n: int, *at: int) -> tuple[Path, list[tuple[Path, bytes]]]:
    """An image folder whose samples ``at`` are FIFOs: a task reading one waits until the test writes it.
    Returns the folder and each FIFO with the JPEG bytes it stands for."""
    image_folder(root, n, bad=-1)
    files = sorted(root.rglob("*.jpg"))
    fifos = [(files[i], files[i].read_bytes()) for i in at]
    for path, _ in fifos:
        path.unlink()
        os.mkfifo(path)
    return root, fifos


def feeding(fifos: list[tuple[Path, bytes]]) -> contextlib.ExitStack:
    """Every FIFO served while the block runs."""
    stack = contextlib.ExitStack()
    for path, data in fifos:
        stack.callback(FifoFeeder(path, data).close)
    return stack


def reader_of(fifo: Path, timeout: float = 60) -> int:
    """The pid (not ours) holding ``fifo`` open: a Ray worker in the middle of a task."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(fifo) for fd in fds):
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no process opened {fifo}")


def test_a_worker_killed_mid_task_is_retried_to_the_same_bytes(cluster, tmp_path):
    src, fifos = fifo_folder(tmp_path / "src", 16, 9)
    fifo = fifos[0][0]
    with feeding(fifos):
        run(src, tmp_path / "local", "local")
    result: dict = {}
    driver = threading.Thread(target=lambda: result.update(m=run(src, tmp_path / "ray", "ray", cluster)))
    driver.start()
    # A writer that never writes lets the task's open() return, then holds it in read(): its fd shows in /proc.
    deadline = time.monotonic() + 60
    while True:
        try:
            hold = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline and driver.is_alive(), "no task opened the FIFO"
            time.sleep(0.01)
    try:
        pid = reader_of(fifo)
        os.kill(pid, signal.SIGKILL)
    finally:
        os.close(hold)
    with feeding(fifos):
        driver.join(timeout=120)
    assert not driver.is_alive() and result["m"]["num_samples"] == 16 and not result["m"]["skipped"]
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")


def test_a_killed_driver_is_resumed_without_redoing_finished_shards(cluster, tmp_path, monkeypatch):
    src, fifos = fifo_folder(tmp_path / "src", 28, 13, 22)
    with feeding(fifos):
        run(src, tmp_path / "local", "local")
    out = tmp_path / "ray"
    cmd = [sys.executable, "-m", "fastdata", "preprocess", "images", str(src), str(out), "--size", "16",
           "--shard-size", "4", "--workers", "1", "--quiet", "--ray", cluster]
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    killer = threading.Thread(target=kill_when_journaled, args=(cmd, out, 2))
    killer.start()
    # Each task writes its own shard: shards 0-2 (samples 0-11) are published by their tasks while the one of
    # shard 3 waits for sample 13. Once shard 2's labels exist, the driver has journaled shards 0 and 1 or
    # is about to (it is killed once it has); sample 22 then never arrives while this driver lives.
    deadline = time.monotonic() + 60
    while killer.is_alive() and not (out / image_shards.labels_name(2)).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with feeding(fifos[:1]):
        killer.join()
    units = journaled_units(out)
    kept = {f["path"]: (out / f["path"]).stat().st_ino for u in units for f in u["files"]}
    assert len(units) >= 2 and units[-1]["source_end"] <= 20

    submitted: list[int] = []
    real = ray_pool.RayPool.ordered_map

    def counted(self, fn, tasks, *args):  # the driver's side: which tasks the rerun hands to Ray
        return real(self, fn, (submitted.append(t[2]) or t for t in tasks), *args)

    monkeypatch.setattr(ray_pool.RayPool, "ordered_map", counted)
    with feeding(fifos):
        run(src, out, "ray", cluster)
    assert submitted and min(submitted) == units[-1]["source_end"]  # nothing before the journal's end again
    assert tree_bytes(out) == tree_bytes(tmp_path / "local")
    assert all((out / name).stat().st_ino == ino for name, ino in kept.items())  # finished shards untouched


def test_workers_is_per_node_and_a_source_a_node_cannot_see_is_named(cluster, tmp_path):
    from fastdata.errors import SourceError
    from fastdata.preprocess.image_tasks import work

    assert (ray_pool.RayPool.open(cluster).workers, ray_pool.RayPool.open(cluster).num_cpus) == (2, 1.0)
    per_node = ray_pool.RayPool.open(cluster, 2)
    assert (per_node.workers, per_node.num_cpus) == (4, 0.5)  # two tasks at once on each 1-CPU node
    pool = ray_pool.RayPool.open(cluster, None, [str(tmp_path / "gone")])
    task = (str(tmp_path / "gone"), ["a/0.jpg"], 0, "npy", 16, "center-crop", 90, "lanczos", None)
    with pytest.raises(SourceError, match=r"gone is not visible on the Ray node"):
        list(pool.ordered_map(work, [task], 1, 0))


def test_an_unreachable_address_is_one_line_naming_it(tmp_path, capsys):
    pytest.importorskip("ray", reason="needs Ray: pip install 'fastdata[ray]'")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = image_folder(tmp_path / "src", 4, bad=-1)
    assert main(["preprocess", "images", str(src), str(tmp_path / "out"), "--quiet", "--ray",
                 f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"127.0.0.1:{port}" in err and "ray start --head" in err


def test_without_ray_the_flag_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where it is not installed
    src = image_folder(tmp_path / "src", 4, bad=-1)
    assert main(["preprocess", "images", str(src), str(tmp_path / "out"), "--quiet", "--ray"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'fastdata[ray]'" in err


@pytest.mark.remote
def test_tars_from_a_url_to_a_url_give_the_local_bytes_with_a_truncated_tar_listed(cluster, s3, tmp_path):
    from conftest import fresh_fs
    from test_store_out import store_bytes
    from test_wds_source import PER_TAR, _cut_in, make_tars

    fresh_fs()
    src = make_tars(tmp_path / "tars", count=3)
    _cut_in(src / "00001.tar", f"{PER_TAR + 2:09d}.png", 0.5)  # a download cut short: samples 8-11 gone
    url = s3("ray-wds")
    for p in sorted(src.iterdir()):
        s3.client.put_object(Bucket="ray-wds", Key=f"laion/{p.name}", Body=p.read_bytes())
    args = ["--size", "16", "--shard-size", "4", "--workers", "1", "--quiet", "--format", "lmdb"]
    assert main(["preprocess", "images", str(src), str(tmp_path / "local"), *args]) == 0
    assert main(["preprocess", "images", f"{url}/laion/{{00000..00002}}.tar", f"{url}/out", *args,
                 "--ray", cluster]) == 0
    got, local = store_bytes(s3, "ray-wds", "out"), tree_bytes(tmp_path / "local")
    m = json.loads(got.pop("manifest.json"))
    assert got == {k: v for k, v in local.items() if k != "manifest.json"}
    assert m["num_samples"] == 3 * PER_TAR - 4 and [s["path"] for s in m["skipped"]] == [
        f"00001.tar/{PER_TAR + 2:09d}.png"]
    assert m["files"] == json.loads(local["manifest.json"])["files"]
