"""FastLoader: values, epoch coverage, ring-buffer contract, resume, threads and memory hygiene."""
from __future__ import annotations

import gc
import json
import re
import threading

import pytest
import torch
from conftest import INDEXED_N, sample_ids

from fastdata.datasets.images import FastDataset
from fastdata.errors import ConfigError, FastdataError
from fastdata.loading.loader import FastLoader


@pytest.fixture
def ds(indexed_datasets):
    return FastDataset(indexed_datasets["npy"])


def epoch_ids(loader) -> list[list[int]]:
    return [sample_ids(x.cpu()).tolist() for x, _ in loader]


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("fastdata-loader")]


def test_batches_values_labels_and_order(ds):
    loader = FastLoader(ds, 16, shuffle=True, seed=3, num_threads=2)
    assert len(loader) == 7 and loader.dataset is ds and loader.batch_size == 16
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [16] * 6 + [4]
    for x, y in batches:
        assert x.dtype == torch.uint8 and x.shape[1:] == (8, 8, 3) and y.dtype == torch.int64
    ids = [sample_ids(x).tolist() for x, _ in [(x.clone(), y) for x, y in FastLoader(ds, 16, seed=3, copy=True)]]
    assert sorted(i for b in ids for i in b) == list(range(INDEXED_N))
    # each batch is the sampler's batch, served in ascending order
    expected = [sorted(b) for b in FastLoader(ds, 16, seed=3).sampler]
    assert ids == expected
    for x, y in FastLoader(ds, 16, seed=3, copy=True):
        assert y.tolist() == [i % 3 for i in sample_ids(x).tolist()]


def test_same_order_for_any_thread_count_and_storage(indexed_datasets, tmp_path):
    ref = epoch_ids(FastLoader(FastDataset(indexed_datasets["npy"]), 10, seed=1, num_threads=1, copy=True))
    for threads in (2, 4):
        assert epoch_ids(FastLoader(FastDataset(indexed_datasets["npy"], storage="ram"), 10, seed=1,
                                    num_threads=threads, copy=True)) == ref
    dev = FastDataset(indexed_datasets["npy"], storage="cuda", device="cpu")
    assert epoch_ids(FastLoader(dev, 10, seed=1)) == ref


def test_epochs_reshuffle_and_set_epoch_is_deterministic(ds):
    loader = FastLoader(ds, 25, seed=0, copy=True)
    e0, e1 = epoch_ids(loader), epoch_ids(loader)
    assert e0 != e1
    loader.set_epoch(0)
    assert epoch_ids(loader) == e0


def test_copy_mode_batches_stay_valid_and_default_mode_reuses_buffers(ds):
    kept = list(FastLoader(ds, 10, shuffle=False, copy=True))
    assert [sample_ids(x).tolist() for x, _ in kept] == [list(range(i, i + 10)) for i in range(0, 100, 10)]
    ptrs = {x.data_ptr() for x, _ in FastLoader(ds, 10, shuffle=False, num_threads=1, prefetch=1)}
    assert len(ptrs) == 2  # the default mode cycles through its ring of num_threads + prefetch slots


def test_manual_release_holds_the_buffer_until_released(ds):
    loader = FastLoader(ds, 10, shuffle=False, num_threads=1, prefetch=1)
    it = loader.iter_manual()
    x0, _, release0 = next(it)
    x1, _, release1 = next(it)  # both slots now held
    assert sample_ids(x0).tolist() == list(range(10)) and sample_ids(x1).tolist() == list(range(10, 20))
    with pytest.raises(FastdataError, match="buffers are held"):
        next(it)
    it = loader.iter_manual()
    seen = []
    for x, _, release in it:
        seen += sample_ids(x).tolist()
        release()
    assert sorted(seen) == list(range(20, 100))  # the abandoned iterator had consumed two batches


@pytest.mark.parametrize("threads_before, threads_after, storage_after", [(2, 1, "ram"), (1, 3, "mmap")])
def test_state_dict_resumes_mid_epoch(indexed_datasets, threads_before, threads_after, storage_after):
    a = FastLoader(FastDataset(indexed_datasets["npy"]), 8, seed=5, num_threads=threads_before, copy=True)
    a.set_epoch(1)
    it = iter(a)
    first = [sample_ids(next(it)[0]).tolist() for _ in range(4)]
    state = a.state_dict()
    assert state["position"] == 32 and state["epoch"] == 1  # prefetched batches do not count
    b = FastLoader(FastDataset(indexed_datasets["npy"], storage=storage_after), 8, seed=5, num_threads=threads_after)
    b.load_state_dict(state)
    b.set_epoch(1)
    rest = epoch_ids(b)
    flat = [i for batch in first + rest for i in batch]
    assert sorted(flat) == list(range(INDEXED_N))
    assert b.state_dict()["epoch"] == 2 and b.state_dict()["position"] == 0


