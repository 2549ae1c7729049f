"""Shared fixtures: real image files of every awkward kind, written with Pillow into tmp_path."""
from __future__ import annotations

import importlib.util
import io
import os
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from PIL import Image


def pytest_collection_modifyitems(config, items):
    has_cuda = False
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        has_cuda = torch.cuda.is_available()
    has_dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    for item in items:
        if item.get_closest_marker("cuda") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("dali") and not has_dali:
            item.add_marker(pytest.mark.skip(reason="needs nvidia-dali (pip install fastdata[dali])"))


def write_png_rgb16(path: Path, rgb: np.ndarray, key: Optional[tuple[int, int, int]] = None) -> None:
    """A 48-bit RGB PNG written by hand (Pillow cannot write one): ``rgb`` is (H, W, 3) uint16; ``key``: a
    colour key (tRNS) in 16-bit values."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
    png += chunk(b"tRNS", struct.pack(">HHH", *key)) if key is not None else b""
    png += chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def quadrants(w: int, h: int) -> np.ndarray:
    """Upright test picture: red top-left, green top-right, blue bottom-left, white bottom-right."""
    img = np.zeros((h, w, 3), np.uint8)
    img[: h // 2, : w // 2] = (255, 0, 0)
    img[: h // 2, w // 2:] = (0, 255, 0)
    img[h // 2:, : w // 2] = (0, 0, 255)
    img[h // 2:, w // 2:] = (255, 255, 255)
    return img


def save_with_orientation(path: Path, upright: np.ndarray, orientation: int) -> None:
    """Store ``upright`` sideways as a camera would, with the EXIF tag that tells viewers how to turn it."""
    img = Image.fromarray(upright)
    stored = {6: img.transpose(Image.Transpose.ROTATE_90), 8: img.transpose(Image.Transpose.ROTATE_270)}[orientation]
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, quality=95, exif=exif.tobytes())


@pytest.fixture
def awkward_folder(tmp_path: Path) -> Path:
    """An ImageFolder tree with every awkward case; class folders sort as ``a_modes``, ``b_exif``, ``ñandú``."""
    root = tmp_path / "src"
    modes, exif, uni = root / "a_modes", root / "b_exif", root / "ñandú"
    for d in (modes, exif, uni):
        d.mkdir(parents=True)
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(modes / "cmyk.jpg", quality=95)
    Image.new("L", (40, 30), 100).save(modes / "gray.png")
    pal = Image.new("P", (40, 30), 0)
    pal.putpalette([10, 200, 30] + [0] * 765)
    pal.save(modes / "palette.png")
    Image.new("RGBA", (40, 30), (255, 0, 0, 128)).save(modes / "rgba.png")
    Image.new("LA", (40, 30), (0, 0)).save(modes / "la.png")  # fully transparent: pure background
    Image.fromarray(np.full((30, 40), 32768, np.uint16)).save(modes / "gray16.png")
    write_png_rgb16(modes / "rgb16.png", np.broadcast_to(np.array([65535, 32768, 256], np.uint16), (30, 40, 3)))
    save_with_orientation(exif / "rot6.jpg", quadrants(60, 40), 6)
    save_with_orientation(exif / "rot8.jpg", quadrants(60, 40), 8)
    Image.fromarray(quadrants(60, 40)).save(exif / "upright.JPG", quality=95)
    Image.new("RGB", (50, 50), (7, 8, 9)).save(uni / "日本語.png")
    good = io.BytesIO()
    Image.fromarray(quadrants(64, 64)).save(good, "JPEG")
    (uni / "truncated.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    (uni / "empty.png").write_bytes(b"")
    (uni / "garbage.webp").write_bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8).tobytes())
    (uni / "notes.txt").write_text("not an image")
    (uni / ".hidden.jpg").write_bytes(good.getvalue())
    (root / ".hidden_class").mkdir()
    (root / ".hidden_class" / "x.jpg").write_bytes(good.getvalue())
    return root


AWKWARD_GOOD = ["a_modes/cmyk.jpg", "a_modes/gray.png", "a_modes/gray16.png", "a_modes/la.png",
                "a_modes/palette.png", "a_modes/rgb16.png", "a_modes/rgba.png",
                "b_exif/rot6.jpg", "b_exif/rot8.jpg", "b_exif/upright.JPG", "ñandú/日本語.png"]
AWKWARD_BAD = ["ñandú/empty.png", "ñandú/garbage.webp", "ñandú/truncated.jpg"]


@pytest.fixture
def photo_folder(tmp_path: Path) -> Path:
    """Photo-like JPEGs in 3 classes (synthetic, made locally)."""
    from fastdata.cli.synthetic import make_image_folder

    root = tmp_path / "photos"
    make_image_folder(root, num_classes=3, per_class=14, sizes=((120, 90), (90, 120), (100, 100)))
    return root


INDEXED_N, INDEXED_SIZE, INDEXED_SHARD = 100, 8, 16


def sample_ids(x) -> np.ndarray:
    """Recover the sample index encoded in an indexed dataset's pixels (see indexed_source)."""
    px = np.asarray(x)[..., 0, 0, :].astype(float)
    return (np.rint(px[..., 0] / 25) * 10 + np.rint(px[..., 1] / 25)).astype(np.int64)


