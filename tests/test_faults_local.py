"""Faults on one machine, against real parts: a lowered limit on open files with 1,300 shards, two datasets on
one LMDB with one closed mid-epoch, planted files in the shm folder, a shm copier killed mid-copy, checkpoint
writers racing and a damaged newest checkpoint. Each runs what may crash in a subprocess, so a segfault or a
hang fails the test instead of the test run."""
from __future__ import annotations

import json
import logging
import os
import resource
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import disk_of, upload

pytestmark = pytest.mark.faults

MANY = 1300  # shards of one sample: more than the common soft limit of 1,024 open files
# Streamed, each shard is uploaded to the loopback store first: those tests pass the same bounds at a third of
# the size, a limit of 400 open files (256 of them kept free) and 450 shards.
FEW, FEW_LIMIT = 450, 400
SIDE = 8


def pixels(i: int) -> np.ndarray:
    """Sample ``i``'s image: its index in the first two channels, a gradient shifted by it in the third."""
    img = np.empty((SIDE, SIDE, 3), dtype=np.uint8)
    img[..., 0], img[..., 1] = i & 0xFF, i >> 8
    img[..., 2] = (np.arange(SIDE * SIDE).reshape(SIDE, SIDE) + i) % 256
    return img


def put_npy(root: Path, name: str, arr: np.ndarray) -> dict:
    """``arr`` saved as ``root / name``; its manifest entry."""
    import hashlib

    from fastdata.formats.base import npy_bytes

    data = npy_bytes(arr)
    (root / name).write_bytes(data)
    return {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def many_shards(root: Path, n: int = MANY) -> Path:
    """An npy dataset of ``n`` one-sample shards (label ``i``) in the format's own byte layout and names,
    written without an fsync per file (2 s, not 20)."""
    from fastdata.formats.image_shards import images_name, labels_name
    from fastdata.formats.manifest import IMAGES_NPY, new_manifest, write_manifest

    root.mkdir(parents=True)
    files, shards = [], []
    for i in range(n):
        files += [put_npy(root, images_name(i), pixels(i)[None]),
                  put_npy(root, labels_name(i), np.array([i], dtype="<i8"))]
        shards.append({"images": images_name(i), "labels": labels_name(i), "samples": 1})
    files.append(put_npy(root, "labels.npy", np.arange(n, dtype="<i8")))
    write_manifest(root, new_manifest(IMAGES_NPY, num_samples=n, classes=[str(i) for i in range(n)],
                                      sample_shape=[SIDE, SIDE, 3], dtype="|u1", label_dtype="<i8", layout="NHWC",
                                      shard_size=1, shards=shards, files=files, all_labels="labels.npy"))
    return root


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    return many_shards(tmp_path_factory.mktemp("many") / "ds")


@pytest.fixture(scope="module")
def few(tmp_path_factory) -> Path:
    return many_shards(tmp_path_factory.mktemp("few") / "ds", FEW)


def limited(soft: int, hard: int | None = None):
    """A ``preexec_fn`` lowering the child's limit on open files (the hard one too when given)."""
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard or resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return preexec


def run_child(code: str, *args: str, preexec=None, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=timeout, preexec_fn=preexec, cwd=Path(__file__).parent)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"  # (139: a segfault)
    return r


EPOCH = """
    import sys, numpy as np, torch
    from torch.utils.data import DataLoader
    from fastdata.datasets.images import FastDataset
    from test_faults_local import pixels
    path, storage, extra, start = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4]
    ds = FastDataset(path, storage=storage, **extra)
    for lo in range(0, len(ds), 100):  # this process reads every shard (streamed: fetches and maps each)...
        x, y = ds.get_batch(list(range(lo, min(lo + 100, len(ds)))))
        assert all(np.array_equal(img, pixels(i)) for img, i in zip(x.numpy(), y.tolist()))
    x, y = ds.get_batch(np.random.default_rng(1).permutation(len(ds)))  # one batch over every shard
    assert all(np.array_equal(img, pixels(i)) for img, i in zip(x.numpy(), y.tolist()))
    seen = []  # ... and so do 4 loader workers
    loader = DataLoader(ds, batch_size=37, shuffle=True, num_workers=4, generator=torch.Generator().manual_seed(0),
                        multiprocessing_context=start)
    for x, y in loader:
        for img, i in zip(x.numpy(), y.tolist()):
            assert np.array_equal(img, pixels(i)), f"sample {i} has the wrong bytes"
            seen.append(i)
    assert sorted(seen) == list(range(len(ds))), "not every sample exactly once"
    print("served", len(seen))
"""


@pytest.mark.slow
@pytest.mark.parametrize("storage, hard", [("mmap", None), ("mmap", 1024), ("ram", None), ("shm", None)])
def test_1300_shards_serve_an_epoch_under_ulimit_1024_with_4_workers(many, tmp_path, storage, hard):
    """hard=None: the soft limit is raised towards the hard one (and said once); hard=1024: it cannot be, and
    the shards are mapped as read, a bounded number at once."""
    extra = {"shm_dir": str(tmp_path)} if storage == "shm" else {}
    r = run_child(EPOCH, str(many), storage, repr(extra), "fork", preexec=limited(1024, hard))
    assert f"served {MANY}" in r.stdout
    if storage == "mmap":
        said = "raised this process's limit on open files" if hard is None else "at most"
        assert r.stderr.count(said) == 1, r.stderr  # said once, not per shard or per worker


@pytest.mark.slow
@pytest.mark.remote
@pytest.mark.parametrize("hard, limited_cache", [(None, False), (True, False), (True, True)])
def test_streamed_shards_past_the_limit_on_open_files_serve_an_epoch_with_4_workers(s3, few, tmp_path, hard,
                                                                                   limited_cache):
    """450 shards under a soft limit of 400 (hard=None: raised) or a hard one (hard=True): shards are mapped as
    batches read them, not as they arrive (before 2026-11-27, evening: "Too many open files" once ~1,000 of
    1,300 shards had arrived under 1,024). With a cache_limit (half the shards), the batch over every shard pins
    all of them (until 2026-11-27: a pin file each, "Too many open files")."""
    url = s3("many-shards") + "/ds"
    upload(few, url)
    extra = {"cache_dir": str(tmp_path / "cache")}
    if limited_cache:
        extra["cache_limit"] = sum(f.stat().st_size for f in few.glob("images-*.npy")) // 2
    # spawned workers: s3fs refuses to be used in a forked child ("This class is not fork-safe")
    r = run_child(EPOCH, url, "mmap", repr(extra), "spawn", preexec=limited(FEW_LIMIT, FEW_LIMIT if hard else None))
    said = "raised this process's limit on open files" if hard is None else "allows to keep open: at most"
    assert f"served {FEW}" in r.stdout and said in r.stderr


def many_token_shards(root: Path, n: int = MANY, size: int = 64) -> Path:
    """A token dataset (format 2) of ``n`` shards of ``size`` tokens (uint32), token ``t`` of the stream
    being ``t`` itself, each shard one document."""
    from fastdata.formats.manifest import TOKENS, new_manifest, write_manifest
    from fastdata.formats.tokenizer import load_tokenizer

    root.mkdir(parents=True)
    files, shards = [], []
    for k in range(n):
        name, docs = f"train-{k:05d}.npy", f"train-docs-{k:05d}.npy"
        files += [put_npy(root, name, np.arange(k * size, (k + 1) * size, dtype="<u4")),
                  put_npy(root, docs, np.array([0, size], "<i8"))]
        shards.append({"path": name, "tokens": size, "documents": 1, "docs": docs})
    write_manifest(root, new_manifest(TOKENS, tokenizer=load_tokenizer("bytes").describe(), dtype="<u4",
                                      splits={"train": {"tokens": n * size, "documents": n, "shards": shards}},
                                      files=files, params={}, fingerprint="faults", source={},
                                      bytes_per_token=1.0, skipped_count=0, skipped=[]))
    return root


@pytest.mark.slow
@pytest.mark.remote
@pytest.mark.parametrize("streamed", [False, True])
def test_token_shards_past_a_hard_limit_on_open_files_serve_batches_over_every_shard(s3, tmp_path, streamed):
    """Token shards, local (1,300 under 1,024) or streamed (450 under 400), past a hard limit on open files:
    mapped as batches read them (the streamed ones failed with "Too many open files" before 2026-11-27,
    evening)."""
    shards, limit = (FEW, FEW_LIMIT) if streamed else (MANY, 1024)
    root = many_token_shards(tmp_path / "tokens", shards)
    path = root
    if streamed:
        path = s3("many-tokens") + "/tokens"
        upload(root, path)
    r = run_child("""
        import sys, numpy as np
        from fastdata.datasets.tokens import TokenDataset
        ds = TokenDataset(sys.argv[1], seq_len=40, cache_dir=sys.argv[2] if sys.argv[1].startswith("s3") else None)
        order = np.random.default_rng(0).permutation(len(ds))
        for batch in (37, len(ds)):  # the last: one batch over every shard, windows across shard ends
            for lo in range(0, len(ds), batch):
                idx = order[lo:lo + batch]
                x, y = ds.get_batch(idx)
                want = ds.starts(idx)[:, None] + np.arange(41)
                assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:])
        print("served", len(ds))
    """, str(path), str(tmp_path / "cache"), preexec=limited(limit, limit))
    assert "served" in r.stdout and "allows to keep open: at most" in r.stderr


def test_the_soft_limit_is_raised_before_the_maps_need_it(many):
    """Opening maps every shard at once (a plain list), the soft limit raised first."""
    r = run_child("""
        import resource, sys
        from fastdata.datasets.images import FastDataset
        before = resource.getrlimit(resource.RLIMIT_NOFILE)
        ds = FastDataset(sys.argv[1])
        after = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(before[0], after[0], type(ds._shards).__name__)
    """, str(many), preexec=limited(1024))
    before, after, kind = r.stdout.split()
    assert int(before) == 1024 and int(after) > MANY and kind == "list"


@pytest.fixture(scope="module")
def many_lmdb(tmp_path_factory) -> Path:
    return many_lmdb_stores(tmp_path_factory.mktemp("many_lmdb") / "ds")


def many_lmdb_stores(root: Path, n: int = MANY) -> Path:
    """An LMDB dataset (format 4) of ``n`` one-sample stores; sample ``i`` is a flat JPEG whose channels
    spell ``i`` in base 16 (`colour_of`), label ``i``."""
    import io

    from PIL import Image

    from fastdata.formats.lmdb_store import LABELS_NAME, build_shard, shard_name
    from fastdata.formats.manifest import IMAGES_LMDB, new_manifest, write_manifest

    root.mkdir(parents=True)
    files, shards = [], []
    for i in range(n):
        jpeg = io.BytesIO()
        Image.new("RGB", (SIDE, SIDE), colour_of(i)).save(jpeg, "JPEG", quality=95)
        files.append(build_shard(root / shard_name(i), [jpeg.getvalue()]))
        shards.append({"path": shard_name(i), "samples": 1})
    np.save(root / LABELS_NAME, np.arange(n, dtype="<i8"))
    import hashlib
    data = (root / LABELS_NAME).read_bytes()
    files.append({"path": LABELS_NAME, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    write_manifest(root, new_manifest(IMAGES_LMDB, num_samples=n, classes=[str(i) for i in range(n)],
                                      encoding="jpeg", key_format="%012d", label_dtype="<i8", labels=LABELS_NAME,
                                      lmdb_shards=shards, shard_size=1, max_short_side=SIDE, files=files))
    return root


def colour_of(i: int) -> tuple[int, int, int]:
    return tuple(((i >> (4 * c)) & 15) * 16 + 8 for c in range(3))  # steps of 16: JPEG's error is far smaller


LMDB_EPOCH = """
    import sys, numpy as np, torch
    from torch.utils.data import DataLoader
    from fastdata.datasets.images import FastDataset
    ds = FastDataset(sys.argv[1], **(eval(sys.argv[2]) if len(sys.argv) > 2 else {}))
    start = sys.argv[3] if len(sys.argv) > 3 else "fork"

    def check(x, y):  # each image's colour spells its own index, which is also its label
        digits = np.rint((x.numpy().reshape(len(x), -1, 3).mean(1) - 8) / 16).astype(int)
        assert np.array_equal(digits @ np.array([1, 16, 256]), y.numpy()), "a sample has another's bytes"
        return y.tolist()
    for lo in range(0, len(ds), 100):  # this process opens every store...
        check(*ds.get_batch(list(range(lo, min(lo + 100, len(ds))))))
    order = np.random.default_rng(0).permutation(len(ds))
    check(*ds.get_batch(order))  # one batch over every store: more than the limit on open files
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:  # four threads at once, half the stores a batch
        for x, y in pool.map(ds.get_batch, [order[k::2] for k in (0, 1, 1, 0)]):
            check(x, y)
    seen = []  # ... and so do 4 loader workers
    for x, y in DataLoader(ds, batch_size=37, shuffle=True, num_workers=4, multiprocessing_context=start):
        seen += check(x, y)
    assert sorted(seen) == list(range(len(ds))), "not every sample exactly once"
    print("served", len(seen), "held", ds._reader.held())
"""


@pytest.mark.slow
@pytest.mark.remote
def test_streamed_lmdb_stores_with_a_cache_limit_serve_an_epoch_past_a_hard_limit_on_open_files(s3, tmp_path):
    """450 stores under a hard limit of 400, streamed through a node cache holding half the stores: the batch
    over every store pins all of them (until 2026-11-27: a pin file each, "Too many open files", with 1,300
    stores under 1,024)."""
    few_lmdb = many_lmdb_stores(tmp_path / "ds", FEW)
    url = s3("many-lmdb") + "/ds"
    upload(few_lmdb, url)
    limit = sum(f.stat().st_size for f in few_lmdb.glob("*.lmdb")) // 2
    # spawned workers: s3fs refuses to be used in a forked child
    r = run_child(LMDB_EPOCH, url, repr({"cache_dir": str(tmp_path / "cache"), "cache_limit": limit}), "spawn",
                  preexec=limited(FEW_LIMIT, FEW_LIMIT))
    assert int(r.stdout.split()[1]) == FEW


@pytest.mark.slow
@pytest.mark.parametrize("hard", [None, 1024])
def test_1300_lmdb_stores_serve_an_epoch_under_ulimit_1024_with_4_workers(many_lmdb, hard):
    """Each LMDB store holds a descriptor and a mapping while open: past 1,024 the reader failed mid-epoch with
    "Too many open files". hard=None: the soft limit is raised; hard=1024: a bounded number stay open."""
    r = run_child(LMDB_EPOCH, str(many_lmdb), preexec=limited(1024, hard))
    served, held = r.stdout.split()[1::2]
    assert int(served) == MANY
    said = "raised this process's limit on open files" if hard is None else "allows to keep open: at most"
    assert r.stderr.count(said) == 1, r.stderr
    if hard is not None:
        bound = int(r.stderr.split("at most ")[1].split()[0])
        assert bound < 1024 - 256 and int(held) <= bound


def test_a_bounded_lmdb_reader_never_closes_a_store_a_read_block_still_uses(many_lmdb):
    """Views are valid until their block ends: the stores a block reads stay open until it ends (closing one
    under a view would unmap it: a segfault), and are let go of then; a block over more stores than the room
    left in the bound reads copies, a few stores at a time, so that the bound holds (NOTE [open files] 6)."""
    r = run_child("""
        import sys, threading
        from pathlib import Path
        from fastdata import _limits
        from fastdata.formats.lmdb_store import open_lmdb
        from fastdata.formats.manifest import load_manifest
        root = Path(sys.argv[1])
        want = open_lmdb(root, load_manifest(root)).get_many(range(1300))
        _limits.room_for_maps = lambda count: False
        _limits.bounded_maps = lambda: (16, "open files")
        reader = open_lmdb(root, load_manifest(root))
        assert reader.bound == 16
        with reader.views(range(10)) as blobs:  # 10 stores in one block: none may close inside it
            assert all(isinstance(v, memoryview) for v in blobs)
            reader.get_many(range(100, 140))    # (another 40, read meanwhile, would push them out)
            assert [bytes(v) for v in blobs] == want[:10]
            assert 10 <= reader.held() <= 16, reader.held()
        with reader.views(range(40)) as blobs:  # more stores than it may hold open: copies, within the bound
            assert all(isinstance(v, bytes) for v in blobs) and reader.held() <= 16
            assert list(blobs) == want[:40]
        reader.get_many([500])
        assert reader.held() <= 16, reader.held()
        errors, peak = [], []
        def read(k):  # threads reading overlapping stores at once, views of 10 stores or copies of 50
            try:
                for lo in range(k * 7, 1300 - 50, 97):
                    width = 10 if lo % 2 else 50
                    with reader.views(range(lo, lo + width)) as blobs:
                        assert [bytes(v) for v in blobs] == want[lo:lo + width]
                        peak.append(reader.held())
            except Exception as exc:
                errors.append(exc)
        threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        assert max(peak) <= 16 + 4, max(peak)  # (a block past the room still takes one store: one a thread)
        reader.get_many([0])
        for k in range(5):  # a store let go of inside its block (the node cache's closer) is not counted as used
            with reader.views([k]) as blobs:
                assert bytes(blobs[0]) == want[k]
                reader.release(reader.path_of(k))
        reader.get_many(range(100, 140))
        import os
        with reader.views(range(10)) as blobs:  # a child forked inside a block leaves it: not its room to give
            child = os.fork()
            if child == 0:
                reader.get_many([300])  # (the child reads first: it counts afresh)
        if child == 0:
            with reader.views(range(200, 240)) as more:
                fine = reader.held() <= 16 and list(more) == want[200:240]
            os._exit(0 if fine and reader._holds.reserved == 0 else 3)
        assert os.WEXITSTATUS(os.waitpid(child, 0)[1]) == 0, "the child held more than its bound"
        assert reader._holds.reserved == 0
        print("ok", reader.held())
    """, str(many_lmdb))
    ok, held = r.stdout.split()
    assert ok == "ok" and int(held) <= 16


@pytest.mark.parametrize("bounded", [False, True])
def test_a_child_forked_while_a_thread_reads_lmdb_reads_too(many_lmdb, bounded):
    """A fork while another thread was inside a py-lmdb call (or held the lock that opens stores) left the
    child waiting for ever in its first read: py-lmdb's close waits for calls only the parent's thread could
    end (72 and 84 children of 100 hung before). NOTE [shared environments] 4."""
    r = run_child("""
        import os, signal, sys, threading, time
        from pathlib import Path
        from fastdata import _limits
        from fastdata.formats.lmdb_store import open_lmdb
        from fastdata.formats.manifest import load_manifest
        root = Path(sys.argv[1])
        if sys.argv[2] == "True":
            _limits.room_for_maps = lambda count: False
            _limits.bounded_maps = lambda: (16, "open files")
        reader = open_lmdb(root, load_manifest(root))
        want = reader.get_many(range(60))
        stop = False
        def spin():
            i = 0
            while not stop:
                reader.get_many([(i * 7) % 1300, (i * 13) % 1300])
                i += 1
        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        time.sleep(0.2)
        hung = wrong = 0
        for k in range(60):
            pid = os.fork()
            if pid == 0:
                signal.alarm(30)  # a hung child dies of SIGALRM (a loaded machine may take seconds: not a hang)
                os._exit(0 if reader.get_many([k]) == [want[k]] else 3)
            _, status = os.waitpid(pid, 0)
            hung += os.WIFSIGNALED(status)
            wrong += os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0
            if hung:
                break  # (one is the bug: the rest would each wait out the alarm)
        stop = True
        spinner.join()  # (a thread left inside py-lmdb as the interpreter ends aborts it: "terminate called")
        print(hung, wrong)
    """, str(many_lmdb), str(bounded))
    assert r.stdout.split() == ["0", "0"], r.stdout


@pytest.mark.slow
def test_two_lmdb_datasets_share_the_room_under_ulimit_1024(tmp_path):
    """An LMDB reader opens its stores as it reads them: a second dataset sized as if the first held nothing
    ran out of descriptors ("Too many open files"). What a live reader may still open is set aside."""
    first, second = many_lmdb_stores(tmp_path / "a", 700), many_lmdb_stores(tmp_path / "b", 700)
    r = run_child("""
        import sys
        import numpy as np
        from fastdata.datasets.images import FastDataset
        a, b = FastDataset(sys.argv[1]), FastDataset(sys.argv[2])
        for ds in (a, b):
            for lo in range(0, 700, 100):
                x, y = ds.get_batch(list(range(lo, lo + 100)))
                digits = np.rint((x.numpy().reshape(len(x), -1, 3).mean(1) - 8) / 16).astype(int)
                assert np.array_equal(digits @ np.array([1, 16, 256]), y.numpy())
        print(a._reader.bound, b._reader.bound, a._reader.held() + b._reader.held())
    """, str(first), str(second), preexec=limited(1024, 1024))
    bound_a, bound_b, held = r.stdout.split()
    assert bound_a == "None" and int(bound_b) < 1024 - 700 - 256 and int(held) <= 700 + int(bound_b)


# -- LMDB: shared environments ---------------------------------------------------------------------------


def test_closing_one_lmdb_reader_never_frees_a_map_another_is_reading(indexed_datasets):
    r = run_child("""
        import sys
        from pathlib import Path
        from fastdata.formats.lmdb_store import LmdbReader
        from fastdata.formats.manifest import load_manifest
        from fastdata.formats.lmdb_store import open_lmdb
        root = Path(sys.argv[1])
        a, b = open_lmdb(root, load_manifest(root)), open_lmdb(root, load_manifest(root))
        want = a.get_many(range(100))
        with b.views(range(100)) as blobs:  # views into b's map...
            a.close()                       # ...while a lets go of the same files
            for k in range(3):
                a.get_many([0])             # (a reopens, then lets go again: b still holds)
                a.close()
            got = [bytes(v) for v in blobs]
        assert got == want
        assert b.get_many(range(100)) == want
        b.close()
        del a
        print("ok")
    """, str(indexed_datasets["lmdb"]))
    assert r.stdout.strip() == "ok"


TWO_DATASETS = """
    import sys, threading, numpy as np
    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader
    path, extra = sys.argv[1], eval(sys.argv[2])
    ref = [(x.numpy().copy(), y.numpy().copy()) for x, y in FastLoader(FastDataset(path, **extra), 8, seed=1,
                                                                       num_threads=2)]
    train, val = FastDataset(path, **extra), FastDataset(path, **extra)
    val.get_batch(list(range(len(val))))  # val has read (and holds) every store
    got = []
    for k, (x, y) in enumerate(FastLoader(train, 8, seed=1, num_threads=2)):
        got.append((x.numpy().copy(), y.numpy().copy()))
        if k == 3:  # mid-epoch: the other dataset on the same files is closed
            close = getattr(val, "close", None)
            if close is None:  # (datasets without close(): what it would release)
                if val._cache is not None:
                    val._cache.close()
                val._reader.close()
            else:
                close()
    assert len(got) == len(ref) and all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                                        for a, b in zip(got, ref))
    print("ok", len(got))
"""


def test_two_datasets_on_one_lmdb_one_closed_mid_epoch(indexed_datasets):
    r = run_child(TWO_DATASETS, str(indexed_datasets["lmdb"]), "{}")
    assert r.stdout.startswith("ok 13")


@pytest.mark.remote
def test_two_streamed_datasets_on_one_lmdb_url_one_closed_mid_epoch(s3, indexed_datasets, tmp_path):
    from fastdata.storage.push import push

    url = s3("shared-lmdb") + "/lmdb"
    push(indexed_datasets["lmdb"], url)
    r = run_child(TWO_DATASETS, url, repr({"cache_dir": str(tmp_path / "cache")}))
    assert r.stdout.startswith("ok 13")


# -- /dev/shm: private, checked ------------------------------------------------------------------------


def shared_folder(tmp_path: Path) -> Path:
    """A folder like /dev/shm: everyone may write in it (sticky)."""
    d = tmp_path / "devshm"
    d.mkdir()
    d.chmod(0o1777)
    return d


def copy_path(base: Path, dataset: Path) -> Path:
    from fastdata.formats.manifest import load_manifest
    from fastdata.storage import shm

    return shm.private_dir(base) / f"{shm.PREFIX}{shm.copy_id(load_manifest(dataset))}.npy"


def test_copies_live_in_a_private_folder_as_private_files(indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset

    base = shared_folder(tmp_path)
    ds = FastDataset(indexed_datasets["npy"], storage="shm", shm_dir=base)
    mine = base / f"fastdata-user-{os.getuid()}"
    assert [p.name for p in base.iterdir()] == [mine.name] and stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in mine.iterdir()} == {0o600}
    assert Path(ds._flat.filename).parent == mine


def test_a_loose_or_foreign_private_folder_is_refused(indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import OutputError

    base = shared_folder(tmp_path)
    mine = base / f"fastdata-user-{os.getuid()}"
    mine.mkdir(mode=0o777)
    mine.chmod(0o777)  # made by someone else, to plant copies in
    with pytest.raises(OutputError, match=rf"has mode 0777, not 0700: .*remove it \(`rm -rf {mine}`"):
        FastDataset(indexed_datasets["npy"], storage="shm", shm_dir=base)
    if os.geteuid() == 0:
        mine.chmod(0o700)
        os.chown(mine, 12345, 12345)
        with pytest.raises(OutputError, match=r"belongs to uid 12345, not to this user"):
            FastDataset(indexed_datasets["npy"], storage="shm", shm_dir=base)


def test_a_planted_copy_is_refused_and_a_removed_one_is_made_again(indexed_datasets, tmp_path):
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ChecksumError, OutputError
    from fastdata.storage import shm

    src = indexed_datasets["npy"]
    base = shared_folder(tmp_path)
    good = FastDataset(src).get_batch(list(range(100)))[0].numpy()
    target = copy_path(base, src)
    planted = np.zeros_like(good)
    planted[0, 0, 0, 0] = 77  # wrong bytes, the right shape and size, at the predictable name
    np.save(target, planted)
    assert target.stat().st_size == 128 + good.nbytes
    with pytest.raises(OutputError, match=r"is not the file its creator stamped; remove it \(`fastdata shm remove"):
        FastDataset(src, storage="shm", shm_dir=base)
    info = {"id": target.stem[9:], "dataset": str(src), "stamp": shm._stamp(os.lstat(target))}
    target.with_suffix(".json").write_text(json.dumps(info))  # a forged stamp: only the bytes tell
    with pytest.raises(ChecksumError, match=r"does not match the dataset \(images-00000\.npy's rows differ\)"):
        FastDataset(src, storage="shm", shm_dir=base, verify=True)
    assert main(["shm", "remove", target.stem[9:], "--dir", str(base)]) == 0
    ds = FastDataset(src, storage="shm", shm_dir=base, verify=True)
    assert np.array_equal(ds.get_batch(list(range(100)))[0].numpy(), good)
    again = FastDataset(src, storage="shm", shm_dir=base, verify=True)  # a found copy, hashed before use
    assert np.array_equal(again.get_batch(list(range(100)))[0].numpy(), good)
    if os.geteuid() == 0:
        del ds, again
        os.chown(target, 12345, 12345)
        with pytest.raises(OutputError, match=r"belongs to uid 12345, not to this user"):
            FastDataset(src, storage="shm", shm_dir=base)


def test_a_fifo_or_folder_at_a_copys_names_neither_hangs_nor_breaks_the_advice(indexed_datasets, tmp_path):
    """A FIFO at a copy's record (.json) hung the open (storage="shm") and `fastdata shm list` for ever; a
    folder at the copy's name was refused with advice to `fastdata shm remove`, which then crashed with
    IsADirectoryError; a folder at a leftover temporary name did too."""
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import OutputError

    src = indexed_datasets["npy"]
    base = shared_folder(tmp_path)
    target = copy_path(base, src)
    good = FastDataset(src).get_batch([5])[0].numpy()
    np.save(target, np.zeros((100, 8, 8, 3), np.uint8))
    os.mkfifo(target.with_suffix(".json"))
    code = ("import sys; from fastdata.datasets.images import FastDataset; from fastdata.cli.main import main\n"
            "try:\n    FastDataset(sys.argv[1], storage='shm', shm_dir=sys.argv[2])\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n"
            "main(['shm', 'list', '--dir', sys.argv[2]])")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(base)], capture_output=True, text=True, timeout=60)
    assert "OutputError" in r.stdout and "is not the file its creator stamped" in r.stdout, r.stdout + r.stderr
    target.unlink()
    target.mkdir()  # a folder at the copy's name
    (target / "inside").write_bytes(b"x")
    with pytest.raises(OutputError, match=r"is not a regular file; remove it \(`fastdata shm remove"):
        FastDataset(src, storage="shm", shm_dir=base)
    assert main(["shm", "remove", target.stem[9:], "--dir", str(base)]) == 0  # the advice works
    assert not os.path.lexists(target) and not os.path.lexists(target.with_suffix(".json"))
    stale = target.with_name(target.name + ".tmp-1-planted")
    stale.mkdir()  # a folder at a temporary name: removed as a leftover
    assert np.array_equal(FastDataset(src, storage="shm", shm_dir=base).get_batch([5])[0].numpy(), good)
    assert not os.path.lexists(stale)


def test_a_nul_in_a_manifest_path_is_refused_as_a_path(indexed_datasets, tmp_path):
    """It gave a bare ValueError (embedded null byte) from the first system call."""
    import shutil

    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError

    shutil.copytree(indexed_datasets["npy"], tmp_path / "ds")
    m = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    m["shards"][1]["images"] = "images-00001.npy\u0000x"
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match=r"is not a plain relative path .*make the dataset again"):
        FastDataset(tmp_path / "ds")


def test_a_write_refused_by_what_is_in_the_way_says_what_to_remove(tmp_path):
    """'cannot write X: Is a directory' left the user to guess; the error now says what to do."""
    import errno

    from fastdata._io import disk_error, open_new

    (tmp_path / "images-00000.npy").mkdir()
    with pytest.raises(OSError) as caught:
        open(tmp_path / "images-00000.npy", "wb")
    said = str(disk_error(caught.value, tmp_path / "images-00000.npy"))
    assert f"remove the folder {tmp_path / 'images-00000.npy'}, which is in the way of a file" in said, said
    (tmp_path / "a-file").write_bytes(b"x")
    with pytest.raises(OSError) as caught:
        open(tmp_path / "a-file" / "inside.npy", "wb")
    assert "should be: remove that file" in str(disk_error(caught.value, tmp_path / "a-file" / "inside.npy"))
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError) as caught:
        open_new(tmp_path / "link")
    assert caught.value.errno in (errno.EEXIST, errno.ELOOP)  # (O_EXCL | O_NOFOLLOW: never through the link)


