"""The epoch plan: exactly-once coverage across ranks, padding / drop_last, determinism, resumption."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from fastdata.errors import ConfigError
from fastdata.loading.sampler import DistributedBatchSampler


def epoch_batches(n, b, world, drop_last, epoch=0, seed=0, shuffle=True):
    out = []
    for r in range(world):
        s = DistributedBatchSampler(n, b, shuffle=shuffle, seed=seed, drop_last=drop_last, rank=r, world_size=world)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


@pytest.mark.parametrize("n, b, world", [(100, 8, 1), (100, 8, 2), (101, 8, 3), (7, 4, 4), (64, 16, 4), (5, 3, 8)])
def test_every_sample_once_per_epoch_with_padding(n, b, world):
    per_rank = epoch_batches(n, b, world, drop_last=False)
    assert len({len(batches) for batches in per_rank}) == 1  # equal batch counts: DDP never hangs
    assert len({sum(map(len, batches)) for batches in per_rank}) == 1  # equal sample counts
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(seen) == set(range(n))
    repeats = sum(seen.values()) - n
    assert repeats == (-n) % world and repeats <= world - 1
    assert all(len(b_) == b for batches in per_rank for b_ in batches[:-1])


@pytest.mark.parametrize("n, b, world", [(100, 8, 1), (100, 8, 2), (101, 8, 3), (64, 16, 4)])
def test_drop_last_serves_full_batches_without_repeats(n, b, world):
    per_rank = epoch_batches(n, b, world, drop_last=True)
    flat = [i for batches in per_rank for batch in batches for i in batch]
    assert len(flat) == len(set(flat)) == n // (world * b) * world * b
    assert all(len(batch) == b for batches in per_rank for batch in batches)
    assert len({len(batches) for batches in per_rank}) == 1


@pytest.mark.parametrize("n, b, world", [(100, 8, 3), (7, 4, 4), (5, 3, 8), (33, 32, 2)])
def test_pad_false_serves_every_sample_exactly_once(n, b, world):
    per_rank = []
    for r in range(world):
        s = DistributedBatchSampler(n, b, shuffle=True, seed=1, pad=False, rank=r, world_size=world)
        assert len(s) == s.epoch_batches()
        per_rank.append(list(s))
        assert len(per_rank[-1]) == s.epoch_batches()
    flat = [i for batches in per_rank for batch in batches for i in batch]
    assert sorted(flat) == list(range(n))  # no padded repeats
    sizes = [sum(map(len, batches)) for batches in per_rank]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    padded = epoch_batches(n, b, world, drop_last=False, seed=1)  # the padded plan, without its repeats
    for mine, theirs in zip(per_rank, padded):
        a, p = [i for batch in mine for i in batch], [i for batch in theirs for i in batch]
        assert a == p[:len(a)] and len(p) - len(a) <= 1


def test_order_fixed_by_seed_and_epoch():
    a = epoch_batches(50, 7, 2, False, epoch=3, seed=5)
    assert a == epoch_batches(50, 7, 2, False, epoch=3, seed=5)
    assert a != epoch_batches(50, 7, 2, False, epoch=4, seed=5)
    assert a != epoch_batches(50, 7, 2, False, epoch=3, seed=6)
    assert [i for b in epoch_batches(10, 3, 1, False, shuffle=False)[0] for i in b] == list(range(10))


def test_len_and_epoch_advance():
    s = DistributedBatchSampler(10, 3, rank=0, world_size=1)
    assert len(s) == 4
    first = list(s)
    assert s.epoch == 1 and len(s) == 4 and list(s) != first


@pytest.mark.parametrize("n, b, w1, w2, k, drop_last", [
    (100, 8, 2, 2, 3, False), (100, 8, 2, 3, 2, False), (101, 4, 3, 2, 5, False), (100, 8, 1, 4, 6, False),
    (100, 8, 2, 3, 2, True), (37, 5, 4, 1, 1, False),
    (100, 8, 2, 3, 7, False)])  # saved after the epoch's last batch, before its iteration ended: nothing is left
def test_resume_mid_epoch_covers_the_rest_once(n, b, w1, w2, k, drop_last):
    """World w1 serves k batches per rank; a new world w2 resumes and serves the rest of the epoch."""
    first, states = [], []
    for r in range(w1):
        s = DistributedBatchSampler(n, b, seed=1, drop_last=drop_last, rank=r, world_size=w1)
        s.set_epoch(2)
        it = iter(s)
        first += [i for _, batch in zip(range(k), it) for i in batch]
        states.append(s.state_dict())
    assert all(st == states[0] for st in states)  # every rank agrees where the epoch got to
    second, counts = [], []
    for r in range(w2):
        s = DistributedBatchSampler(n, b, seed=1, drop_last=drop_last, rank=r, world_size=w2)
        s.load_state_dict(states[0])
        s.set_epoch(2)  # the usual loop calls set_epoch; it keeps the resumed position
        batches = list(s)
        counts.append(len(batches))
        second += [i for batch in batches for i in batch]
        assert s.epoch == 3
    assert len(set(counts)) == 1
    assert len(first) == len(set(first))  # no repeats before the cut (k batches stay inside the epoch)
    both = Counter(first + second)
    if drop_last:
        assert max(both.values()) == 1
    else:
        assert set(both) == set(range(n))
        assert sum(both.values()) - n <= w2 - 1  # only the resumed world's padding repeats


def test_state_from_another_dataset_is_refused():
    s = DistributedBatchSampler(10, 2, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="another dataset"):
        s.load_state_dict(DistributedBatchSampler(11, 2, rank=0, world_size=1).state_dict())
    with pytest.raises(ConfigError, match="seed"):
        s.load_state_dict(DistributedBatchSampler(10, 2, seed=3, rank=0, world_size=1).state_dict())


@pytest.mark.parametrize("change, needle", [
    ({"position": -8}, "position is -8"),  # (wrapped around the order: 8 samples served twice)
    ({"position": -40}, "position is -40"), ({"position": None}, "position is None"),
    ({"position": 3.7}, "position is 3.7"), ({"position": True}, "position is True"),
    ({"epoch": -1}, "epoch is -1"), ({"epoch": "1"}, "epoch is '1'"),
    ({"nodes": [0, 2]}, "nodes are"), ({"nodes": "2x2"}, "nodes are")])
def test_a_damaged_state_is_refused_by_name(change, needle):
    s = DistributedBatchSampler(20, 4, rank=0, world_size=1, shuffle_window=2, shard_bounds=[0, 10, 20])
    state = {**s.state_dict(), **change}
    with pytest.raises(ConfigError, match=f"damaged: its {needle}"):
        DistributedBatchSampler(20, 4, rank=0, world_size=1, shuffle_window=2, shard_bounds=[0, 10, 20]
                                ).load_state_dict(state)
    without = {k: v for k, v in s.state_dict().items() if k != "position"}
    with pytest.raises(ConfigError, match="damaged: its position is None"):
        s.load_state_dict(without)
    with pytest.raises(ConfigError, match="a loader state is a dict"):
        s.load_state_dict([("epoch", 0)])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_with_workers_resumes_at_the_batches_received(workers):
    """A DataLoader with worker processes takes index batches ahead of its consumer: the sampler alone
    counted them as served (a state after 2 batches said 6, and the resume skipped 16 samples).
    ``state_dict(batches=k)`` counts the k received in this pass, also after the sampler's epoch ended."""
    import torch

    ds = torch.utils.data.TensorDataset(torch.arange(64))
    for stop in (2, 15):  # (at 15 of 16 the workers have taken the whole epoch: the sampler is in the next)
        s = DistributedBatchSampler(64, 4, seed=0, rank=0, world_size=1)
        seen = []
        for k, (batch,) in enumerate(torch.utils.data.DataLoader(ds, batch_sampler=s, num_workers=workers), 1):
            seen += batch.tolist()
            if k == stop:
                state = s.state_dict(batches=k)
                break
        assert state["epoch"] == 0 and state["position"] == 4 * stop
        again = DistributedBatchSampler(64, 4, seed=0, rank=0, world_size=1)
        again.load_state_dict(state)
        rest = [i for b in again for i in b]
        assert sorted(seen + rest) == list(range(64))
    out = 15 if workers == 0 else 16  # (without workers nothing is taken ahead)
    with pytest.raises(ConfigError, match=f"handed out {out} batches"):
        s.state_dict(batches=out + 1)
    s.set_epoch(1)  # the next epoch: nothing of it received yet
    assert s.state_dict(batches=0)["epoch"] == 1 and s.state_dict(batches=0)["position"] == 0
    with pytest.raises(ConfigError, match="handed out 0 batches"):
        s.state_dict(batches=1)


