"""Faults of the node cache of streamed shards (NOTE [shard cache], NOTE [locks across fork]): a batch and a
prefetch meeting on the cache's room or on one shard, forked children holding locks, containers sharing a
cache in separate PID namespaces, a prefetch that fails, and the plan's memory at 10^9 samples. Real parts
throughout: the moto S3 server on 127.0.0.1 behind the loopback fault proxy, whose answers the tests hold
back to order the threads, real files and locks, real processes."""
from __future__ import annotations

import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.faults, pytest.mark.remote]

SHARDS = [f"images-{k:05d}.npy" for k in range(6)]  # the indexed dataset's full shards (16 samples, same size)


class GatedProxy:
    """The fault proxy (tests/s3_faults.py) in front of the moto server, holding back the body of every GET
    whose path contains a held name until the test lets it go: a download stays under way exactly as long
    as a test needs."""

    def __init__(self, upstream_port: int) -> None:
        from s3_faults import FaultProxy

        gates = self.gates = {}

        class Gated(FaultProxy):
            def _send(self, h, data) -> None:
                for name, gate in list(gates.items()):
                    if h.command == "GET" and name in h.path:
                        assert gate.wait(60), f"{name} held for a minute"
                super()._send(h, data)

        self.proxy = Gated(upstream_port)

    def hold(self, name: str) -> None:
        self.gates[name] = threading.Event()

    def let_go(self, name: str) -> None:
        self.gates.pop(name).set()

    def asked(self, name: str) -> int:
        """GETs of ``name`` answered by the store so far (a held one counts: its body waits at the gate)."""
        return sum(v for k, v in self.proxy.gets.items() if k.endswith("/" + name))

    def wait_asked(self, name: str, n: int = 1, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while self.asked(name) < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        for gate in self.gates.values():
            gate.set()
        self.proxy.close()


@pytest.fixture
def gated(s3, monkeypatch):
    import fsspec

    g = GatedProxy(s3.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", g.proxy.endpoint)
    fsspec.filesystem("s3").clear_instance_cache()
    yield g
    g.close()
    fsspec.filesystem("s3").clear_instance_cache()


def _pushed(s3, indexed_datasets, bucket: str) -> str:
    from fastdata.storage.push import push

    url = s3(bucket) + "/ds"
    push(indexed_datasets["npy"], url)
    return url


def _cache(url, tmp_path, *, limit_shards=None, requests=8):
    """A ShardCache over the image shards of ``url`` (one file each), mapping them as FastDataset does."""
    from fastdata.storage.cache import ShardCache
    from fastdata.storage.remote import RemoteDataset

    remote = RemoteDataset(url, cache_dir=tmp_path / "cache")
    remote.prepare(frozenset(f["path"] for f in remote.manifest["files"]))  # the folder and manifest only
    size = int(remote.entry(SHARDS[0])["bytes"])
    limit = None if limit_shards is None else limit_shards * size
    cache = ShardCache(remote, SHARDS, lambda s, path: np.load(path, mmap_mode="r"), limit=limit,
                       requests=requests, progress=False)
    return cache, remote, size


def _on_disk(remote) -> list[str]:
    return sorted(n for n in SHARDS if (remote.dir / n).is_file())


def _run(fn, *args):
    """``fn(*args)`` on a thread of its own; ``(thread, outcome)``: outcome holds its result or its error."""
    outcome = {}

    def body():
        try:
            outcome["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc
    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, outcome


@pytest.mark.filterwarnings("error")  # the "fetching beyond the limit" warning would be a failure
def test_a_batch_waits_for_prefetches_holding_the_room_instead_of_going_past_the_limit(
        s3, gated, indexed_datasets, tmp_path):
    """Issue 42 item 3's race, made to happen every time: the prefetches under way hold the whole room when a
    batch needs a shard nothing fetched. Before the fix the batch downloaded at once, past the limit (a
    ResourceWarning nobody saw); now it waits for them to land, evicts the one needed last and stays within
    the limit. It also meets a prefetch of its own shard: one download, waited for, never a second."""
    local = indexed_datasets["npy"]
    url = _pushed(s3, indexed_datasets, "room")
    cache, remote, size = _cache(url, tmp_path, limit_shards=2, requests=2)
    gated.hold(SHARDS[0])
    gated.hold(SHARDS[1])
    cache.plan(iter([np.array([0]), np.array([1]), np.array([2]), np.array([3])]))
    assert gated.wait_asked(SHARDS[0]) and gated.wait_asked(SHARDS[1])  # both prefetches under way: no room left
    t, outcome = _run(cache.acquire, np.array([3]))  # a batch reading shard 3, which no prefetch covers
    assert not gated.wait_asked(SHARDS[3], timeout=1.0), "the batch downloaded past the limit"
    gated.let_go(SHARDS[0])  # 0 lands: the batch evicts it (no coming batch reads it) and fetches 3
    t.join(30)
    assert not t.is_alive() and "error" not in outcome, outcome
    assert np.array_equal(outcome["result"][3], np.load(local / SHARDS[3]))
    gated.let_go(SHARDS[1])
    deadline = time.monotonic() + 30
    while SHARDS[1] not in _on_disk(remote) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _on_disk(remote) == [SHARDS[1], SHARDS[3]]
    cache.release(np.array([3]))

    # the next batch's shard is being prefetched: the batch waits for that download
    gated.hold(SHARDS[2])
    cache.release(cache.acquire(np.array([1])) is not None and np.array([1]))  # batch 1: shard 1, cached
    assert gated.wait_asked(SHARDS[2])
    t, outcome = _run(cache.acquire, np.array([2]))
    assert not gated.wait_asked(SHARDS[2], 2, timeout=0.5)
    gated.let_go(SHARDS[2])
    t.join(30)
    assert not t.is_alive() and "error" not in outcome, outcome
    assert np.array_equal(outcome["result"][2], np.load(local / SHARDS[2]))
    cache.release(np.array([2]))
    cache.close()
    assert gated.asked(SHARDS[2]) == 1 and gated.asked(SHARDS[3]) == 1
    assert len(_on_disk(remote)) <= 2 and not list(remote.dir.rglob("*.part-*"))
    assert cache.report()[0]["downloads"] == sum(gated.asked(n) for n in SHARDS)


def test_a_failed_prefetch_is_raised_at_the_next_batch_naming_the_shard(s3, gated, indexed_datasets, tmp_path,
                                                                       monkeypatch):
    from fastdata.errors import FormatError
    from fastdata.storage.plan import Plan

    url = _pushed(s3, indexed_datasets, "gone")
    cache, remote, _ = _cache(url, tmp_path)
    s3.client.delete_object(Bucket="gone", Key="ds/" + SHARDS[4])  # the object vanishes after the job opened it
    cache.plan(iter([np.array([0]), np.array([1]), np.array([0]), np.array([4])]))
    cache.release(cache.acquire(np.array([0])) is not None and np.array([0]))
    deadline = time.monotonic() + 30
    while cache._failed is None and time.monotonic() < deadline:  # the prefetch of shard 4 has failed
        time.sleep(0.01)
    with pytest.raises(FormatError, match=r"s3://gone/ds/images-00004\.npy") as err:
        cache.acquire(np.array([1]))  # the consumer's next batch, which does not read shard 4
    assert "\n" not in str(err.value)
    cache.release(cache.acquire(np.array([1])) is not None and np.array([1]))  # raised once, then reading goes on
    with pytest.raises(FormatError, match=r"images-00004\.npy"):
        cache.acquire(np.array([4]))  # the batch that reads it fails on its own download
    cache.close()

    # the prefetch thread itself failing (here: the loader's order raising while it is learnt) is no silent end
    monkeypatch.setattr(Plan, "CHUNK", 1)
    cache, _, _ = _cache(url, tmp_path / "again")

    def reads():
        yield np.array([0])
        raise RuntimeError("the order broke")
    cache.plan(reads())
    deadline = time.monotonic() + 30
    while cache._failed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="the order broke") as err:
        cache.acquire(np.array([0]))
    assert any("prefetch thread of s3://gone/ds" in note for note in err.value.__notes__)
    cache.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_neither_pins_nor_a_download_in_flight(s3, gated, indexed_datasets,
                                                                   tmp_path):
    """A child forked while the parent holds a shard pinned and a download under way (a DataLoader worker
    started mid-epoch): the child waits for that download like any other process and does not hang; the
    parent evicts the shard it pinned while the child lives, and finishes its download."""
    from fastdata.storage.cache_locks import ShardPins

    local = indexed_datasets["npy"]
    url = _pushed(s3, indexed_datasets, "fork")
    cache, remote, _ = _cache(url, tmp_path, limit_shards=3)
    cache.acquire(np.array([0]))  # shard 0 pinned (its pin file locked shared)
    gated.hold(SHARDS[1])
    t, outcome = _run(cache.acquire, np.array([1]))
    assert gated.wait_asked(SHARDS[1])  # its download under way: the download lock held
    evicted_r, evicted_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os._exit leaves it
        code = 1
        try:
            signal.alarm(60)  # a hang ends the child, with a failure
            os.close(evicted_w)
            fetched = remote.get(remote.entry(SHARDS[1]))  # waits for the parent's download, then finds it there
            intact = (remote.dir / SHARDS[1]).read_bytes() == (local / SHARDS[1]).read_bytes()
            os.read(evicted_r, 1)  # alive until the parent has evicted shard 0
            code = 0 if (fetched is False and intact) else 2
        finally:
            os._exit(code)
    os.close(evicted_r)
    try:
        time.sleep(0.2)  # (the child is at its wait for the download lock)
        gated.let_go(SHARDS[1])
        t.join(30)
        assert not t.is_alive() and "error" not in outcome, outcome
        assert np.array_equal(outcome["result"][1], np.load(local / SHARDS[1]))
        cache.release(np.array([0]))
        other = ShardPins(remote.dir / ".locks")  # another reader's view: the pin is free though the child lives
        with other.evicting(SHARDS[0]) as free:
            assert free
        other.close()
        assert cache._evict(0) and not (remote.dir / SHARDS[0]).exists()
        os.write(evicted_w, b"x")
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done[0] == pid, "the forked child hung"
        pid = None
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        os.close(evicted_w)
        if pid is not None:  # (hung: it goes)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    cache.release(np.array([1]))
    cache.close()


def test_on_disk_agrees_with_a_stat_of_every_file_among_odd_things_in_the_folder(tmp_path):
    """The cache's look at its folder (a listing of each folder, not a stat a file): nested paths, a shard of
    two files with one missing, a folder or a dangling link where a file should be; a link to a file, and a
    folder that is a link (to files outside), are not cached files (NOTE [shard cache] 20)."""
    import os

    from fastdata.storage.cache_folders import on_disk
    from fastdata.storage.streamed import FileGroups

    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/b/x.npy", "a/b/y.npy", "top.npy"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "dir.npy").mkdir()
    os.symlink(tmp_path / "top.npy", tmp_path / "link.npy")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling.npy")
    (tmp_path / "c").write_bytes(b"a file where a folder should be")
    os.symlink(tmp_path / "top.npy" / "x", tmp_path / "through.npy")  # a link through a file: ENOTDIR
    os.symlink(tmp_path / "loop.npy", tmp_path / "loop.npy")  # ELOOP
    for k in range(50):  # (listed after those links too: none may be lost)
        (tmp_path / f"more-{k:02d}.npy").write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "x.npy").write_bytes(b"x")
    os.symlink(outside, tmp_path / "a" / "linked")  # a folder that is a link, to files outside the cache
    groups = [(f"more-{k:02d}.npy",) for k in range(50)] + [("through.npy",), ("loop.npy",)]
    groups += [("a/b/x.npy", "a/b/y.npy"), ("a/b/x.npy", "a/b/z.npy"), ("top.npy",), ("dir.npy",), ("link.npy",),
               ("dangling.npy",), ("c/none.npy",), ("top.npy", "a/b/y.npy"), ("d/e.npy",), ("a/linked/x.npy",)]
    def cached(n: str) -> bool:
        return (tmp_path / n).is_file() and not (tmp_path / n).is_symlink() and "linked" not in n

    want = [all(map(cached, g)) for g in groups]
    assert want == [True] * 50 + [False, False] + [True, False, True, False, False, False, False, True, False, False]
    subfolders = {os.path.dirname(n) for g in groups for n in g}
    assert FileGroups.of(groups).present(on_disk(tmp_path, subfolders)).tolist() == want
    singles = [g[:1] for g in groups]  # (one file a shard)
    assert FileGroups.of(singles).present(on_disk(tmp_path, subfolders)).tolist() == [cached(g[0]) for g in singles]
    assert FileGroups.of([]).present(on_disk(tmp_path, ())).tolist() == []


def test_a_look_at_the_disk_sees_other_processes_and_keeps_what_this_one_learnt_meanwhile(s3, indexed_datasets,
                                                                                         tmp_path):
    """Another process fetches a shard and evicts one: the next look at the disk (due after a second) counts
    both. A shard this process learnt about while the look was under way keeps what it learnt, whatever the
    listing (made before) says."""
    import threading

    url = _pushed(s3, indexed_datasets, "rescan")
    cache, remote, _ = _cache(url, tmp_path, limit_shards=3)
    with cache.reading(np.array([0])):
        pass
    assert cache._have.tolist()[:2] == [True, False]
    script = tmp_path / "fetch.py"
    script.write_text(_FETCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run([sys.executable, str(script), url, str(tmp_path / "cache"), SHARDS[1]], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    with cache._cond:
        cache._close(0)
    (remote.dir / SHARDS[0]).unlink()  # (as another process's eviction)
    cache._scanned = time.monotonic() + 60  # (as if it had just looked: the next look is not due)
    cache._rescan()
    assert cache._have.tolist()[:2] == [True, False]
    cache._scanned = time.monotonic() - 2  # (due)
    cache._rescan()
    assert cache._have.tolist()[:3] == [False, True, False]
    listed, go = threading.Event(), threading.Event()
    real = cache.cached

    def slow():  # the listing made, then held back until this process has learnt of shard 2
        seen = real()
        listed.set()
        go.wait(30)
        return seen
    cache.cached = slow
    cache._scanned = time.monotonic() - 2
    t, outcome = _run(cache._rescan)
    assert listed.wait(30)
    with cache.reading(np.array([2])):  # fetched by this process while the look is under way
        go.set()
        t.join(30)
        assert not t.is_alive() and "error" not in outcome
        assert cache._have.tolist()[:3] == [False, True, True]
    cache.close()


@pytest.mark.parametrize("warm", [True, False])
def test_a_cache_without_a_limit_pins_a_shard_while_it_opens_it(s3, indexed_datasets, tmp_path, warm):
    """A cache without a limit took no pins, so another job with one, sharing the folder, evicted a shard between
    its look at the disk and its map: a raw FileNotFoundError from FastDataset() (a warm cache maps every shard up
    front) or from a batch. It pins a shard while it opens it now; one evicted before its pin is fetched again."""
    from fastdata.storage.cache import ShardCache

    url = _pushed(s3, indexed_datasets, f"unpinned-{'warm' if warm else 'cold'}")
    other, remote, size = _cache(url, tmp_path, limit_shards=len(SHARDS))  # the other job, with a limit
    if warm:
        for s in range(len(SHARDS)):
            with other.reading(np.array([s])):
                pass
    opened_while = []

    def opener(s, path):  # the other job evicts all it may just before each map: the worst moment
        other.set_limit(1)
        opened_while.append(_on_disk(remote))
        return np.load(path, mmap_mode="r")
    cache = ShardCache(remote, SHARDS, opener, progress=False)
    for s in range(len(SHARDS)):
        with cache.reading(np.array([s])) as opened:
            assert np.array_equal(opened[s], np.load(indexed_datasets["npy"] / SHARDS[s]))
    assert opened_while and all(len(names) <= 1 for names in opened_while)  # (it evicted all but the one opening)
    cache.close()
    other.close()


def test_a_cache_without_a_limit_mapping_as_read_pins_a_batchs_shards_only_while_it_reads(s3, indexed_datasets,
                                                                                          tmp_path):
    """Shards mapped as read (LMDB, bounded maps) by a job without a limit: evicted by another job between their
    look and their read (a raw FileNotFoundError), or, pinned for as long as they were open, a lock held for
    every shard of the dataset (10^5 of them: minutes of locking). A batch's shards are pinned while it reads
    them; one evicted since it was opened is fetched again."""
    from fastdata.storage.cache import ShardCache

    url = _pushed(s3, indexed_datasets, "unpinned-lazy")
    other, remote, size = _cache(url, tmp_path, limit_shards=len(SHARDS))  # the other job, with a limit
    cache = ShardCache(remote, SHARDS, lambda s, path: path, progress=False, eager=False)  # (maps nothing)
    for _ in range(2):  # (the second time every shard is open, and every file evicted meanwhile)
        for s in range(len(SHARDS)):
            with cache.reading(np.array([s])) as opened:
                other.set_limit(1)  # the other job evicts all it may while this batch reads
                assert np.array_equal(np.load(opened[s]), np.load(indexed_datasets["npy"] / SHARDS[s]))
            assert not cache._held.any()  # (no pin kept between batches)
    cache.close()
    other.close()


@pytest.mark.parametrize("limit", [None, 20_000])
def test_a_shard_damaged_in_the_cache_is_fetched_anew_not_blamed_on_the_dataset(s3, indexed_datasets, tmp_path,
                                                                                limit):
    """A flipped byte in a cached shard, opened with verify=True, said "run `fastdata verify` and re-run `fastdata
    preprocess`": wrong, the store is intact. The shard is fetched anew once; damaged while another job reads it
    (so not removed), the error says to remove the dataset from the node cache."""
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import ChecksumError
    from fastdata.storage.cache_locks import ShardPins

    url = _pushed(s3, indexed_datasets, f"damaged-{limit}")
    local = FastDataset(indexed_datasets["npy"])
    every = np.arange(len(local))
    with FastDataset(url, cache_dir=tmp_path / "cache") as ds:
        ds.get_batch(every)
        shard = ds.root / SHARDS[2]
    good = shard.read_bytes()

    def damage() -> None:
        body = bytearray(good)
        body[-1] ^= 0xFF  # bit rot on the node's disk
        shard.write_bytes(bytes(body))
    damage()
    with FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=limit, verify=True) as ds:
        for got, want in zip(ds.get_batch(every), local.get_batch(every)):
            assert np.array_equal(got.numpy(), want.numpy())
    assert shard.read_bytes() == good
    damage()
    pins = ShardPins(shard.parent / ".locks")
    pins.pin(SHARDS[2])  # another job reads it: not removed under it
    try:
        with pytest.raises(ChecksumError) as err:
            with FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=limit, verify=True) as ds:
                ds.get_batch(every)
    finally:
        pins.close()
    msg = str(err.value)
    assert SHARDS[2] in msg and "node cache" in msg and "fastdata cache remove" in msg, msg
    assert "preprocess" not in msg and "fastdata verify" not in msg and "\n" not in msg, msg
    if limit is None:  # read whole into memory (storage="ram"): the same advice
        with pytest.raises(ChecksumError) as err:
            FastDataset(url, cache_dir=tmp_path / "cache", storage="ram")
        msg = str(err.value)
        assert SHARDS[2] in msg and "fastdata cache remove" in msg and "preprocess" not in msg, msg


def test_a_lower_limit_counts_what_other_processes_fetched(s3, indexed_datasets, tmp_path):
    """A cache opened without a limit gets one (a Mixture re-splitting its node budget) after other ranks
    fetched shards into the shared folder: they count at once, and the folder comes down to the limit
    (since the look at the disk left the room decisions, before this fix: never, while all was cached)."""
    url = _pushed(s3, indexed_datasets, "set-limit")
    cache, remote, size = _cache(url, tmp_path)
    with cache.reading(np.array([0])):
        pass
    script = tmp_path / "fetch.py"
    script.write_text(_FETCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    for name in SHARDS[1:4]:  # another rank fetches three more
        done = subprocess.run([sys.executable, str(script), url, str(tmp_path / "cache"), name], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(_on_disk(remote)) == 4
    cache.set_limit(2 * size)
    assert len(_on_disk(remote)) == 2
    with cache.reading(np.array([0])) as opened:
        assert np.array_equal(opened[0], np.load(indexed_datasets["npy"] / SHARDS[0]))
    assert len(_on_disk(remote)) <= 2
    cache.close()


def test_the_disk_is_looked_at_while_a_plan_is_read_not_after(s3, indexed_datasets, tmp_path):
    """The scheduler looks at the disk again while a plan is read (at most once a second), and stops once no
    plan is left (a listing is 0.4 s at 10^6 shards: not for the life of an idle dataset)."""
    url = _pushed(s3, indexed_datasets, "idle")
    cache, remote, _ = _cache(url, tmp_path, limit_shards=3)
    token = cache.plan(iter([np.array([0]), np.array([1])]))
    with cache.reading(np.array([0])):
        pass
    first, deadline = cache._scanned, time.monotonic() + 30
    while cache._scanned == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache._scanned > first  # (looked again while the plan is read)
    cache.end_plan(token)
    time.sleep(1.5)  # (a look the scheduler began as the plan ended comes to its end)
    while cache._scanning:
        time.sleep(0.05)
    idle = cache._scanned
    time.sleep(2.5)  # (more than twice the time between looks while a plan was read)
    assert cache._scanned == idle
    with cache.reading(np.array([1])):  # a batch without a plan looks itself
        pass
    assert cache._scanned > idle
    cache.close()


_READER = """
import sys, warnings
import numpy as np, torch
from fastdata.datasets.images import FastDataset
from fastdata.loading.loader import FastLoader
url, cache, local, limit, seed = sys.argv[1:6]
warnings.simplefilter("ignore", ResourceWarning)  # (three readers' shards in use pass the small limit: said)
ds, ref = FastDataset(url, cache_dir=cache, cache_limit=int(limit)), FastDataset(local)
rng = np.random.default_rng(int(seed))
for _ in range(40):  # batches without a plan: each pins its shards, evicts others' unpinned ones
    lo = int(rng.integers(0, len(ds) - 24))
    idx = np.arange(lo, lo + 24)
    assert all(torch.equal(a, b) for a, b in zip(ds.get_batch(idx), ref.get_batch(idx))), idx
for epoch in range(2):  # and a loader's epochs (a plan, prefetches)
    for k, got in enumerate(FastLoader(ds, batch_size=10, shuffle=False, num_threads=2)):
        want = ref.get_batch(np.arange(k * 10, min(k * 10 + 10, len(ds))))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (epoch, k)
print("read", len(ds))
"""


def test_three_processes_reading_through_one_small_cache_serve_every_batch_exactly(s3, indexed_datasets, tmp_path):
    """Three readers (three ranks of a node) share a cache folder whose limit holds 3 of the 7 shards: each
    evicts what the others do not pin, and never what they read (their pins on one file), so every batch
    comes back bit-exact and no read finds its shard gone."""
    url = _pushed(s3, indexed_datasets, "three")
    size = (indexed_datasets["npy"] / SHARDS[0]).stat().st_size + \
        (indexed_datasets["npy"] / SHARDS[0].replace("images", "labels")).stat().st_size
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    readers = [subprocess.Popen([sys.executable, "-c", _READER, url, str(tmp_path / "cache"),
                                 str(indexed_datasets["npy"]), str(3 * size), str(k)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(3)]
    for r in readers:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0 and out.split() == ["read", "100"], err[-3000:]


_PIN_CHILD = """
import fcntl, sys
from pathlib import Path
if sys.argv[2] == "flock":
    del fcntl.F_OFD_GETLK  # (as where the system has none)
from fastdata.storage.cache_locks import ShardPins
pins = ShardPins(Path(sys.argv[1]))
with pins.evicting("a/x.npy") as free:
    print("x", free, flush=True)
pins.pin("z.npy")
print("pinned", flush=True)
sys.stdin.read()  # held until killed
"""


@pytest.mark.parametrize("kind", ["ofd", "flock"])
def test_shard_pins_keep_evictions_off_shards_in_use_across_objects_and_processes(tmp_path, monkeypatch, kind):
    """A pinned shard cannot be evicted by another cache in this process or by another process; a killed
    reader's pins go with it; a pin waits for an eviction under way. ``flock``: the pin file per shard used
    where the system has no open-file-description locks, run for real."""
    import fcntl

    from fastdata.storage.cache_locks import ShardPins

    if kind == "flock":
        monkeypatch.delattr(fcntl, "F_OFD_GETLK")
    folder = tmp_path / ".locks"
    folder.mkdir()
    a, b = ShardPins(folder), ShardPins(folder)
    a.pin("a/x.npy")
    a.pin("y.npy")

    def free(pins, name):
        with pins.evicting(name) as ok:
            return ok
    assert not free(b, "a/x.npy") and not free(b, "y.npy") and free(b, "z.npy")
    child = subprocess.Popen([sys.executable, "-c", _PIN_CHILD, str(folder), kind], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(Path(__file__).parent.parent), *sys.path])})
    try:
        assert child.stdout.readline().split() == ["x", "False"]  # the other process sees this one's pin
        assert child.stdout.readline().strip() == "pinned"
        assert not free(a, "z.npy") and not free(b, "z.npy")  # and this one sees the other's
    finally:
        child.kill()
        child.wait()
    assert free(a, "z.npy") and free(b, "z.npy")  # a killed reader's pins went with it
    a.unpin("a/x.npy")
    assert free(b, "a/x.npy") and not free(b, "y.npy")
    with b.evicting("w.npy") as ok:  # an eviction under way: a pin of that shard waits for it to end
        assert ok
        t, outcome = _run(a.pin, "w.npy")
        t.join(0.3)
        assert t.is_alive()
    t.join(10)
    assert not t.is_alive() and "error" not in outcome
    assert not free(b, "w.npy")
    a.close()
    assert free(b, "y.npy") and free(b, "w.npy")  # closed: every pin let go
    b.close()


def test_shards_whose_names_share_a_pin_byte_stay_pinned_while_either_is_read(tmp_path, monkeypatch):
    """Two names hashing to one byte (forced here: 1 in 10^7 at 10^6 shards): unpinning one leaves the other
    pinned (before: the byte was let go, and another reader could evict the shard still read), and this
    object never takes the byte to evict while it pins a shard on it."""
    from fastdata.storage import cache_locks
    from fastdata.storage.cache_locks import ShardPins

    monkeypatch.setattr(cache_locks, "_OFFSETS", 0)  # every name on byte 0
    a, b = ShardPins(tmp_path), ShardPins(tmp_path)
    if not a._open():
        pytest.skip("no open-file-description locks here: a pin is a file of its own")
    a.pin("s1.npy")
    a.pin("s2.npy")
    a.unpin("s1.npy")
    with b.evicting("s2.npy") as free:
        assert not free
    with a.evicting("s3.npy") as free:
        assert not free  # (taking the byte would turn s2's pin into the eviction's lock, then drop it)
    with b.evicting("s2.npy") as free:
        assert not free  # ... and s2 is still pinned after that
    a.unpin("s2.npy")
    with b.evicting("s2.npy") as free:
        assert free
    a.close()
    b.close()


def test_10000_pins_hold_one_descriptor():
    """A batch over 10,000 shards of a limited cache pins each (before 2026-11-27: a pin file each, so a batch
    over ~1,000 shards failed under a limit of 1,024 open files)."""
    import tempfile

    from fastdata.storage.cache_locks import ShardPins

    with tempfile.TemporaryDirectory() as folder:
        pins, other = ShardPins(Path(folder)), ShardPins(Path(folder))
        if not pins._open():
            pytest.skip("no open-file-description locks here: a pin is a file of its own")
        before = len(os.listdir("/proc/self/fd"))
        names = [f"train/images-{i:07d}.npy" for i in range(10_000)]
        for name in names:
            pins.pin(name)
        assert len(os.listdir("/proc/self/fd")) == before  # (both files open since each was made: a reader's)
        for name in names[::97]:
            with other.evicting(name) as ok:
                assert not ok, name
        for name in names:
            pins.unpin(name)
        for name in names[::97]:
            with other.evicting(name) as ok:
                assert ok, name
        pins.close()
        other.close()


@pytest.mark.parametrize("kind", ["ofd", "flock"])
def test_a_folder_held_whole_keeps_every_eviction_off_it_and_waits_for_one_under_way(tmp_path, monkeypatch, kind):
    """A reader of every file (storage="ram") holds the cache folder whole: no eviction of any shard, by another
    object or another process, until it lets go; holding waits for an eviction under way to end (its files
    are then fetched again), and evictions do not exclude each other (OFD locks: a test, not a lock)."""
    import fcntl

    from fastdata.storage.cache_locks import ShardPins

    if kind == "flock":
        monkeypatch.delattr(fcntl, "F_OFD_GETLK")
    folder = tmp_path / ".locks"
    folder.mkdir()
    a, b, c = ShardPins(folder), ShardPins(folder), ShardPins(folder)

    def free(pins, name):
        with pins.evicting(name) as ok:
            return ok
    with b.evicting("w.npy") as ok:  # an eviction under way: holding the folder waits for it to end
        assert ok
        if kind == "ofd":
            assert free(c, "v.npy")  # (another eviction meanwhile is not refused)
        t, outcome = _run(a.hold_all)
        t.join(0.3)
        assert t.is_alive()
    t.join(10)
    assert not t.is_alive() and "error" not in outcome
    assert not free(b, "w.npy") and not free(c, "any/other.npy") and not free(a, "x.npy")
    with subprocess.Popen([sys.executable, "-c", _PIN_CHILD, str(folder), kind], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(__file__).parent.parent), *sys.path])}) as child:
        try:
            assert child.stdout.readline().split() == ["x", "False"]  # another process may evict nothing either
        finally:
            child.kill()
    a.close()
    assert free(b, "w.npy") and free(c, "any/other.npy")  # let go of
    b.close()
    c.close()