def test_preprocess_never_writes_through_a_link_in_out_and_names_what_is_in_the_way(tmp_path, capsys):
    """A link planted at a shard's temporary name in OUT was written through (the file it pointed to, outside
    OUT, overwritten with shard bytes); a folder in the way of a shard's name was reported at the temporary
    name (a path that does not exist: doing what the message said changed nothing)."""
    from fastdata.cli.main import main
    from fastdata.cli.synthetic import make_image_folder

    make_image_folder(tmp_path / "src", num_classes=2, per_class=6, sizes=((40, 32),))
    victim = tmp_path / "precious.txt"
    victim.write_text("not fastdata's file")
    out = tmp_path / "out"
    out.mkdir()
    (out / "images-00000.npy.tmp").symlink_to(victim)
    args = ["preprocess", "images", str(tmp_path / "src"), str(out), "--size", "16", "--shard-size", "4",
            "--workers", "1", "--quiet"]
    assert main(args) == 0
    assert victim.read_text() == "not fastdata's file"
    assert not (out / "images-00000.npy").is_symlink() and not os.path.lexists(out / "images-00000.npy.tmp")
    elsewhere = tmp_path / "elsewhere"  # a link at the journal's folder: the journal never written there
    elsewhere.mkdir()
    (elsewhere / "journal.jsonl").write_text("their own file")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / ".fastdata-partial").symlink_to(elsewhere)
    assert main(args[:3] + [str(tmp_path / "linked")] + args[4:]) == 0
    assert (elsewhere / "journal.jsonl").read_text() == "their own file"
    assert not os.path.lexists(tmp_path / "linked" / ".fastdata-partial")
    (tmp_path / "linked2").mkdir()  # and with --overwrite (rmtree refused the link: a traceback)
    (tmp_path / "linked2" / ".fastdata-partial").symlink_to(elsewhere)
    assert main(args[:3] + [str(tmp_path / "linked2")] + args[4:] + ["--overwrite"]) == 0
    assert (elsewhere / "journal.jsonl").read_text() == "their own file"
    other = tmp_path / "other"
    (other / "images-00001.npy").mkdir(parents=True)
    assert main(args[:3] + [str(other)] + args[4:]) != 0
    said = capsys.readouterr().err
    assert f"remove the folder {other / 'images-00001.npy'}, which is in the way of a file" in said, said
    (other / "images-00001.npy").rmdir()  # doing what it says
    assert main(args[:3] + [str(other)] + args[4:]) == 0


