"""The compiled copy of a Mixture's token windows (NOTE [compiled window copy]): the bytes of the gather it
replaces, in any order, across shard boundaries, and the same errors."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_text import make_docs, preprocess, stream, write_jsonl

from fastdata import Mixture
from fastdata.datasets import window_copy
from fastdata.datasets.mixture import MASK, SHIFT
from fastdata.datasets.tokens import TokenDataset
from fastdata.errors import ConfigError

pytest.importorskip("numba", reason="the compiled copy needs numba (the test extra installs it)")


@pytest.fixture(scope="module")
def kernel():
    if os.environ.get(window_copy.ENV) == "0":
        pytest.skip(f"{window_copy.ENV}=0 turns the compiled copy off")
    got = window_copy.kernel(wait=True)
    assert got is not None, "numba is installed, so the copy must compile"
    return got


@pytest.fixture(scope="module")
def token_sets(tmp_path_factory):
    """Three token folders: small shards (windows cross their boundaries), one shard, shards of 997 tokens."""
    root = tmp_path_factory.mktemp("window-copy")
    sets = {}
    for name, docs, shard in (("web", 700, "300"), ("code", 400, str(1 << 26)), ("math", 300, "997")):
        sets[name] = root / name
        preprocess(write_jsonl(root / f"{name}.jsonl", make_docs(docs, seed=len(sets))), sets[name],
                   "--val-fraction", "0", "--shard-tokens", shard)
    return sets


def windows_of(folder, ds: TokenDataset, idx: np.ndarray) -> np.ndarray:
    """The windows ``idx`` of ``ds`` cut from the token stream itself."""
    return stream(folder, "train")[ds.starts(idx)[:, None] + np.arange(ds.seq_len + 1)]


class Spy:
    """A mixture's WindowCopy, counting the batches it served."""

    def __init__(self, copy: window_copy.WindowCopy) -> None:
        self.copy, self.served = copy, 0

    def ready(self) -> bool:
        return self.copy.ready()

    def __call__(self, codes: np.ndarray, dst: np.ndarray):
        got = self.copy(codes, dst)
        self.served += got is not None
        return got


def spied(mix: Mixture) -> Mixture:
    mix._copy = Spy(mix._copy)
    return mix


def gathered(mix: Mixture, codes: np.ndarray, compiled: bool, **kw) -> tuple[torch.Tensor, ...]:
    """``mix.get_batch`` by the compiled copy (checked to have served) or by the per-source gather."""
    mix._copy.copy.usable, before = compiled, mix._copy.served
    try:
        batch = tuple(t.clone() for t in mix.get_batch(codes, **kw))
    finally:
        mix._copy.copy.usable = True
    assert mix._copy.served == before + compiled
    return batch