_EVICTOR = """
import os, sys
from fastdata.datasets.images import FastDataset
ds = FastDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=1)  # another job, of a limit of one byte
ds.set_cache_limit(1)  # evicts every shard it may at once
print(*sorted(n for n in os.listdir(ds.root) if n.startswith("images-")))
"""


def _other_job(url: str, cache: Path) -> list[str]:
    """`_EVICTOR` run as another process (another job sharing the cache): the shards left after it evicted."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", _EVICTOR, url, str(cache)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


@pytest.mark.parametrize("storage", ["ram", "shm"])
def test_a_reader_of_every_file_keeps_them_from_a_job_with_a_limit_sharing_its_cache(s3, indexed_datasets, tmp_path,
                                                                                     monkeypatch, storage):
    """storage="ram" (or "shm", "cuda") downloads every file, then reads them: another job with a cache_limit
    sharing the cache folder evicted them in between, and the reader died with "images-00000.npy is missing:
    the dataset is incomplete; re-run `fastdata preprocess`" (the store's copy intact). The other job runs, as
    another process, at that worst moment (just before the shards are read): it evicts none of them now, and
    all of them once the reader is closed. A file missing from a node cache is said to be the cache's."""
    from fastdata.datasets.images import FastDataset
    from fastdata.errors import FormatError
    from fastdata.storage import images

    url = _pushed(s3, indexed_datasets, f"whole-{storage}")
    cache = tmp_path / "cache"
    other_job = functools.partial(_other_job, url, cache)
    seen = []
    real = images.open_shards

    def open_shards(*args, **kwargs):  # (the shards downloaded, not read yet: the other job runs now)
        seen.append(other_job())
        return real(*args, **kwargs)
    monkeypatch.setattr(images, "open_shards", open_shards)
    (tmp_path / "shm").mkdir(mode=0o700)
    ds = FastDataset(url, cache_dir=cache, storage=storage, shm_dir=tmp_path / "shm")
    local = FastDataset(indexed_datasets["npy"])
    assert seen and all(names == [f"images-{k:05d}.npy" for k in range(7)] for names in seen)  # none evicted
    for a, b in zip(ds.get_batch(range(100)), local.get_batch(range(100))):
        assert np.array_equal(a.numpy(), b.numpy())
    monkeypatch.setattr(images, "open_shards", real)
    ds.close()
    assert other_job() == []  # closed: let go of
    if storage == "ram":  # a reader of the opened dataset finds a file gone from the cache: the cache's advice
        with pytest.raises(FormatError, match=r"images-00000\.npy is missing") as err:
            FastDataset(ds._opened, storage=storage)
        assert "fastdata cache remove " + ds._opened.remote.id in str(err.value), str(err.value)
        assert "preprocess" not in str(err.value), str(err.value)