def test_planted_symlinks_are_never_followed(indexed_datasets, tmp_path):
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import OutputError
    from fastdata.storage import shm

    src = indexed_datasets["npy"]
    base = shared_folder(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = copy_path(base, src)
    lock = target.with_suffix(".lock")
    lock.symlink_to(victim)
    with pytest.raises(OutputError, match=rf"cannot create {lock}: .*remove it"):
        FastDataset(src, storage="shm", shm_dir=base)
    lock.unlink()
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}-planted")
    tmp.symlink_to(victim)  # at the temporary name: removed as a leftover, not written through
    ds = FastDataset(src, storage="shm", shm_dir=base)
    assert victim.read_bytes() == b"precious" and not os.path.lexists(tmp)
    assert np.array_equal(ds.get_batch([5])[0].numpy(), FastDataset(src).get_batch([5])[0].numpy())
    other = target.with_name("fastdata-0123456789abcdef.npy.tmp-1-x")
    other.symlink_to(victim)  # the very name a copier opens: O_EXCL | O_NOFOLLOW refuses it
    with pytest.raises(OutputError, match="appeared before this process created it"):
        shm._copy(src, {}, [], b"header", other)
    assert victim.read_bytes() == b"precious"


SLOW_COPY = """
    import sys, threading, time
    import fastdata.storage.shm as shm
    from fastdata.datasets.images import FastDataset
    blocks, said = shm.iter_blocks, threading.Lock()
    def stalled(path, start=0):  # the test's hook: each copying thread stops after its first file, mid-copy
        yield from blocks(path, start)
        if said.acquire(blocking=False):  # (said once: the threads' lines would interleave)
            print("copying", flush=True)
        time.sleep(600)
    shm.iter_blocks = stalled
    FastDataset(sys.argv[1], storage="shm", shm_dir=sys.argv[2])
"""