@pytest.mark.parametrize("storage", ["mmap", "ram"])
def test_the_copy_gives_the_gathers_bytes_in_any_order(token_sets, kernel, storage):
    sources = {n: TokenDataset(p, seq_len=24, storage=storage, stride=17 if n == "math" else None)
               for n, p in token_sets.items()}
    assert len(sources["web"]._shards) > 3 or storage == "ram"  # several shards: windows cross boundaries
    mix = spied(Mixture(sources, weights=[0.5, 0.3, 0.2]))
    rng = np.random.default_rng(0)
    parts = [rng.choice(len(ds), 150, replace=True) for ds in sources.values()]  # repeats too
    codes = np.concatenate([p | (k << SHIFT) for k, p in enumerate(parts)])
    for order in (np.argsort(codes, kind="stable"), rng.permutation(len(codes))):
        c = codes[order]
        x, y = gathered(mix, c, True)
        want = np.concatenate([windows_of(token_sets[n], ds, p) for (n, ds), p in zip(sources.items(), parts)])
        assert np.array_equal(x.numpy(), want[order][:, :-1]) and np.array_equal(y.numpy(), want[order][:, 1:])
        assert all(torch.equal(a, b) for a, b in zip((x, y), gathered(mix, c, False)))
    before = mix.interval_report(1.0)  # rows counted per source, as the gather counts them
    gathered(mix, codes[:40], True)
    assert {n: r["share"] for n, r in mix.interval_report(1.0).items()} == {"web": 1.0, "code": 0.0, "math": 0.0}
    assert before["web"]["share"] > 0
    buf = torch.zeros((len(codes) + 5, 25), dtype=torch.uint16)  # a loader's ring slot: written in place
    x, _ = mix.get_batch(codes, out=(buf, torch.zeros(len(codes) + 5, dtype=torch.int64)))
    assert x.data_ptr() == buf.data_ptr() and torch.equal(x, gathered(mix, codes, False)[0])
    for compiled in (True, False):  # a slot of too few rows is refused, never written past
        buf.zero_()
        with pytest.raises(ConfigError, match="out must be"):
            mix._copy.copy.usable = compiled
            mix.get_batch(codes[:8], out=(buf[:2], torch.zeros(2, dtype=torch.int64)))
        mix._copy.copy.usable = True
        assert not buf.any()
    batch_mix = spied(Mixture(sources, mix="batch"))
    x, y, src = gathered(batch_mix, codes[:7], True)
    assert torch.equal(src, torch.from_numpy(codes[:7] >> SHIFT)) and torch.equal(x, gathered(mix, codes[:7], False)[0])


def test_bad_indices_raise_what_the_gather_raises_and_a_reopened_source_is_read_anew(token_sets, kernel):
    sources = [TokenDataset(p, seq_len=24) for p in token_sets.values()]
    mix = spied(Mixture(sources))
    good = np.array([3, (1 << SHIFT) | 5], dtype=np.int64)
    for bad, needle in ((len(sources[1]), "sample"), (-1, "source -1"), (3 << SHIFT, "names source 3")):
        codes = np.append(good, bad if bad != len(sources[1]) else (1 << SHIFT) | bad)
        with pytest.raises(IndexError, match=needle):
            mix.get_batch(codes)
    with pytest.raises(ConfigError, match="out must be"):
        mix.get_batch(good, out=torch.zeros((2, 25), dtype=torch.int32))
    again = Mixture(pickle.loads(pickle.dumps(sources)))  # sources opened anew: new maps, new tables
    assert again._copy.ready() and again.sources[0]._copy_table.addresses[0] != mix.sources[0]._copy_table.addresses[0]
    assert torch.equal(again.get_batch(good)[0], gathered(mix, good, True)[0])
    old = sources[0]._copy_table
    sources[0].__setstate__(sources[0].__getstate__())  # opened again in place: this mixture's layout follows
    assert sources[0]._copy_table is not old
    del old
    assert torch.equal(gathered(mix, good, True)[0], gathered(mix, good, False)[0])
    sources[0].close()
    with pytest.raises(ConfigError, match="was closed"):
        mix.get_batch(good)


def test_segments_empty_or_shorter_than_a_window_are_crossed_in_pieces(kernel):
    """The kernel on a hand-made table: a window may span three segments, one of them empty."""
    class Source:
        random_windows, stride, seq_len = False, 3, 7

        def __init__(self, segments: list[np.ndarray]) -> None:
            self.segments = segments
            self._copy_table = window_copy.Segments(segments, np.cumsum([0] + [len(s) for s in segments]))
            self.tokens = np.concatenate(segments)

        def __len__(self) -> int:
            return (len(self.tokens) - 8) // self.stride + 1

    for dtype in (np.uint16, np.uint32):
        a = Source([np.arange(0, 5, dtype=dtype), np.arange(5, 5, dtype=dtype), np.arange(5, 7, dtype=dtype),
                    np.arange(7, 40, dtype=dtype)])
        b = Source([np.arange(100, 131, dtype=dtype) * 7])
        copy = window_copy.WindowCopy([a, b])
        codes = np.array([(1 << SHIFT) | 2, 0, 1, 2, (1 << SHIFT) | 0, len(a) - 1], dtype=np.int64)
        dst = np.full((len(codes), 8), 9999, dtype=dtype)
        assert copy.ready() and copy(codes, dst).tolist() == [4, 2]
        src = [a, b]
        want = np.stack([src[c >> SHIFT].tokens[(c & MASK) * 3 + np.arange(8)] for c in codes.tolist()])
        assert np.array_equal(dst, want)
        for bad in (np.array([len(a)], dtype=np.int64), np.array([2 << SHIFT], dtype=np.int64)):
            assert copy(bad, dst) is None  # refused: the caller's path raises
        for short in (np.zeros((len(codes), 9), dtype=dtype), dst[:3]):  # wider than a window, too few rows
            assert copy(codes, short) is None