@pytest.mark.parametrize("kwargs, needle", [({"batch_size": 0}, "batch_size=0"),
                                            ({"rank": 2, "world_size": 2}, "rank=2"),
                                            ({"num_samples": 0}, "num_samples=0")])
def test_bad_arguments_name_the_value(kwargs, needle):
    args = {"num_samples": 10, "batch_size": 2, "rank": 0, "world_size": 1, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        DistributedBatchSampler(args.pop("num_samples"), args.pop("batch_size"), **args)


def test_usable_as_dataloader_batch_sampler():
    import torch

    ds = torch.utils.data.TensorDataset(torch.arange(20))
    s = DistributedBatchSampler(20, 6, rank=0, world_size=1)
    got = [b[0].tolist() for b in torch.utils.data.DataLoader(ds, batch_sampler=s)]
    assert sorted(i for b in got for i in b) == list(range(20)) and [len(b) for b in got] == [6, 6, 6, 2]


def _windowed(n, shard, window, rank=0, world=1, seed=3, **kw):
    import numpy as np

    return DistributedBatchSampler(n, 8, seed=seed, rank=rank, world_size=world, shuffle_window=window,
                                   shards=np.arange(n) // shard, **kw)


def test_a_window_covering_every_shard_is_exactly_the_plain_shuffle():
    import numpy as np

    plain = DistributedBatchSampler(1000, 8, seed=3, rank=0, world_size=1)
    for epoch in (0, 5):
        assert np.array_equal(_windowed(1000, 64, 16).permutation(epoch), plain.permutation(epoch))
        assert np.array_equal(_windowed(1000, 64, 99).permutation(epoch), plain.permutation(epoch))


@pytest.mark.parametrize("n, shard, window", [(1000, 64, 1), (1000, 64, 3), (1003, 50, 4), (640, 64, 2)])
def test_a_windowed_shuffle_reads_window_by_window_and_mixes_inside(n, shard, window):
    import numpy as np

    s = _windowed(n, shard, window)
    perm = s.permutation(0)
    assert sorted(perm.tolist()) == list(range(n))  # a permutation: every sample once
    shard_of = perm // shard
    firsts = {}
    for pos, sh in enumerate(shard_of.tolist()):
        firsts.setdefault(sh, pos)
    order = sorted(firsts, key=firsts.get)  # the shards in the order the epoch reaches them
    start = 0
    for w in range(0, len(order), window):  # window k holds exactly the samples of its shards, contiguously
        members = set(order[w:w + window])
        size = sum(min(shard, n - m * shard) for m in members)
        assert set(shard_of[start:start + size].tolist()) == members
        start += size
    inside = perm[:min(n, window * shard)]
    if window > 1:  # samples of the window's shards are interleaved, not read shard after shard
        assert len(set((inside[:16] // shard).tolist())) > 1
    assert not np.array_equal(s.permutation(0), s.permutation(1))  # a new order every epoch, shards too
    assert order != sorted(order)  # the shards themselves come in a random order


def test_windowed_epochs_serve_every_sample_once_across_ranks_and_resume_at_another_world_size():
    from collections import Counter

    first = [_windowed(1000, 64, 2, rank=r, world=2) for r in range(2)]
    seen = Counter()
    for s in first:
        for _, batch in zip(range(20), s):  # 20 batches a rank, then a checkpoint
            seen.update(batch)
    state = first[0].state_dict()
    assert state["shuffle_window"] == 2 and state["position"] == 20 * 8 * 2
    rest = [_windowed(1000, 64, 2, rank=r, world=3) for r in range(3)]
    for s in rest:
        s.load_state_dict(state)
    counts = {len(list(s)) for s in rest}
    for s in rest:
        s.load_state_dict(state)
        for batch in s:
            seen.update(batch)
    assert len(counts) == 1 and set(seen) == set(range(1000)) and sum(seen.values()) - 1000 <= 2
    with pytest.raises(ConfigError, match="shuffle_window"):
        _windowed(1000, 64, 4).load_state_dict(state)  # another window: another order
    with pytest.raises(ConfigError, match="shuffle_window"):
        DistributedBatchSampler(1000, 8, shuffle_window=2)  # no shards given
    with pytest.raises(ConfigError, match="shuffle_window"):
        _windowed(1000, 64, 0)


def _bounds(n, shard):
    import numpy as np

    return np.r_[np.arange(0, n, shard, dtype=np.int64), n]


@pytest.mark.parametrize("nodes, node_size, world", [(1, 1, 1), (1, 3, 3), (2, 2, 4), (3, 2, 6), (4, 1, 4)])
@pytest.mark.parametrize("pad, drop_last", [(True, False), (False, False), (True, True)])
def test_streamed_batches_are_the_epoch_order_split_across_ranks(nodes, node_size, world, pad, drop_last):
    import numpy as np

    n, shard = 1003, 37
    ranks = [DistributedBatchSampler(n, 8, seed=2, rank=r, world_size=world, shuffle_window=3,
                                     shard_bounds=_bounds(n, shard), node_size=node_size, pad=pad,
                                     drop_last=drop_last) for r in range(world)]
    assert ranks[0].layout == ((nodes, node_size) if nodes > 1 else (1, 1))
    perm = ranks[0].permutation()
    assert sorted(perm.tolist()) == list(range(n))  # a permutation, however the windows are dealt
    due = ranks[0]._due(0)
    rest = np.r_[perm, perm[n - (due - n):]] if due > n else perm[:due]  # NOTE [epoch plan]: padded or cut
    for r, s in enumerate(ranks):
        streamed = np.concatenate(list(s.batches()))
        assert np.array_equal(streamed, rest[r::world]) and np.array_equal(streamed, s.rank_indices())
        assert len(list(s.batches())) == len(s)
    if nodes > 1:  # each node reads its own shards; only the leftovers at the end are shared
        order, where = ranks[0].order(), np.arange(due)  # (the position each sample of rest comes from)
        assert n - order.interleaved <= nodes * shard
        foreign = [set() for _ in range(nodes)]
        for r in range(world):  # (the padding, at most world - 1 repeats, comes from the end of the epoch)
            other = ~np.isin(rest[r::world] // shard, order.stream_shards[r // node_size])
            assert not other[where[r::world] < order.interleaved].any()
            foreign[r // node_size] |= set((rest[r::world][other & (where[r::world] < n)] // shard).tolist())
        assert max(map(len, foreign)) <= 2  # at the end a node reads one or two shards of the pool, no more


def test_a_layout_is_kept_by_a_resumed_epoch_at_another_world_size():
    from collections import Counter

    n, shard = 1000, 40
    first = [DistributedBatchSampler(n, 8, seed=4, rank=r, world_size=4, shuffle_window=2,
                                     shard_bounds=_bounds(n, shard), node_size=2) for r in range(4)]
    seen = Counter()
    for s in first:
        for _, batch in zip(range(10), s):
            seen.update(batch)
    state = first[0].state_dict()
    assert state["nodes"] == [2, 2]  # 2 nodes of 2 ranks: the order depends on it
    rest = [DistributedBatchSampler(n, 8, seed=4, rank=r, world_size=3, shuffle_window=2,
                                    shard_bounds=_bounds(n, shard), node_size=3) for r in range(3)]
    assert rest[0].layout == (1, 1)
    for s in rest:
        s.load_state_dict(state)
        assert s.order().layout == (2, 2)  # the resumed epoch keeps the order it was started with
        for batch in s:
            seen.update(batch)
        assert s.order().layout == (1, 1)  # the next epochs use this run's layout
    assert set(seen) == set(range(n)) and sum(seen.values()) - n <= 2


def test_an_epoch_over_two_billion_samples_is_streamed_in_little_time_and_memory():
    """Issue 19, item 2: the order alone, no data. One rank of 64 (8 nodes) over 2e9 samples in 20,000
    shards yields its first batch in under a second of CPU and 200 MB, resumes deep into the epoch as
    fast, and streams on without ever holding the epoch (a full permutation would be 16 GB)."""
    import time
    import tracemalloc

    import numpy as np

    n, shards, window = 2_000_000_000, 20_000, 16
    bounds = _bounds(n, n // shards)
    tracemalloc.start()
    try:
        cpu = time.process_time()
        s = DistributedBatchSampler(n, 256, seed=1, rank=13, world_size=64, shuffle_window=window,
                                    shard_bounds=bounds, node_size=8)
        first = next(iter(s.batches()))
        assert time.process_time() - cpu < 1.0 and tracemalloc.get_traced_memory()[1] < 200e6
        assert len(s) == -(-n // 64 // 256) and len(np.unique(first)) == 256
        order = s.order()
        mine = order.stream_shards[1]  # rank 13 is on node 1: it reads node 1's shards, a window at a time
        assert np.isin(first // (n // shards), mine[:window]).all()
        cpu = time.process_time()
        s.load_state_dict({**s.state_dict(), "position": 1_500_000_000 // (256 * 64) * 256 * 64})
        deep = next(iter(s.batches()))
        assert time.process_time() - cpu < 1.0 and np.isin(deep // (n // shards), mine).all()
        seen = 0
        for _, batch in zip(range(5000), s.batches()):  # 1.3M samples on: one window after another
            seen += len(batch)
        assert seen == 5000 * 256 and tracemalloc.get_traced_memory()[1] < 200e6
    finally:
        tracemalloc.stop()


def test_an_unwindowed_order_is_held_once_by_the_sampler_and_its_planner():
    """The sampler kept the previous epoch's whole permutation beside the current one (16 bytes a sample,
    32 GB a rank at 2x10^9), and a streamed dataset's read plan made two more of its own (up to 32 bytes)."""
    import tracemalloc

    n = 2_000_000
    s = DistributedBatchSampler(n, 64, seed=1, rank=0, world_size=4)
    tracemalloc.start()
    try:
        for epoch in range(3):
            s.set_epoch(epoch)
            next(iter(s.batches()))
            planned = s.coming_batches()  # (a cache's planner: the rest of this epoch, then the next one's)
            next(planned)
            assert tracemalloc.get_traced_memory()[0] < 1.2 * 8 * n, epoch  # one permutation of int64
            del planned
    finally:
        tracemalloc.stop()
    plain = DistributedBatchSampler(n, 64, seed=1, rank=0, world_size=4)
    plain.set_epoch(2)
    assert all(np.array_equal(a, b) for a, b in zip(s.coming_batches(), plain.batches(), strict=False))


@pytest.mark.parametrize("sizes", [(4, 2), (1, 2, 3), (3, 1, 2), (2, 2, 2)])
def test_nodes_of_different_sizes_agree_on_the_layout_and_serve_every_sample_once(monkeypatch, sizes):
    """torchrun allows nodes of different sizes: each rank took its own node's LOCAL_WORLD_SIZE for the
    layout, so a node of 4 and a node of 2 drew different orders and lost about a quarter of the samples
    (and a check of GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE against the world passed the 2 of 1+2+3)."""
    n, shard, world = 960, 40, sum(sizes)
    seen, layouts = Counter(), set()
    monkeypatch.setenv("GROUP_WORLD_SIZE", str(len(sizes)))
    for node, size in enumerate(sizes):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(size))
        for rank in range(sum(sizes[:node]), sum(sizes[:node + 1])):
            s = DistributedBatchSampler(n, 8, seed=4, rank=rank, world_size=world, shuffle_window=3,
                                        shard_bounds=_bounds(n, shard))
            layouts.add(s.layout)
            for batch in s:
                seen.update(batch)
    assert layouts == {(len(sizes), world // len(sizes))}  # (the same on every rank)
    assert set(seen) == set(range(n)) and sum(seen.values()) == n
    monkeypatch.setenv("GROUP_WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="GROUP_WORLD_SIZE='two' is not a number of nodes"):
        DistributedBatchSampler(n, 8, rank=0, world_size=6, shuffle_window=3, shard_bounds=_bounds(n, shard))


@pytest.mark.parametrize("n, world", [(10, 3), (11, 5), (7, 4), (101, 8)])
def test_a_rank_never_serves_one_sample_twice_in_an_epoch(n, world):
    """Padding with the epoch's last samples in reverse put a pad on the rank of its own sample (its last
    batch [2, 5, 8, 8]): in-batch negatives of a contrastive loss met themselves."""
    for rank in range(world):
        mine = DistributedBatchSampler(n, 3, seed=1, rank=rank, world_size=world).rank_indices()
        assert len(set(mine.tolist())) == len(mine), (rank, mine)


def test_a_sampler_can_be_copied_and_pickled_midway():
    import copy
    import pickle

    s = DistributedBatchSampler(100, 8, seed=1, rank=1, world_size=2, shuffle_window=2, shard_bounds=_bounds(100, 10))
    next(iter(s))
    for other in (copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
        assert other.state_dict() == s.state_dict()
        assert all(np.array_equal(a, b) for a, b in zip(other.batches(), s.batches(), strict=True))
        assert all(np.array_equal(a, b) for a, b in zip(other.coming_batches(), s.coming_batches(), strict=True))


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("n, b, world, k", [(203, 16, 3, 1), (203, 7, 5, 2), (10, 1, 4, 2)])
def test_an_epoch_resumed_at_the_same_world_size_serves_what_the_uninterrupted_one_does(n, b, world, k, window):
    """The padding repeated the first samples of the resumed rest, not of the epoch: the padded last batch of
    a resumed epoch differed from the uninterrupted run's."""
    kw = {"shuffle_window": window, "shard_bounds": _bounds(n, 20)} if window else {}
    for rank in range(world):
        whole = [b_.tolist() for b_ in DistributedBatchSampler(n, b, seed=2, rank=rank, world_size=world,
                                                               **kw).batches()]
        first = DistributedBatchSampler(n, b, seed=2, rank=rank, world_size=world, **kw)
        head = [batch for _, batch in zip(range(k), first)]
        again = DistributedBatchSampler(n, b, seed=2, rank=rank, world_size=world, **kw)
        again.load_state_dict(first.state_dict())
        assert head + [b_.tolist() for b_ in again.batches()] == whole, rank


@pytest.mark.parametrize("call, needle", [
    (lambda s: s.set_epoch(-1), "got -1"), (lambda s: s.set_epoch(1.0), "got 1.0"),
    (lambda s: s.set_epoch(True), "got True"),
    (lambda s: DistributedBatchSampler(10, 2, seed=-1, rank=0, world_size=1), "seed=-1"),
])
def test_an_epoch_or_seed_that_is_no_whole_number_is_refused_by_name(call, needle):
    # numpy's errors came at the first batch ("expected non-negative integer"), or none at all
    with pytest.raises(ConfigError, match=re.escape(needle)):
        call(DistributedBatchSampler(10, 2, rank=0, world_size=1))


def test_a_numpy_epoch_gives_a_state_json_can_write():
    import json

    s = DistributedBatchSampler(10, 2, rank=0, world_size=1, seed=np.int64(3))
    for epoch in np.arange(2):  # (a loop over np.arange: the state held a numpy integer)
        s.set_epoch(epoch)
    assert json.loads(json.dumps(s.state_dict())) == {**s.state_dict(), "epoch": 1, "seed": 3}