def test_a_killed_copiers_temporary_is_listed_and_removed(indexed_datasets, tmp_path, capsys):
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset

    src = indexed_datasets["npy"]
    base = shared_folder(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLOW_COPY), str(src), str(base)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "copying"
        capsys.readouterr()
        assert main(["shm", "list", "--dir", str(base)]) == 0
        assert "(partial: copying)" in capsys.readouterr().out  # its copier is alive: its lock is held
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    mine = base / f"fastdata-user-{os.getuid()}"
    assert len(list(mine.glob("*.npy.tmp-*"))) == 1
    assert main(["shm", "list", "--dir", str(base)]) == 0
    out = capsys.readouterr().out
    cid = out.split()[0]
    assert f"{src}  (partial: left by a killed copy)" in out
    assert main(["shm", "remove", cid, "--dir", str(base)]) == 0
    assert list(mine.iterdir()) == []
    ds = FastDataset(src, storage="shm", shm_dir=base)  # and the next copy is whole
    assert np.array_equal(ds.get_batch([99])[0].numpy(), FastDataset(src).get_batch([99])[0].numpy())


def test_a_killed_copiers_temporary_goes_with_the_next_copy(indexed_datasets, tmp_path):
    src = indexed_datasets["npy"]
    base = shared_folder(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SLOW_COPY), str(src), str(base)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "copying"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    from fastdata.datasets.images import FastDataset

    FastDataset(src, storage="shm", shm_dir=base)
    mine = base / f"fastdata-user-{os.getuid()}"
    assert not list(mine.glob("*.tmp-*")) and len(list(mine.glob("*.npy"))) == 1