def test_breaking_early_or_raising_leaks_no_threads(ds):
    before = loader_threads()
    for x, _ in FastLoader(ds, 10, num_threads=3):
        break
    gc.collect()
    assert loader_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        for x, _ in FastLoader(ds, 10, num_threads=3):
            raise RuntimeError("boom")
    gc.collect()
    assert loader_threads() == before


@pytest.mark.parametrize("storage", ["mmap", "cuda"])
def test_a_new_iterator_closes_the_previous_one(indexed_datasets, storage):
    """Also for a dataset in device memory (storage="cuda"): its iteration was not the live one, so two
    iterators shared one sampler (samples served twice, the epoch ended twice)."""
    def served(lo):
        for x, _ in lo:
            yield sample_ids(x.cpu()).tolist()

    def served_manually(lo):
        for (x, _), release in lo.iter_batches():
            ids = sample_ids(x.cpu()).tolist()
            release()
            yield ids

    loader = FastLoader(FastDataset(indexed_datasets["npy"], storage=storage, device="cpu"), 10, shuffle=False,
                        num_threads=2)
    loader.on_device = storage == "cuda"  # (the device path, its gathers on the CPU device)
    for start in (served, served_manually):
        loader.set_epoch(0)
        it1 = start(loader)
        next(it1)
        it2 = start(loader)
        rest = list(it2)
        assert rest[0] == list(range(10, 20))  # continues where the epoch got to
        assert sum(rest, []) == list(range(10, 100)) and loader.sampler.epoch == 1
        with pytest.raises(StopIteration):
            next(it1)


def test_a_state_that_is_no_dict_is_refused_by_the_loader(ds):
    """FastLoader read state.get before the sampler's check: a list gave AttributeError."""
    for state in ([("epoch", 0)], None, "epoch 0"):
        with pytest.raises(ConfigError, match="a loader state is a dict"):
            FastLoader(ds, 10).load_state_dict(state)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_memory_stays_flat_over_1000_iterations(ds):
    loader = FastLoader(ds, 32, num_threads=2)
    for _ in range(20):  # warm up allocator and ring
        for _ in loader:
            pass
    start, steps = _rss(), 0
    while steps < 1000:
        for _ in loader:
            steps += 1
    gc.collect()
    assert _rss() - start < 8 << 20, f"RSS grew by {(_rss() - start) / 2**20:.1f} MiB over {steps} batches"


def test_worker_errors_reach_the_consumer(indexed_datasets, tmp_path):
    import shutil

    from fastdata.errors import ImageDecodeError
    from fastdata.formats.lmdb_store import LmdbReader

    root = shutil.copytree(indexed_datasets["lmdb"], tmp_path / "lm")
    store = root / "images-00000.lmdb"  # samples 0-15
    blob = LmdbReader(store).get_many([5])[0]
    data = store.read_bytes()
    at = data.find(blob)
    store.write_bytes(data[:at] + bytes(32) + data[at + 32:])  # record 5 loses its JPEG header
    loader = FastLoader(FastDataset(root), 10, shuffle=False, num_threads=2)
    with pytest.raises(ImageDecodeError, match="sample 5 is not a decodable JPEG"):
        list(loader)
    gc.collect()
    assert loader_threads() == []


@pytest.mark.parametrize("kwargs, needle", [({"batch_size": 0}, "batch_size=0"), ({"num_threads": 0}, "num_threads=0"),
                                            ({"prefetch": -1}, "prefetch=-1")])
def test_arguments_are_validated(ds, kwargs, needle):
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        FastLoader(ds, **args)
    with pytest.raises(ConfigError, match="get_batch"):
        FastLoader(torch.utils.data.TensorDataset(torch.zeros(3)), 2)


def test_drop_last_and_world_size(ds):
    loader = FastLoader(ds, 16, drop_last=True, rank=1, world_size=3)
    batches = list(loader)
    assert len(batches) == len(loader) == 2 and all(len(x) == 16 for x, _ in batches)


def test_lmdb_dataset_through_the_loader(indexed_datasets):
    ids = epoch_ids(FastLoader(FastDataset(indexed_datasets["lmdb"]), 32, seed=2, num_threads=2, copy=True))
    assert sorted(i for b in ids for i in b) == list(range(INDEXED_N))