def test_a_fork_waits_for_a_compile_under_way(tmp_path):
    """A child forked while the copy compiles would inherit numba's import locks held by a thread it lacks;
    the fork waits for the compile instead, and the child imports numba at once."""
    code = (
        "import os, signal, sys, time\n"
        "from fastdata.datasets import window_copy\n"
        "window_copy.kernel()\n"  # the compile starts on its thread
        "time.sleep(0.02)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    signal.alarm(20)\n"
        "    import numba\n"
        "    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}  # a cold compile: the window is widest
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert done.returncode == 0


@pytest.mark.parametrize("storage", ["mmap", "ram"])
def test_one_dataset_serves_its_windows_by_the_compiled_copy(kernel, token_sets, monkeypatch, storage):
    # rule 5 of NOTE [window gather]: a single TokenDataset's batch in one compiled call, the gather's bytes
    for name, kw in (("web", {}), ("math", {"stride": 5}), ("code", {})):  # small shards, odd shards, one shard
        ds = TokenDataset(token_sets[name], seq_len=16, storage=storage, **kw)
        rng = np.random.default_rng(len(name))
        idx = rng.integers(0, len(ds), 300)  # any order, repeats: windows across shard boundaries too
        want = windows_of(token_sets[name], ds, idx)
        with monkeypatch.context() as m:
            m.setattr(TokenDataset, "_gather", lambda *a: pytest.fail("the gather served, not the compiled copy"))
            x, y = ds.get_batch(idx)
            buf = torch.zeros((len(idx) + 5, 17), dtype=ds.sample_dtype)
            bx, _ = ds.get_batch(idx, out=buf)
        assert np.array_equal(x.numpy(), want[:, :-1]) and torch.equal(x[:, 1:], y[:, :-1])
        assert bx.data_ptr() == buf.data_ptr() and np.array_equal(buf[:len(idx)].numpy(), want)
        with pytest.raises(IndexError, match="window index out of range"):
            ds.get_batch(np.array([0, len(ds)]))
        assert np.array_equal(ds.get_batch(idx[:, None])[0].numpy(), want[:, :-1])  # a (B, 1) column: B windows
        again = pickle.loads(pickle.dumps(ds))  # a copy has its own table, and its own compiled copy
        assert np.array_equal(again.get_batch(idx)[0].numpy(), want[:, :-1]) and again._copy is not ds._copy
    random = TokenDataset(token_sets["web"], seq_len=16, random_windows=True, seed=3)
    assert random._compiled() is None  # its starts are drawn: the gather serves them


def test_a_dropped_dataset_is_freed_with_its_compiled_copy(kernel, token_sets):
    import gc
    import weakref

    ds = TokenDataset(token_sets["web"], seq_len=16, storage="ram")
    ds.get_batch(np.arange(100))  # (from 64 windows without out=: the compiled copy)
    assert ds._copy is not None
    ref = weakref.ref(ds)
    gc.disable()  # freed by its reference count, not by a later collection of a cycle
    try:
        del ds
        assert ref() is None
    finally:
        gc.enable()