# -- checkpoints --------------------------------------------------------------------------------------------


WRITER = """
    import sys, torch
    from pathlib import Path
    from fastdata.train import checkpoint
    folder, who = Path(sys.argv[1]), int(sys.argv[2])
    for i in range(25):
        checkpoint.write(folder / "checkpoint.pt", {"who": who, "i": i, "w": torch.full((50_000,), who * 1000.0 + i)})
"""


def _consistent(path: Path) -> bool:
    state = torch.load(path, weights_only=True)
    return bool((state["w"] == state["who"] * 1000.0 + state["i"]).all())


def test_two_checkpoint_writers_in_one_folder_never_leave_a_corrupt_checkpoint(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(tmp_path), str(who)])
             for who in (1, 2)]
    loads = 0
    while any(p.poll() is None for p in procs):  # read while they write: every name holds a whole file
        for name in ("checkpoint.pt", "checkpoint.prev.pt"):
            try:
                assert _consistent(tmp_path / name)
                loads += 1
            except FileNotFoundError:
                pass
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]  # no .tmp left
    assert _consistent(tmp_path / "checkpoint.pt") and _consistent(tmp_path / "checkpoint.prev.pt")


def _trainer(folder: Path, steps: int, resume: bool):
    from torch.utils.data import DataLoader, TensorDataset

    from fastdata.train.config import TrainConfig
    from fastdata.train.models import create_model
    from fastdata.train.trainer import Trainer

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(48, 3, 16, 16, generator=g), torch.randint(0, 3, (48,), generator=g))
    return Trainer(create_model("cnn-small", num_classes=3), DataLoader(data, batch_size=8),
                   config=TrainConfig(device="cpu", max_steps=steps, progress=False, checkpoint_dir=str(folder),
                                      resume=resume))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_and_says_so(tmp_path, caplog):
    _trainer(tmp_path, 2, False).fit()
    _trainer(tmp_path, 3, True).fit()
    assert torch.load(tmp_path / "checkpoint.prev.pt", weights_only=True)["step"] == 2
    newest = tmp_path / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # the disk lost its tail
    with caplog.at_level(logging.WARNING, logger="fastdata.train"):
        t = _trainer(tmp_path, 5, True)
    assert t.step == 2  # from the previous generation
    assert any("checkpoint.pt is damaged" in r.getMessage() and "resuming from the previous generation" in
               r.getMessage() and "checkpoint.prev.pt" in r.getMessage() for r in caplog.records), caplog.text
    t.fit()
    assert torch.load(newest, weights_only=True)["step"] == 5