@pytest.mark.cuda
def test_cuda_storage_gathers_on_the_gpu(indexed_datasets):
    cpu = FastDataset(indexed_datasets["npy"])
    gpu = FastDataset(indexed_datasets["npy"], storage="cuda", device="cuda")
    idx = torch.tensor([3, 99, 42], device="cuda")
    x, y = gpu.get_batch(idx)
    assert x.device.type == "cuda" and y.device.type == "cuda"
    assert torch.equal(x.cpu(), cpu.get_batch([3, 99, 42])[0]) and y.tolist() == [0, 0, 0]
    ids = epoch_ids(FastLoader(gpu, 16, seed=4))
    assert ids == epoch_ids(FastLoader(cpu, 16, seed=4, copy=True))


@pytest.mark.cuda
def test_cuda_storage_steps_copy_nothing_to_the_gpu_and_never_sync(indexed_datasets, monkeypatch):
    import fastdata.loading.loader as loader_mod

    gpu = FastDataset(indexed_datasets["npy"], storage="cuda", device="cuda")
    monkeypatch.setattr(loader_mod, "DEVICE_INDEX_CHUNK", 64)  # several index uploads in one epoch
    loader = FastLoader(gpu, 16, seed=4)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")  # any .item()/.cpu()/sync in a step raises
        try:
            batches = [(x.clone(), y.clone()) for x, y in loader]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(batches) == len(loader) == -(-INDEXED_N // 16) and len(h2d) == -(-INDEXED_N // 64)
    assert [sample_ids(x.cpu()).tolist() for x, _ in batches] == epoch_ids(
        FastLoader(FastDataset(indexed_datasets["npy"]), 16, seed=4, copy=True))


@pytest.mark.cuda
def test_ring_buffers_are_pinned_when_cuda_is_available(ds):
    loader = FastLoader(ds, 16)
    x, y = next(iter(loader))
    assert loader.pin_memory and x.is_pinned() and y.is_pinned()


def test_loader_threads_share_torchs_intraop_threads_and_leave_the_others_alone(indexed_datasets):
    """NOTE [intra-op threads per loader thread]: each worker gets its share of torch's intra-op threads
    for itself; the consumer's count and torch's process-wide setting stay as they were."""
    from fastdata.loading._threads import _omp_set_num_threads

    if _omp_set_num_threads() is None:
        pytest.skip("no OpenMP runtime found in this process (not Linux, or torch built without OpenMP)")
    seen: set[int] = set()

    class Spy(FastDataset):
        def get_batch(self, indices, out=None, draw=None):
            seen.add(torch.get_num_threads())
            return super().get_batch(indices, out=out, draw=draw)

    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for threads, share in ((2, 2), (4, 1), (8, 1)):
            seen.clear()
            assert len(list(FastLoader(Spy(indexed_datasets["npy"]), 16, num_threads=threads))) == 7
            assert seen == {share}, (threads, seen)
            assert torch.get_num_threads() == 4  # the consumer's own
        fresh: list[int] = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [4]  # a thread started afterwards takes torch's setting, not a loader thread's
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("config, message", [
    ({"storage": "ram", "loader": {"threads": 2}}, ": unknown loader settings ['threads'] (FastLoader takes ["),
    ({"storage": "ram"}, " is not a `fastdata bench --autotune` config (needs "),  # (a bare KeyError: 'loader')
])
def test_from_config_checks_a_dict_as_it_checks_a_file(ds, tmp_path, config, message):
    path = tmp_path / "best.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(f"{path}{message}")):
        FastLoader.from_config(ds, 16, path)
    with pytest.raises(ConfigError, match=re.escape(f"the config dict{message}")):  # (a raw TypeError, or none)
        FastLoader.from_config(ds, 16, config)
    good = FastLoader.from_config(ds, 16, {"storage": "ram", "loader": {"num_threads": 2, "prefetch": 1}})
    assert (good.num_threads, good.prefetch) == (2, 1)
    # a dict names only what the loader takes: any of FastLoader's keywords, no storage needed (a file needs it,
    # for the CLI's dataset)
    mine = FastLoader.from_config(ds, 16, {"loader": {"num_threads": 2, "shuffle": False, "drop_last": True}})
    assert (mine.num_threads, mine.sampler.shuffle, mine.sampler.drop_last) == (2, False, True)
    path.write_text(json.dumps({"loader": {"num_threads": 2}}))
    with pytest.raises(ConfigError, match="needs 'storage' and 'loader'"):
        FastLoader.from_config(ds, 16, path)