def index_colour(i: int) -> tuple[int, int, int]:
    """Steps of 25 per level survive JPEG's colour rounding (a few units) on flat colour."""
    return (i // 10 * 25, i % 10 * 25, 9)


def indexed_source(root: Path, n: int = INDEXED_N, size: int = INDEXED_SIZE) -> Path:
    """A CSV list of ``n`` (<= 100) uniform size x size PNGs; sample i has colour index_colour(i), label i % 3."""
    root.mkdir(parents=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (size, size), index_colour(i)).save(root / f"{i:05d}.png")
        rows.append(f"{i:05d}.png,{i % 3}")
    (root / "list.csv").write_text("\n".join(rows) + "\n")
    return root / "list.csv"


@pytest.fixture(scope="session", autouse=True)
def temp_files_in_pytests_folder(tmp_path_factory):
    """Processes the tests start (torchrun's agent leaves a torchelastic_* folder behind) make their temporary
    files under this session's pytest folder, which pytest prunes, not in the machine's /tmp."""
    import os
    import tempfile

    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # re-read TMPDIR
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def indexed_datasets(tmp_path_factory) -> dict[str, Path]:
    """``{"npy": folder, "lmdb": folder}`` of the indexed source; npy has 7 shards of 16 (the last of 4)."""
    from fastdata.cli.main import main

    base = tmp_path_factory.mktemp("indexed")
    csv = indexed_source(base / "src")
    out = {}
    for fmt in ("npy", "lmdb"):
        out[fmt] = base / fmt
        assert main(["preprocess", "images", str(csv), str(out[fmt]), "--size", str(INDEXED_SIZE), "--format", fmt,
                     "--shard-size", str(INDEXED_SHARD), "--workers", "1", "--quiet", "--quality", "95"]) == 0
    return out


@pytest.fixture
def npy_copy(indexed_datasets, tmp_path) -> Path:
    """A private copy of the indexed npy dataset, for tests that damage it."""
    import shutil

    return Path(shutil.copytree(indexed_datasets["npy"], tmp_path / "ds"))


def disk_of(limit: int):
    """A ``preexec_fn`` for a subprocess on a "full disk": no file it writes may grow past ``limit`` bytes,
    and a write beyond fails with EFBIG, as on a full disk, instead of killing it (SIGXFSZ ignored)."""
    def preexec() -> None:
        import resource
        import signal

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return preexec


def torchrun_cmd(nproc: int) -> list[str]:
    """The launcher: ``torchrun --standalone --nproc_per_node=nproc``, with this Python."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def torchrun(nproc: int, *args: str, timeout: float = 300, **kwargs: object) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc ARGS``, its output captured as text. A run that outlives
    ``timeout`` (ranks hung in a collective) is killed with every process it started, so no orphaned rank
    goes on using the CI machine's cores, and the test fails with TimeoutExpired."""
    import os
    import signal

    cmd = [*torchrun_cmd(nproc), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def journaled_units(out: Path) -> list[dict]:
    """The units a preprocess run into ``out`` has journaled so far (empty before its first)."""
    from fastdata.preprocess.journal import load, partial_dir

    jr = load(partial_dir(out))
    return jr.units if jr is not None else []


def started_while_held(out: Path, commands: list[list[str]]) -> tuple[list[subprocess.Popen], list[list[str]]]:
    """Each command started while this process holds OUT, returned once every one has said it is waiting (the
    caller releases OUT): their stderr lines, read on, so runs racing for OUT never depend on start-up times."""
    import sys
    import threading
    import time

    procs = [subprocess.Popen([sys.executable, "-m", "fastdata", *cmd], stderr=subprocess.PIPE, text=True)
             for cmd in commands]
    lines: list[list[str]] = [[] for _ in procs]
    for proc, mine in zip(procs, lines):
        threading.Thread(target=lambda p=proc, m=mine: m.extend(p.stderr), daemon=True).start()
    deadline = time.monotonic() + 120
    while not all(any("waiting" in ln for ln in mine) for mine in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    for mine in lines:
        assert any(f"{out} is being written by another fastdata preprocess" in ln for ln in mine), lines
    return procs, lines


def recording_run(ran: list[int]):
    """A run's ordered map for `FileSource.index` (``run(fn, tasks)``) that runs the tasks here, noting each
    task's file number in ``ran``: which files a run summarised."""
    def run(fn, tasks):
        for task in tasks:
            ran.append(task[0])
            yield fn(task)
    return run


def kill_when_journaled(cmd: list[str], out: Path, min_units: int) -> None:
    """Run ``cmd`` (a preprocess) and SIGKILL it once its journal lists ``min_units`` finished units."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(journaled_units(out)) >= min_units:
            break
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"


def corrupt_lmdb_copy(src: Path, dst: Path, sample: int, huffman: bool = False) -> Path:
    """A copy of an LMDB dataset whose record ``sample`` starts with 32 zero bytes (no longer a JPEG), or with
    ``huffman``, has a garbled Huffman table (a whole JPEG by its markers that no decoder can read)."""
    import shutil

    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.formats.manifest import load_manifest

    root = shutil.copytree(src, dst)
    reader = open_lmdb(root, load_manifest(root))
    blob, store = reader.get_many([sample])[0], reader.path_of(sample)
    if huffman:
        i = blob.find(b"\xff\xc4")
        bad = blob[:i + 5] + b"\xff" * 16 + blob[i + 21:]
    else:
        bad = bytes(32) + blob[32:]
    data = store.read_bytes()
    at = data.find(blob)
    store.write_bytes(data[:at] + bad + data[at + len(blob):])
    return root


# -- object storage: a real S3 API (moto) on loopback, and the fault proxy in front of it ----------------------
@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback; yields a function making a fresh bucket and returning its URL."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import boto3

    server = _MotoProcess()
    endpoint = f"http://127.0.0.1:{server.port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fresh_fs()  # fsspec keeps one client per set of options: not one of another module's server, stopped since
    client = boto3.client("s3", endpoint_url=endpoint)
    made = []

    def bucket(name: str) -> str:
        client.create_bucket(Bucket=name)
        made.append(name)
        return f"s3://{name}"
    bucket.client = client
    bucket.port = server.port
    try:
        yield bucket
    finally:
        server.stop()
        fresh_fs()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_MOTO = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request would bury a failure's message
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
server.start()
print("port", server._server.server_port, flush=True)
sys.stdin.read()  # until the tests close the pipe, or end
server.stop()
"""


class _MotoProcess:
    """moto's threaded S3 server in a process of its own: in the tests' process, the server and the client
    under test took turns on one interpreter lock (a push of 300 shards took 1.75 times as long)."""

    def __init__(self) -> None:
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _MOTO], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        for line in self.proc.stdout:
            if line.startswith("port "):
                self.port = int(line.split()[1])
                return
        self.proc.wait(10)
        raise RuntimeError(f"the moto server did not start (exit {self.proc.returncode})")

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def upload(local: Path, url: str) -> None:
    """The dataset folder ``local`` copied to ``url`` as `aws s3 sync` would: one PUT a file, no push markers (a
    fifth of `push`'s requests), for tests of reading many shards; `push` itself is tested in test_remote.py."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    fs.put(f"{local}/", f"{path}/", recursive=True)


def fresh_fs() -> None:
    """Forget fsspec's cached s3 clients: it keeps one per set of options, and the endpoint (an environment
    variable) is not one of them."""
    import fsspec

    fsspec.filesystem("s3").clear_instance_cache()


@pytest.fixture
def proxy(s3, monkeypatch):
    """The fault-injecting loopback proxy (tests/s3_faults.py) in front of the moto server, as the endpoint."""
    from s3_faults import FaultProxy

    p = FaultProxy(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    fresh_fs()
    yield p
    p.close()
    fresh_fs()