def test_the_message_after_a_failed_save_says_what_is_kept(tmp_path):
    code = """
        import sys, torch
        from pathlib import Path
        from fastdata.errors import FastdataError
        from fastdata.train import checkpoint
        path = Path(sys.argv[1]) / "checkpoint.pt"
        if sys.argv[2] == "small":
            checkpoint.write(path, {"w": torch.zeros(10)})
        try:
            checkpoint.write(path, {"w": torch.zeros(100_000)})
        except FastdataError as e:
            print(e)
    """
    first = run_child(code, str(tmp_path), "none", preexec=disk_of(50_000)).stdout
    assert "no space left" in first and "no earlier checkpoint is there to resume from" in first, first
    assert "intact" not in first and list(tmp_path.iterdir()) == []
    later = run_child(code, str(tmp_path), "small", preexec=disk_of(50_000)).stdout
    assert "the previous checkpoint is intact (checkpoint.pt)" in later, later
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["w"].shape == (10,)


BOUNDED_STREAM = """
    import os, sys, numpy as np
    from fastdata import _limits
    _limits.room_for_maps = lambda count: False  # (as under a low hard limit on open files)
    _limits.bounded_maps = lambda: (16, "open files")
    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.tokens import TokenDataset
    kind, url, cache = sys.argv[1], sys.argv[2], sys.argv[3]

    def into_cache():  # descriptors, and maps of deleted (evicted) files, into the cache folder
        fds = sum(cache in os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                  if os.path.exists(f"/proc/self/fd/{fd}"))
        with open("/proc/self/maps") as f:
            return fds, sum(cache in line and "(deleted)" in line for line in f)
    if kind == "tokens":
        ds = TokenDataset(url, seq_len=40, cache_dir=cache, cache_limit=4000)
        for _ in range(2):  # the cache holds a few shards: each read again is fetched again
            for lo in range(0, len(ds), 7):
                idx = np.arange(lo, min(lo + 7, len(ds)))
                x, y = ds.get_batch(idx)
                assert np.array_equal(x.numpy(), ds.starts(idx)[:, None] + np.arange(40))
    elif kind == "npy":
        ds = FastDataset(url, cache_dir=cache, cache_limit=2000)
        for _ in range(2):
            for lo in range(0, len(ds), 5):
                x, y = ds.get_batch(np.arange(lo, min(lo + 5, len(ds))))
                assert y.tolist() == list(range(lo, min(lo + 5, len(ds))))
    else:  # fields: every field file mapped as batches read them too
        ds = FastDataset(url, cache_dir=cache)
        b = ds.get_batch(np.arange(len(ds)))
        assert b["index"].numpy().astype(int).tolist() == list(range(len(ds)))
        assert (b["image"].numpy() == np.arange(len(ds))[:, None, None, None]).all()
    print("held", *into_cache())
"""