def test_two_readers_of_one_opened_path_each_hold_the_folder_until_each_is_closed(s3, indexed_datasets, tmp_path):
    """The hold was the opened path's: closing one of two readers of it let go of the other's, and a job with a
    limit then evicted the files the other still reads (a spawned worker of it: "images-00000.npy is
    missing")."""
    from fastdata.datasets.images import FastDataset

    url = _pushed(s3, indexed_datasets, "whole-two")
    cache = tmp_path / "cache"
    other_job = functools.partial(_other_job, url, cache)
    first = FastDataset(url, cache_dir=cache, storage="ram")
    second = FastDataset(first._opened, storage="ram")
    second.close()
    assert other_job() == [f"images-{k:05d}.npy" for k in range(7)]  # the first still holds every file
    first.close()
    assert other_job() == []


_FETCH = """
import sys
from fastdata.storage.remote import RemoteDataset
remote = RemoteDataset(sys.argv[1], cache_dir=sys.argv[2])
remote.prepare(frozenset(f["path"] for f in remote.manifest["files"]))
if sys.argv[3] != "-":
    remote.fetch(remote.entry(sys.argv[3]))
"""


def _namespaces() -> bool:
    """Whether this machine lets a test start processes in PID namespaces of their own (root, or user
    namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--", "sh", "-c", "exit 0"], capture_output=True)
    return probe.returncode == 0


def test_containers_sharing_a_cache_never_delete_each_others_live_download(s3, gated, indexed_datasets,
                                                                          tmp_path):
    """Two processes in separate PID namespaces (containers on one node) share a cache: one is downloading a
    shard while the other opens the dataset and clears leftovers. The downloader's pid (about 200 in its
    namespace) names no process in the other's, so judging by pid deleted the live download, and the pid
    in a killed download's name (1) named the cleaner itself, so that leftover stayed; judged by their
    locks, the live one stays and completes and the dead one goes. Without PID namespaces here, the collision is
    made by hand: a live download (its lock held by a real process) whose name carries a dead pid."""
    local = indexed_datasets["npy"]
    url = _pushed(s3, indexed_datasets, "containers")
    cache_dir = tmp_path / "cache"
    script = tmp_path / "fetch.py"
    script.write_text(_FETCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    run = [sys.executable, str(script), url, str(cache_dir)]
    gated.hold(SHARDS[2])
    if _namespaces():  # the downloader is pid 200 or so of its namespace, where 200 processes ran before it; the
        # cleaner is pid 1 of another, whose few tasks (it and its threads) have small ids
        downloader = subprocess.Popen(["unshare", "--pid", "--fork", "--", "sh", "-c", 'for i in $(seq 200); do '
                                       '/bin/true; done; "$@"; exit $?', "sh", *run, SHARDS[2]], env=env,
                                      stderr=subprocess.PIPE, text=True)
        cleaner = ["unshare", "--pid", "--fork", "--", *run, "-"]
    else:
        downloader = subprocess.Popen([*run, SHARDS[2]], env=env, stderr=subprocess.PIPE, text=True)
        cleaner = [*run, "-"]
    try:
        from fastdata.storage.remote import RemoteDataset

        folder = RemoteDataset(url, cache_dir=cache_dir).dir
        assert gated.wait_asked(SHARDS[2], timeout=60)  # its body held back: the download is live
        parts = list(folder.glob(SHARDS[2] + ".part-*"))
        assert len(parts) == 1, parts
        live = parts[0]
        if not _namespaces():  # the same download as another namespace would name it: a pid dead here
            dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True)
            live = parts[0].rename(folder / f"{SHARDS[2]}.part-{int(dead.stdout)}-0bad")
        done = subprocess.run(cleaner, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert live.exists(), "the other process deleted a live download"
        live.rename(parts[0])  # (its downloader renames it by its own name)
    finally:
        gated.let_go(SHARDS[2])
    _, err = downloader.communicate(timeout=120)
    assert downloader.returncode == 0, err[-2000:]
    assert (folder / SHARDS[2]).read_bytes() == (local / SHARDS[2]).read_bytes()
    # a killed download's leftover (its lock free) still goes, whatever pid its name carries
    leftover = folder / f"{SHARDS[3]}.part-1-dead"
    leftover.write_bytes(b"half a download")
    done = subprocess.run(cleaner, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not leftover.exists()


def test_a_plain_shuffle_over_more_shards_than_the_cache_holds_warns_once(s3, indexed_datasets, tmp_path):
    import warnings

    from fastdata.datasets.images import FastDataset
    from fastdata.loading.loader import FastLoader

    url = _pushed(s3, indexed_datasets, "plain")
    group = sum((indexed_datasets["npy"] / f"{k}-00000.npy").stat().st_size for k in ("images", "labels"))
    ds = FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=4 * group)  # 4 of the 7 shards fit
    with pytest.warns(UserWarning, match=r"cache_limit=\d+ bytes holds about 4 of the 7 shards.*shuffle_window") \
            as caught:
        for _ in FastLoader(ds, 4, seed=1, num_threads=1):
            pass
    assert [w.filename for w in caught if "shuffle_window" in str(w.message)] == [__file__]  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for epoch in range(2):  # once per dataset
            loader = FastLoader(ds, 4, seed=1, num_threads=1)
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        for _ in FastLoader(FastDataset(url, cache_dir=tmp_path / "c2", cache_limit=4 * group), 4, seed=1,
                            shuffle_window=2, num_threads=1):
            pass  # a windowed shuffle reads a few shards at a time: no warning
        for _ in FastLoader(FastDataset(url, cache_dir=tmp_path / "c3", cache_limit=7 * group), 4, seed=1,
                            num_threads=1):
            pass  # the cache holds every shard: no warning


def _plain_shuffle_reads(samples: int, per_shard: int, batch: int, seed: int = 0):
    """The shards a plain shuffle's batches read: uniformly random samples (what a permutation's batches look
    like to a cache), made a batch at a time."""
    rng = np.random.default_rng(seed)
    for start in range(0, samples, batch):
        yield rng.integers(0, samples, size=min(batch, samples - start)) // per_shard


def _plan_bytes(shards: int, horizon_runs: int, batch: int, learning: bool = False) -> int:
    """The plan's memory at its largest: its runs (the horizon ahead of the reader, plus the one chunk that
    may overshoot it, plus the runs the reader is in: at most a batch's) and its per-shard arrays; while a
    chunk is learnt (``learning``), also what the learn holds beside them (plan.py counts it)."""
    from fastdata.storage.plan import LEARN_READ_BYTES, LEARN_RUN_BYTES, LEARN_SHARD_BYTES, RUN_BYTES, SHARD_BYTES, Plan

    runs = horizon_runs + Plan.CHUNK + batch
    if not learning:
        return runs * RUN_BYTES + shards * SHARD_BYTES + 8
    return (runs * (RUN_BYTES + LEARN_RUN_BYTES) + shards * (SHARD_BYTES + LEARN_SHARD_BYTES)
            + Plan.CHUNK * LEARN_READ_BYTES)


def test_the_plan_of_a_plain_shuffle_over_10_9_samples_stays_under_200_mb():
    """Issue 42 item 10, by arithmetic: 10^9 samples in shards of 1,024 (the default), batches of 256, a
    plain shuffle, a cache_limit of any size. Unbounded, the plan held a run per read: 2 * 10^9 runs over
    two epochs, 64 GB. Bounded by its horizon it holds at most HORIZON_RUNS + a chunk + a batch of runs,
    RUN_BYTES each, and SHARD_BYTES per shard; learning a chunk briefly takes what plan.py counts beside."""
    from fastdata.storage.plan import HORIZON_RUNS, RUN_BYTES, horizon

    samples, per_shard, batch = 10 ** 9, 1024, 256
    shards = -(-samples // per_shard)
    sizes = np.full(shards, per_shard * 224 * 224 * 3, dtype=np.int64)  # 224x224 RGB: 154 MB a shard
    assert horizon(None, sizes) == horizon(int(sizes.sum()), sizes) == HORIZON_RUNS  # a cache of any size
    assert horizon(int(sizes[0]) * 1000, sizes) == 4000  # (a 1,000-shard cache: 4 caches ahead)
    steady, learning = _plan_bytes(shards, HORIZON_RUNS, batch), _plan_bytes(shards, HORIZON_RUNS, batch, True)
    assert steady < 60e6 and learning < 200e6, (steady, learning)  # (59 MB, and 184 MB while a chunk is learnt)
    assert 2 * samples * RUN_BYTES > 60e9  # what it was


@pytest.mark.slow
def test_a_plain_shuffle_over_the_shards_of_10_8_samples_keeps_the_plan_within_its_horizon():
    """The plan of two epochs of a plain shuffle over the 97,657 shards of 10^8 samples (at 1,024 a shard)
    learnt as the scheduler learns it while a reader moves on: its arrays never exceed the arithmetic's bound
    at this size, and Python's allocations while learning (tracemalloc: numpy reports its arrays to it) never
    exceed the bound while learning. The bound counts shards and the horizon's runs, not samples: 128 samples
    a shard give the same shards, horizon and runs a batch as 1,024, at an eighth of the reads to learn (the
    10^8 samples themselves took three minutes)."""
    from fastdata.storage.plan import Plan, horizon

    per_shard, batch = 128, 256
    shards = -(-10 ** 8 // 1024)
    samples = shards * per_shard
    sizes = np.full(shards, 1 << 20, dtype=np.int64)
    limit = int(sizes[0]) * (shards - 1)  # the largest cache that holds fewer shards than the dataset
    runs = horizon(limit, sizes)
    epoch = -(-samples // batch)
    two_epochs = itertools.chain(*(_plain_shuffle_reads(samples, per_shard, batch, seed) for seed in (0, 1)))
    plan = Plan(two_epochs, shards, epoch, runs)
    lock = threading.Lock()
    bound, learning = _plan_bytes(shards, runs, batch), _plan_bytes(shards, runs, batch, True)
    largest, learnt = 0, 0
    tracemalloc.start()
    try:
        plan.learn(lock)
        assert plan.scattered(shards - 1)  # what the cache warns about
        while not plan.complete or plan.pos < plan.known:
            while plan.wants_more():
                plan.learn(lock)
            largest = max(largest, plan.nbytes)
            learnt = max(learnt, len(plan.batch))
            plan.pos = min(plan.known, plan.pos + 997)  # the reader moves on; the scheduler's cursor with it
            plan.cursor = int(np.searchsorted(plan.batch, plan.pos - 1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.known == 2 * epoch
    assert largest <= bound and peak <= learning, (largest, bound, peak, learning)
    assert learnt <= runs + Plan.CHUNK + batch


def test_a_cache_folder_under_a_folder_another_user_could_swap_is_refused(tmp_path, monkeypatch):
    """A folder above the dataset's (the cache root, or one above it) that is another user's and writable by
    others lets them rename our private folder away and put planted shards at its name: refused before
    anything is made there. Root's sticky folders (/tmp) and this user's are fine."""
    from fastdata.errors import OutputError
    from fastdata.storage.cache_folders import cache_folder

    if os.geteuid() != 0:
        pytest.skip("needs root: the folders of another user are made with os.chown")
    monkeypatch.delenv("FASTDATA_CACHE_MODE", raising=False)
    root = tmp_path / "root"
    root.mkdir()
    os.chown(root, 12345, 12345)
    for mode in (0o777, 0o1777, 0o770):  # a sticky bit does not help: the folder's owner may rename anything in it
        os.chmod(root, mode)
        with pytest.raises(OutputError, match=rf"{root}, on the way to the node cache folder {root}/ds, belongs to "
                                              rf"user 12345 and others may write to it \(mode {mode:o}\): .*set "
                                              r"cache_dir / \$FASTDATA_CACHE to a folder of your own"):
            cache_folder(root / "ds")
        assert not (root / "ds").exists()
    os.chmod(root, 0o755)  # another user's, but only they may write to it
    cache_folder(root / "ds")
    os.chmod(root, 0o777)  # opened after the dataset's folder was made: its subfolders are refused too
    with pytest.raises(OutputError, match=rf"{root}, on the way"):
        cache_folder(root / "ds" / ".locks")
    with pytest.raises(OutputError, match=rf"{root}, on the way"):  # and a cache root below it, however private
        cache_folder(root / "ds" / "deeper" / "id")

    os.chown(root, 0, 0)
    os.chmod(root, 0o1777)  # root's sticky folder, like /tmp: fine, but not through another user's link in it
    cache_folder(root / "ds2")
    target = tmp_path / "target"
    target.mkdir()
    for where in (tmp_path / "link", root / "link"):
        os.symlink(target, where)
        os.lchown(where, 12345, 12345)
    cache_folder(tmp_path / "link" / "ds3")  # (a link's target cannot change; only this user may replace it here)
    with pytest.raises(OutputError, match=rf"{root}/link, on the way .* is a link of user 12345, who may replace "
                                          "it in a folder open to all"):
        cache_folder(root / "link" / "ds4")

    shared = tmp_path / "shared"  # a project folder of this user's group, made by another member: trusted
    shared.mkdir()
    os.chown(shared, 12345, os.getegid())
    os.chmod(shared, 0o2770)
    cache_folder(shared / "ds")
    os.chown(shared, 12345, 54321)  # (a group this user is not in)
    with pytest.raises(OutputError, match=rf"{shared}, on the way"):
        cache_folder(shared / "ds2")