@pytest.mark.remote
@pytest.mark.parametrize("kind", ["npy", "tokens", "fields"])
def test_streamed_shards_mapped_as_read_hold_no_evicted_file_and_bound_their_fields(s3, tmp_path, kind):
    """Bounded maps beside the node cache (NOTE [open files] 2): a shard the cache evicts is let go of (a map
    would keep its deleted file's disk past cache_limit), and a dataset's field files are bounded like its
    images (each field's maps as many as the bound, 16 here)."""
    from fastdata.storage.push import push

    if kind == "npy":
        root = many_shards(tmp_path / "ds", 60)
    elif kind == "tokens":
        root = many_token_shards(tmp_path / "ds", 60)
    else:
        import json

        from PIL import Image

        from fastdata.preprocess.images import ImagePreprocessConfig, preprocess_images

        (tmp_path / "img").mkdir()
        with open(tmp_path / "records.jsonl", "w") as f:
            for i in range(40):
                Image.fromarray(np.full((16, 16, 3), i, np.uint8)).save(tmp_path / "img" / f"{i}.png")
                f.write(json.dumps({"image": f"img/{i}.png", "index": float(i), "label": i % 5,
                                    "labels": [i] * (i % 4)}) + "\n")
        root = tmp_path / "ds"
        preprocess_images(ImagePreprocessConfig(tmp_path / "records.jsonl", root, size=16, shard_size=1,
                                                workers=1, progress=False))
    url = s3(f"bounded-{kind}") + "/ds"
    push(root, url, workers=4)
    r = run_child(BOUNDED_STREAM, kind, url, str(tmp_path / "cache"))
    fds, deleted = map(int, r.stdout.split()[1:])
    assert deleted == 0, f"{deleted} evicted files still mapped"
    # (fields: no cache_limit, so the pins' one file is opened as a batch's shards are pinned while read)
    assert fds <= (16 * 3 + 1 if kind == "fields" else 16), fds
