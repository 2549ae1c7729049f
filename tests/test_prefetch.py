"""CUDAPrefetcher: the conversion math (CPU path, which runs the same code), nesting, proxies, determinism."""
from __future__ import annotations

import collections
import re

import pytest
import torch
from conftest import INDEXED_N, sample_ids

from fastdata.datasets.images import FastDataset
from fastdata.errors import ConfigError
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.gpu.transfer import move
from fastdata.imaging.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loading.loader import FastLoader

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def by_hand(x_nhwc: torch.Tensor) -> torch.Tensor:
    x = x_nhwc.permute(0, 3, 1, 2).double() / 255
    return ((x - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1))
            / torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_values_shapes_dtypes_channels_last(dtype, tol):
    x = torch.randint(0, 256, (4, 6, 5, 3), dtype=torch.uint8)
    y = torch.tensor([1, 0, 2, 1], dtype=torch.int32)
    (out, labels), = list(CUDAPrefetcher([(x, y)], device="cpu", dtype=dtype))
    assert out.shape == (4, 3, 6, 5) and out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out.double(), by_hand(x), atol=tol, rtol=tol)
    assert labels.dtype == torch.int64 and labels.tolist() == [1, 0, 2, 1]


def test_normalize_false_gives_unit_floats():
    x = torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8)
    (out,), = list(CUDAPrefetcher([(x,)], device="cpu", normalize=False))
    assert torch.allclose(out, x.permute(0, 3, 1, 2).float() / 255)
    gray = x[..., :1].contiguous()  # x / 255 fits any channel count, in one batch and across batches
    (g, c), (g2,) = list(CUDAPrefetcher([(gray, x), (gray,)], device="cpu", normalize=False))
    assert torch.allclose(g, gray.permute(0, 3, 1, 2).float() / 255) and torch.equal(c, out) and torch.equal(g2, g)


def test_nested_batches_and_non_images():
    Pair = collections.namedtuple("Pair", "img tokens")
    img = torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8)
    tokens = torch.randint(0, 60000, (2, 9), dtype=torch.int32).to(torch.uint16)
    batch = {"a": Pair(img, tokens), "b": [torch.ones(3), "name", 7], "mask": torch.zeros(2, 5, dtype=torch.uint8)}
    (out,) = list(CUDAPrefetcher([batch], device="cpu"))
    assert isinstance(out["a"], Pair) and out["a"].img.shape == (2, 3, 4, 4) and out["a"].img.dtype == torch.float32
    assert out["a"].tokens.dtype == torch.int64 and torch.equal(out["a"].tokens, tokens.long())  # never normalised
    assert out["b"][1:] == ["name", 7] and torch.equal(out["b"][0], torch.ones(3))
    assert out["mask"].dtype == torch.int64  # a 2-D uint8 tensor is not an image


def test_views_of_one_buffer_cross_once_and_never_alias_it():
    window = torch.arange(4 * 9, dtype=torch.int32).to(torch.uint16).view(4, 9)  # a token batch: x, y views
    x, y = window[:, :-1], window[:, 1:]
    col = torch.arange(400, dtype=torch.int16).view(20, 20)[:, 3]  # a view spanning far more than it reads
    ones = torch.ones(1, dtype=torch.float32).expand(6)
    (mx, my, mcol, mones), host = move((x, y, col, ones), torch.device("cpu"), pin=False)
    assert torch.equal(mx, x) and torch.equal(my, y) and torch.equal(mcol, col) and torch.equal(mones, ones)
    assert mx.untyped_storage().data_ptr() == my.untyped_storage().data_ptr()  # one copy for x and y...
    assert mx.untyped_storage().nbytes() == window.numel() * 2  # ...of the window buffer, not twice its size
    assert mcol.untyped_storage().nbytes() == 20 * 2  # the sparse view crossed as a compact copy
    assert mones.untyped_storage().nbytes() == 4
    (px, py), = list(CUDAPrefetcher([(x, y)], device="cpu"))
    assert px.dtype == torch.int64 and torch.equal(px, x.long()) and torch.equal(py, y.long())
    window.zero_()
    assert mx[0, 1] == 1 and my[-1, -1] == 35  # copies, not aliases of the loader's buffer
    assert len(host) == 3


def test_a_contiguous_view_outside_the_views_span_crosses_on_its_own():
    buf = torch.arange(5 * 9, dtype=torch.int32).view(5, 9)  # 4 token windows and one more row
    batch = (buf[:4, :-1], buf[:4, 1:], buf[4], buf[1])  # the last row lies outside x's and y's span
    moved, _ = move(batch, torch.device("cpu"), pin=False)
    assert all(torch.equal(m, t) for m, t in zip(moved, batch))
    assert moved[3].untyped_storage().data_ptr() == moved[0].untyped_storage().data_ptr()  # inside: a view
    (_, _, z, _), = list(CUDAPrefetcher([batch], device="cpu"))
    assert torch.equal(z, buf[4].long())


def test_empty_loader_yields_nothing():
    assert list(CUDAPrefetcher([], device="cpu")) == []


def test_proxies_and_fastloader_round_trip(indexed_datasets):
    ds = FastDataset(indexed_datasets["npy"])
    loader = FastLoader(ds, 16, seed=2)
    pf = CUDAPrefetcher(loader, device="cpu")
    assert len(pf) == len(loader) == 7 and pf.dataset is ds and pf.sampler is loader.sampler
    pf.set_epoch(3)
    assert loader.sampler.epoch == 3
    seen, kept = [], []
    for x, y in pf:
        assert x.dtype == torch.float32 and x.shape[1:] == (3, 8, 8) and y.dtype == torch.int64
        kept.append(x)  # outputs are owned: they stay valid after the loader refills its buffers
    for x in kept:
        back = torch.round((x.permute(0, 2, 3, 1) * torch.tensor(STD) + torch.tensor(MEAN)) * 255)
        seen += sample_ids(back.to(torch.uint8)).tolist()
    assert sorted(seen) == list(range(INDEXED_N))
    assert pf.state_dict() == loader.state_dict()


def augmenting(ds, seed=0):
    return CUDAPrefetcher(FastLoader(ds, 10, seed=1), device="cpu", seed=seed,
                          transforms=Compose([RandomResizedCrop(6), RandomHorizontalFlip()]))


def test_augmentations_reproducible_and_resumable(indexed_datasets):
    ds = FastDataset(indexed_datasets["npy"])
    run1 = [x for x, _ in augmenting(ds)]
    run2 = [x for x, _ in augmenting(ds)]
    assert all(torch.equal(a, b) for a, b in zip(run1, run2)) and run1[0].shape == (10, 3, 6, 6)
    assert not torch.equal(run1[0], [x for x, _ in augmenting(ds, seed=9)][0])
    # stop after 4 batches, resume from the state: the remaining batches get the same augmentations
    pf = augmenting(ds)
    it = iter(pf)
    for _ in range(4):
        next(it)
    state = pf.state_dict()
    resumed = augmenting(ds)
    resumed.load_state_dict(state)
    rest = [x for x, _ in resumed]
    assert len(rest) == 6 and all(torch.equal(a, b) for a, b in zip(rest, run1[4:]))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def served(pf: CUDAPrefetcher, epochs: range, stop: int = -1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A torch-style loop's batches over ``epochs`` (on the host), ending with a ``break`` after ``stop`` batches."""
    out = []
    for epoch in epochs:
        pf.set_epoch(epoch)
        for x, y in pf:
            out.append((x.cpu(), y.cpu()))
            if len(out) == stop:
                break
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("cut", [3, 6, 7])  # mid-epoch, the last batch still to come, after the epoch's last batch
def test_a_loop_that_breaks_resumes_at_the_first_batch_it_did_not_see(indexed_datasets, device, run_ahead, cut):
    """NOTE [prefetch] 11: on a GPU (or with the side thread) the look-ahead fetched batches the consumer never
    saw; a state saved after the break, and the same prefetcher iterated again, must still serve them."""
    ds = FastDataset(indexed_datasets["npy"])

    def prefetcher() -> CUDAPrefetcher:
        return CUDAPrefetcher(FastLoader(ds, 16, seed=2), device=device, normalize=False, depth=2,
                              run_ahead=run_ahead)

    whole = served(prefetcher(), range(2))
    assert len(whole) == 14
    pf = prefetcher()
    first = served(pf, range(1), stop=cut)
    state = pf.state_dict()
    assert state["epoch"] == 0 and state["position"] == min(cut * 16, INDEXED_N)
    again = served(pf, range(1)) + served(pf, range(1, 2))  # the same prefetcher, iterated on
    resumed = prefetcher()
    resumed.load_state_dict(state)
    rest = served(resumed, range(state["epoch"], 2))
    for got in (first + again, first + rest):
        assert len(got) == len(whole)
        assert all(torch.equal(x, xw) and torch.equal(y, yw) for (x, y), (xw, yw) in zip(got, whole))


class Failing(RandomHorizontalFlip):
    """A flip that raises ``error`` on its ``at``-th batch."""

    def __init__(self, at: int, error: type[BaseException] = ValueError) -> None:
        super().__init__()
        self.at, self.calls, self.error = at, 0, error

    def __call__(self, x, generator=None):
        self.calls += 1
        if self.calls == self.at:
            raise self.error(f"batch {self.at} is bad")
        return super().__call__(x, generator)


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])  # a bad transform, a Ctrl-C landing in it
def test_a_batch_whose_conversion_raised_is_served_again(indexed_datasets, run_ahead, error):
    """NOTE [prefetch] 11: the consumer never saw the batch whose transforms raised; the state, and the same
    prefetcher iterated again, start at it, with the same draws."""
    ds = FastDataset(indexed_datasets["npy"])

    def prefetcher(at: int) -> CUDAPrefetcher:
        return CUDAPrefetcher(FastLoader(ds, 16, seed=2), device="cpu", normalize=False, depth=2,
                              run_ahead=run_ahead, transforms=Failing(at, error))

    whole = served(prefetcher(at=0), range(1))
    pf = prefetcher(at=3)
    seen = []
    with pytest.raises(error, match="batch 3 is bad"):
        for x, y in pf:
            seen.append((x, y))
    assert len(seen) == 2 and pf.state_dict()["position"] == 2 * 16
    got = seen + served(pf, range(1))
    assert len(got) == len(whole) == 7
    assert all(torch.equal(x, xw) and torch.equal(y, yw) for (x, y), (xw, yw) in zip(got, whole))


@pytest.mark.parametrize("depth", [1, 3])
def test_a_loaders_error_comes_after_the_batches_fetched_before_it(depth):
    """The look-ahead hands out every batch the loader gave before it raised, then the error, as the
    synchronous path does (and a job's error, at its batch's turn)."""
    def loader():
        for i in range(5):
            yield torch.full((2, 4, 4, 3), i, dtype=torch.uint8), torch.tensor([i, i])
        raise OSError("the shard of batch 5 is unreadable")

    for run_ahead in (False, True):
        seen = []
        with pytest.raises(OSError, match="unreadable"):
            for _, y in CUDAPrefetcher(loader(), device="cpu", depth=depth, run_ahead=run_ahead):
                seen.append(int(y[0]))
        assert seen == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_conversion_error_launched_inline_comes_at_its_turn(depth):
    """On a GPU without run_ahead the look-ahead launches each batch inline: a batch's conversion error was
    raised from the launch, before the batches fetched ahead of it were handed out (the CUDA path, run here
    on the CPU: the same code without its stream)."""
    class FailsAt4(RandomHorizontalFlip):
        calls = 0

        def __call__(self, x, generator=None):
            self.calls += 1
            if self.calls == 4:
                raise ValueError("batch 3 is bad")
            return super().__call__(x, generator)

    batches = [(torch.full((2, 4, 4, 3), i, dtype=torch.uint8), torch.tensor([i, i])) for i in range(6)]
    pf = CUDAPrefetcher(batches, device="cpu", depth=depth, transforms=FailsAt4(), run_ahead=False)
    pf._batch_in_epoch, seen = 0, []  # (as an iteration sets it)
    with pytest.raises(ValueError, match="batch 3 is bad"):
        for _, y in pf._iter_ahead():  # (the path device="cuda" takes)
            seen.append(int(y[0]))
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_the_side_thread_serves_the_loaders_order_with_buffers_in_heavy_reuse(indexed_datasets, device):
    """NOTE [prefetch thread]: batches in order, each equal to the synchronous path's, with a loader of two
    buffers (a buffer released before its job ran would be refilled under it); a job's error comes at its
    batch's turn, and the state then points at that batch."""
    ds = FastDataset(indexed_datasets["npy"])
    aug = Compose([RandomResizedCrop(6), RandomHorizontalFlip()])
    # the reference on the same device (bilinear crops differ between devices in the last bits)
    want = served(CUDAPrefetcher(FastLoader(ds, 8, seed=0, copy=True), device=device, transforms=aug), range(3))
    pf = CUDAPrefetcher(FastLoader(ds, 8, seed=0, num_threads=2, prefetch=0), device=device, transforms=aug,
                        depth=3, run_ahead=True)
    got = served(pf, range(3))
    assert len(got) == len(want) == 39
    assert all(torch.equal(x, xw) and torch.equal(y, yw) for (x, y), (xw, yw) in zip(got, want))
    bad = CUDAPrefetcher(FastLoader(ds, 8, seed=0, num_threads=2, prefetch=0), device=device, depth=3,
                         run_ahead=True, transforms=Failing(at=5))
    seen = []
    with pytest.raises(ValueError, match="batch 5 is bad"):
        for x, y in bad:
            seen.append(y.cpu())
    assert len(seen) == 4 and bad.state_dict()["position"] == 4 * 8
    assert all(torch.equal(a, b) for a, (_, b) in zip(seen, want))


def test_the_side_thread_reads_a_batch_the_source_reuses_only_from_its_own_copy():
    """NOTE [prefetch thread] 8: a source without iter_batches may refill a batch's memory at the next next();
    the side thread, reading it later, must see the batch as it was handed over."""
    def reused(n: int):
        x, y = torch.zeros(4, 5, 5, 3, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64)
        for i in range(n):
            x.fill_(i)
            y.fill_(i)
            yield x, y

    got = [y.clone() for _, y in CUDAPrefetcher(reused(50), device="cpu", depth=3, run_ahead=True)]
    assert [int(y[0]) for y in got] == list(range(50)) and all(bool((y == y[0]).all()) for y in got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run_ahead", [False, True])
def test_one_iteration_is_live_at_a_time(indexed_datasets, device, run_ahead):
    """A new iteration, set_epoch or load_state_dict closes the one under way; it never serves again, and
    its close never moves the loader off the newer position."""
    ds = FastDataset(indexed_datasets["npy"])
    whole = served(CUDAPrefetcher(FastLoader(ds, 16, seed=2), device=device, normalize=False), range(1))
    pf = CUDAPrefetcher(FastLoader(ds, 16, seed=2), device=device, normalize=False, depth=2, run_ahead=run_ahead)
    old = iter(pf)
    head = [next(old) for _ in range(2)]
    new = iter(pf)
    with pytest.raises(StopIteration):
        next(old)
    got = [(x.cpu(), y.cpu()) for x, y in head] + [(x.cpu(), y.cpu()) for x, y in new]
    assert all(torch.equal(x, xw) and torch.equal(y, yw) for (x, y), (xw, yw) in zip(got, whole))
    assert len(got) == len(whole)
    start = pf.state_dict()
    old = iter(pf)
    next(old)
    pf.load_state_dict(start)  # closes `old`: its close must not rewind the loader afterwards
    with pytest.raises(StopIteration):
        next(old)
    del old
    assert pf.state_dict()["position"] == start["position"]


@pytest.mark.cuda
def test_run_ahead_captures_on_the_training_thread_beside_the_models_random_ops(indexed_datasets):
    """NOTE [graphed convert] 13: a capture marks torch's default CUDA generator as capturing for the whole
    process; on the side thread it made the model's dropout fail. Captures now happen on the training thread:
    the side thread only notes a shape that is due."""
    import threading

    ds = FastDataset(indexed_datasets["npy"])
    pf = CUDAPrefetcher(FastLoader(ds, 16, seed=0), device="cuda", depth=2, run_ahead=True,
                        transforms=Compose([RandomResizedCrop(8), RandomHorizontalFlip()]))
    fn, on = pf._graphed.fn, []

    def watched(x, draws):  # where each capture runs
        if torch.cuda.is_current_stream_capturing():
            on.append(threading.current_thread() is threading.main_thread())
        return fn(x, draws)

    pf._graphed.fn = watched
    for _ in range(3):
        for x, _ in pf:
            torch.nn.functional.dropout(torch.ones(1 << 10, device="cuda"), 0.5)  # the model's draws
    torch.cuda.synchronize()
    assert pf._graphed.graphs and not pf._graphed.failed and on and all(on), on


def test_bad_arguments():
    from fastdata.errors import ConfigError

    with pytest.raises(ConfigError, match="depth"):
        CUDAPrefetcher([], device="cpu", depth=0)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            CUDAPrefetcher([], device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("run_ahead", [False, True])
def test_gpu_batches_match_the_host_source_under_heavy_buffer_reuse(indexed_datasets, run_ahead):
    ds = FastDataset(indexed_datasets["npy"])
    loader = FastLoader(ds, 8, seed=0, num_threads=2, prefetch=0)  # 2 slots: constant reuse
    pf = CUDAPrefetcher(loader, device="cuda", normalize=False, depth=2, run_ahead=run_ahead)
    ref = CUDAPrefetcher(FastLoader(ds, 8, seed=0, copy=True), device="cpu", normalize=False)
    side = pf._side_stream()
    got, want = [], []
    for epoch in range(3):
        pf.set_epoch(epoch)
        ref.set_epoch(epoch)
        for (x, y), (xr, yr) in zip(pf, ref):
            with torch.cuda.stream(side):  # the next batch's copies start late while the host runs on:
                torch.cuda._sleep(2_000_000)  # a buffer released before its copy ended would be refilled
            got.append((x.clone(), y.clone()))  # no host sync per batch
            want.append((xr, yr))
    torch.cuda.synchronize()
    assert len(got) == 3 * len(pf) and all(x.device.type == "cuda" for x, _ in got)
    for (x, y), (xr, yr) in zip(got, want):
        assert torch.equal(x.cpu(), xr) and torch.equal(y.cpu(), yr)
    assert pf._stream is side  # one side stream, created once
    stream = pf._stream
    list(pf)
    assert pf._stream is stream


@pytest.mark.cuda
def test_gpu_memory_flat_over_1000_iterations(indexed_datasets):
    pf = CUDAPrefetcher(FastLoader(FastDataset(indexed_datasets["npy"]), 16), device="cuda",
                        dtype=torch.bfloat16, transforms=Compose([RandomResizedCrop(8), RandomHorizontalFlip()]))
    steps = 0
    for _ in range(3):
        for x, _ in pf:
            steps += 1
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    while steps < 1000:
        for x, _ in pf:
            steps += 1
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - start < 1 << 20


@pytest.mark.cuda
def test_h2d_copy_overlaps_compute_on_the_side_stream(tmp_path):
    """A profiler trace shows a host-to-device copy on the prefetch stream running during a compute kernel."""
    import json

    batches = [(torch.randint(0, 256, (128, 224, 224, 3), dtype=torch.uint8).pin_memory(),
                torch.zeros(128, dtype=torch.long)) for _ in range(6)]
    pf = CUDAPrefetcher(batches, device="cuda", dtype=torch.bfloat16)
    list(pf)  # the conversion captured in its CUDA graph before the profiler starts (NOTE [graphed convert])
    a = torch.randn(4096, 4096, device="cuda")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for x, _ in pf:
            for _ in range(4):
                a = torch.tanh(a @ a)  # ~ms of compute per batch on the main stream
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel" and "gemm" in e.get("name", "").lower()]
    assert copies and kernels
    side = {e["args"]["stream"] for e in copies}
    assert not side & {e["args"]["stream"] for e in kernels}  # copies never on the compute stream
    overlap = any(c["ts"] < k["ts"] + k["dur"] and k["ts"] < c["ts"] + c["dur"] for c in copies for k in kernels)
    assert overlap, "no H2D copy ran concurrently with a compute kernel"


@pytest.mark.cuda
def test_gpu_token_windows_and_gpu_storage_match_the_cpu_path(tmp_path, indexed_datasets):
    from fastdata.cli.main import main
    from fastdata.datasets.tokens import TokenDataset

    text = "".join(f"document {i} " * (i % 7 + 1) + "\n" for i in range(300))
    (tmp_path / "t.txt").write_text(text)
    assert main(["preprocess", "text", str(tmp_path / "t.txt"), str(tmp_path / "tok"), "--quiet",
                 "--val-fraction", "0", "--shard-tokens", "900"]) == 0
    tokens = TokenDataset(tmp_path / "tok", seq_len=64)
    pf = CUDAPrefetcher(FastLoader(tokens, 8, seed=0, num_threads=2, prefetch=0), device="cuda", depth=2)
    ref = CUDAPrefetcher(FastLoader(tokens, 8, seed=0, copy=True), device="cpu")
    got = []
    for (x, y), (xr, yr) in zip(pf, ref):  # x and y crossed as one window buffer
        with torch.cuda.stream(pf._side_stream()):
            torch.cuda._sleep(2_000_000)  # late copies: a window buffer released too early would be refilled
        assert x.device.type == "cuda" and x.dtype == torch.int64
        got.append((x.clone(), y.clone(), xr, yr))
    torch.cuda.synchronize()
    assert len(got) == len(pf) and all(torch.equal(x.cpu(), xr) and torch.equal(y.cpu(), yr) for x, y, xr, yr in got)
    images = FastDataset(indexed_datasets["npy"], storage="cuda")
    pf = CUDAPrefetcher(FastLoader(images, 16, seed=0), device="cuda", normalize=False)
    ref = CUDAPrefetcher(FastLoader(FastDataset(indexed_datasets["npy"]), 16, seed=0, copy=True), device="cpu",
                         normalize=False)
    for (x, y), (xr, yr) in zip(pf, ref):  # gathered on the GPU by the loader, read on the side stream
        assert torch.equal(x.cpu(), xr) and torch.equal(y.cpu(), yr)


def test_each_rank_draws_its_own_augmentation(indexed_datasets):
    ds = FastDataset(indexed_datasets["npy"])

    def seed_after_one_batch(rank: int) -> int:
        pf = CUDAPrefetcher(FastLoader(ds, 8, seed=1, rank=rank, world_size=2), device="cpu",
                            transforms=RandomHorizontalFlip(), seed=7)
        next(iter(pf))
        return pf._seeded().seed  # the draws of the batch just served

    assert seed_after_one_batch(0) == seed_after_one_batch(0) != seed_after_one_batch(1)


class InMemory(torch.utils.data.Dataset):
    """40 random 9x9 RGB samples and their ids, for a torch DataLoader."""

    def __init__(self) -> None:
        self.x = torch.randint(0, 256, (40, 9, 9, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_over_a_fastdata_sampler_resumes_with_the_same_draws(workers):
    """docs/gpu.md: a resumed run draws the same, also for a DataLoader(batch_sampler=DistributedBatchSampler),
    whose workers take batches ahead (at the resumed epoch's end, the sampler is in the next epoch already)."""
    from torch.utils.data import DataLoader

    from fastdata.loading.sampler import DistributedBatchSampler

    def prefetcher(state=None):
        sampler = DistributedBatchSampler(40, 8, seed=4)
        if state is not None:
            sampler.load_state_dict(state)
        loader = DataLoader(InMemory(), batch_sampler=sampler, num_workers=workers,
                            **({"prefetch_factor": 2} if workers else {}))
        return sampler, CUDAPrefetcher(loader, device="cpu",
                                       transforms=Compose([RandomResizedCrop(5), RandomHorizontalFlip()]))

    whole = [(x, y) for x, y in prefetcher()[1]]
    sampler, pf = prefetcher()
    it = iter(pf)
    first = [next(it) for _ in range(2)]
    state = sampler.state_dict(batches=2)
    del it
    got = first + [(x, y) for x, y in prefetcher(state)[1]]
    assert len(got) == len(whole) == 5
    assert all(torch.equal(x, xw) and torch.equal(y, yw) for (x, y), (xw, yw) in zip(got, whole))


def test_a_rewound_mixture_state_names_no_source_cursors_of_the_look_ahead(indexed_datasets):
    """A look-ahead's state is the consumer's position; the loader's per-source cursors are the look-ahead's,
    so they are left out (the synchronous path's are the position's)."""
    from fastdata import Mixture

    def states(**kw) -> list[dict]:
        mix = Mixture({"a": FastDataset(indexed_datasets["npy"]), "b": FastDataset(indexed_datasets["lmdb"])},
                      weights={"a": 0.6, "b": 0.4}, seed=1)
        pf = CUDAPrefetcher(FastLoader(mix, 8, num_threads=1), device="cpu", **kw)
        return [pf.state_dict() for _ in pf]

    sync, ahead = states(), states(run_ahead=True, depth=3)
    assert len(sync) == len(ahead) > 3 and all("sources" in s for s in sync)
    for s, a in zip(sync[:-1], ahead[:-1]):  # (after the last batch, both are at the epoch's end)
        assert (a["epoch"], a["position"]) == (s["epoch"], s["position"])
        assert a.get("sources", s["sources"]) == s["sources"]


def test_a_training_batch_is_read_and_written_whole_five_times():
    """RandomResizedCrop + flip + bf16 normalise into channels_last: each pass over the whole batch costs
    memory bandwidth and, on the GPU, a launch from the training loop's thread. Five are needed (uint8 ->
    float, resample, multiply, add, cast); the flip (NOTE [flip folded into the crop]) and the layout copy
    (Normalize writes channels_last itself) add none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastdata.imaging.draws import Draws

    b, size = 32, 24
    passes: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            writes = not func.is_view and not func.__name__.startswith("empty")  # a view or an allocation reads nothing
            if writes and isinstance(out, torch.Tensor) and out.numel() >= b * 3 * size * size:
                passes.append(func.__name__)
            return out

    x = torch.randint(0, 256, (b, 40, 48, 3), dtype=torch.uint8)
    pf = CUDAPrefetcher([], device="cpu", dtype=torch.bfloat16,
                        transforms=Compose([RandomResizedCrop(size), RandomHorizontalFlip()]))
    with Count():
        out = pf.convert(x, Draws(3))
    assert out.shape == (b, 3, size, size) and out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert len(passes) == 5, passes


def test_only_fastdatas_own_transforms_are_captured_in_cuda_graphs(monkeypatch):
    from fastdata.gpu.cuda_graphs import capturable
    from fastdata.imaging.transforms import CenterCrop, Normalize, RandomCrop

    class Synced(RandomResizedCrop):  # a subclass may sync (boxes counted on the host, say): not captured
        pass

    assert capturable(None) and capturable(RandomHorizontalFlip()) and capturable(CenterCrop(4))
    assert capturable(Compose([RandomCrop(8, padding=2), RandomHorizontalFlip()]))
    assert not capturable(Synced(8)) and not capturable(Normalize())
    assert not capturable(Compose([RandomResizedCrop(8), Compose([Synced(8)])]))
    assert CUDAPrefetcher([], device="cpu")._graphed is None  # graphs are a GPU matter
    if torch.cuda.is_available():
        assert CUDAPrefetcher([], device="cuda")._graphed is not None
        assert CUDAPrefetcher([], device="cuda", transforms=Synced(8))._graphed is None
        assert CUDAPrefetcher([], device="cuda", cuda_graphs=False)._graphed is None
        monkeypatch.setenv("FASTDATA_CUDA_GRAPHS", "0")
        assert CUDAPrefetcher([], device="cuda")._graphed is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graphed_conversion_is_bit_equal_to_the_eager_one(dtype):
    """NOTE [graphed convert]: after the warm-up, every batch shape (full and the last partial one) is replayed
    from a graph, and each replay gives exactly the eager conversion's values with its own batch's draws; batches
    held past the next one are not overwritten by later replays. Images of noise: on uniform ones every crop and
    flip gives the same values, and a replay with stale draws would pass."""
    from fastdata.imaging.transforms import CenterCrop, RandomCrop

    rng = torch.Generator().manual_seed(0)
    epoch = [torch.randint(0, 256, (n, 12, 10, 3), dtype=torch.uint8, generator=rng) for n in [16] * 6 + [4]]
    labels = [torch.arange(len(x)) for x in epoch]
    for aug in (Compose([RandomResizedCrop(8), RandomHorizontalFlip()]),
                Compose([RandomCrop(8, padding=2), RandomHorizontalFlip()]), CenterCrop(6), None):
        runs = {}
        for graphs in (True, False):
            pf = CUDAPrefetcher(list(zip(epoch, labels)), device="cuda", dtype=dtype, transforms=aug,
                                cuda_graphs=graphs, depth=2)
            kept = []
            for _ in range(4):  # the prefetcher counts epochs of a plain iterable itself
                kept += [x for x, _ in pf]  # every batch kept: a replay must never write into one handed out
            runs[graphs] = (kept, pf._graphed)
        (graphed, g), (eager, _) = runs[True], runs[False]
        torch.cuda.synchronize()
        assert len(g.graphs) == 2 and not g.failed, aug  # 16 and the last batch's 4: both captured
        assert all(x.is_contiguous(memory_format=torch.channels_last) and x.dtype == dtype for x in graphed)
        assert all(torch.equal(a, b) for a, b in zip(graphed, eager)) and len(graphed) == len(eager), aug
        if aug is not None and not isinstance(aug, CenterCrop):  # each replay drew its own numbers
            assert not torch.equal(graphed[-7], graphed[-14]), aug  # the same images in epochs 3 and 2
            assert not torch.equal(graphed[-1], graphed[-8]), aug  # and the replayed partial batch


@pytest.mark.cuda
def test_a_graphed_batch_costs_the_training_thread_a_few_ops():
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastdata.imaging.draws import Draws

    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randint(0, 256, (32, 40, 48, 3), dtype=torch.uint8, device="cuda")
    pf = CUDAPrefetcher([], device="cuda", dtype=torch.bfloat16,
                        transforms=Compose([RandomResizedCrop(24), RandomHorizontalFlip()]))
    eager = CUDAPrefetcher([], device="cuda", dtype=torch.bfloat16, cuda_graphs=False, transforms=pf.transforms)
    for k in range(3):
        pf.convert(x, Draws(k))
    with Count():
        out = pf.convert(x, Draws(3))
    graphed_ops, ops[:] = list(ops), []
    with Count():
        want = eager.convert(x, Draws(3))
    assert torch.equal(out, want) and len(pf._graphed.graphs) == 1
    assert len(graphed_ops) <= 4 < 100 <= len(ops), (graphed_ops, len(ops))  # copy in, key, cast out


FAILED_CAPTURE = """
import warnings, torch
from fastdata.imaging.draws import Draws
from fastdata.gpu.cuda_graphs import GraphedConvert

def syncing(x, draws):  # .item() cannot be captured
    return x.float() * float(draws.rand(1, device=x.device).sum().item())

graphed = GraphedConvert(syncing)
x = torch.randint(0, 256, (4, 6, 6, 3), dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()
with warnings.catch_warnings(record=True) as caught, torch.cuda.stream(side):
    warnings.simplefilter("always")
    outs = [graphed(x, Draws(k)) for k in range(5)]
    assert torch.cuda.current_stream() == side  # the caller's stream is current again
assert [str(w.message).count("could not capture") for w in caught] == [1], [str(w.message) for w in caught]
assert graphed.failed and not graphed.graphs
assert all(torch.equal(o, syncing(x, Draws(k))) for k, o in enumerate(outs))
y = torch.randn(256, 256, device="cuda")
assert torch.allclose(y @ y, (y.double() @ y.double()).float(), atol=1e-2)  # the device still works
print("ok")
"""


@pytest.mark.cuda
def test_a_failed_capture_leaves_the_eager_path_with_a_warning():
    """Run in a process of its own: whatever a failed capture leaves in torch's allocator stays there."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", FAILED_CAPTURE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def ahead_items(n: int, fail_at: int = -1, restart_at: int = -1, log: list | None = None):
    """A producer for RunAhead: n items (x filled with i, tag i); raises at ``fail_at``; calls
    ``caught_up`` before item ``restart_at`` and logs how many the consumer had taken then."""
    def produce(caught_up):
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"bad item {i}")
            if i == restart_at:
                caught_up()
                log.append(taken[0])
            yield torch.full((2, 3), float(i)), torch.tensor([i]), i
    taken = [0]
    return produce, taken


def test_run_ahead_hands_over_every_item_in_order_and_raises_the_producers_error():
    from fastdata.loading.run_ahead import RunAhead

    produce, _ = ahead_items(7)
    ahead = RunAhead(produce, torch.device("cpu"), depth=2)
    got = [(float(x[0, 0]), int(y), tag) for x, y, tag in ahead]
    assert got == [(float(i), i, i) for i in range(7)] and ahead.produced == 7 and ahead.busy_s > 0
    produce, _ = ahead_items(7, fail_at=4)
    seen = []
    with pytest.raises(ValueError, match="bad item 4"):
        for _, _, tag in RunAhead(produce, torch.device("cpu")):
            seen.append(tag)
    assert seen == [0, 1, 2, 3]  # every item before the error, then the error itself


def test_run_ahead_restarts_only_once_the_consumer_took_everything_before():
    import time

    from fastdata.loading.run_ahead import RunAhead

    log: list = []
    produce, taken = ahead_items(8, restart_at=5, log=log)

    def take(tag):  # the consumer's bookkeeping, slow: the producer runs ahead, then waits at item 5
        time.sleep(0.02)
        taken[0] += 1

    tags = [tag for _, _, tag in RunAhead(produce, torch.device("cpu"), depth=4, on_take=take)]
    assert tags == list(range(8)) and log == [5]


def test_run_ahead_close_stops_a_producer_blocked_on_a_full_queue():
    from fastdata.loading.run_ahead import RunAhead

    produce, _ = ahead_items(10_000)
    ahead = RunAhead(produce, torch.device("cpu"), depth=1)
    it = iter(ahead)
    assert next(it)[2] == 0
    ahead.close()
    assert not ahead.thread.is_alive() and ahead.produced < 10


@pytest.mark.cuda
def test_run_ahead_batches_are_read_only_after_the_side_streams_work():
    """The producer's stream is busy before it writes each batch; the consumer's reads must wait for the
    event, not find the buffer half-written."""
    from fastdata.loading.run_ahead import RunAhead

    def produce(caught_up):
        for i in range(6):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(50_000_000)  # tens of ms of work on the loader thread's stream first
            x.fill_(float(i + 1))
            yield x, torch.full((4,), i, device="cuda"), i
    for x, y, i in RunAhead(produce, torch.device("cuda")):
        assert torch.equal(x, torch.full_like(x, float(i + 1))) and torch.equal(y, torch.full_like(y, i))


ENDS_OPEN = """
import sys, torch
from fastdata.gpu.prefetch import CUDAPrefetcher
from fastdata.imaging.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop
from fastdata.loading.run_ahead import RunAhead

if sys.argv[1] == "prefetcher":
    batches = [(torch.randint(0, 256, (32, 160, 160, 3), dtype=torch.uint8), torch.arange(32)) for _ in range(8)]
    it = iter(CUDAPrefetcher(batches, device="cpu", depth=2, run_ahead=True,
                             transforms=Compose([RandomResizedCrop(128), RandomHorizontalFlip()])))
else:  # DALILoader's loader thread, its producer busy in torch ops
    def produce(caught_up):
        big = torch.randint(0, 256, (32, 3, 256, 256), dtype=torch.uint8)
        for i in range(1000):
            yield torch.nn.functional.interpolate(big.float(), size=(224, 224), mode="bilinear"), torch.arange(32), i

    it = iter(RunAhead(produce, torch.device("cpu")))
for _ in range(3):  # (a max_steps loop over a kept iterator, then the script ends)
    next(it)
print("ended", flush=True)
"""


@pytest.mark.parametrize("thread", ["prefetcher", "run_ahead"])
def test_a_script_that_ends_with_an_iteration_open_exits_cleanly(thread):
    """The look-ahead thread is a daemon: one still inside a torch op when the interpreter finalised was
    unwound through C++ frames, and the finished script died with 'terminate called without an active
    exception' (exit status 134)."""
    import subprocess
    import sys

    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", ENDS_OPEN, thread], capture_output=True, text=True, timeout=300)
        assert (run.returncode, run.stdout) == (0, "ended\n"), run.stderr[-2000:]


@pytest.mark.parametrize("device", DEVICES)
def test_transforms_set_between_epochs_take_effect_after_a_capture(device):
    """Progressive resizing (``pf.transforms = ...`` between epochs): on a GPU the graphs captured of the
    old transforms were keyed by batch shape only, so every later batch replayed the old crop size."""
    batches = [(torch.randint(0, 256, (8, 20, 20, 3), dtype=torch.uint8), torch.arange(8)) for _ in range(4)]
    pf = CUDAPrefetcher(batches, device=device, transforms=Compose([RandomResizedCrop(12), RandomHorizontalFlip()]))
    for _ in range(3):  # (a shape is captured once seen twice)
        assert {tuple(x.shape) for x, _ in pf} == {(8, 3, 12, 12)}
    pf.transforms = Compose([RandomResizedCrop(16), RandomHorizontalFlip()])
    assert {tuple(x.shape) for x, _ in pf} == {(8, 3, 16, 16)}
    pf.transforms = None
    got = [x for x, _ in pf]
    assert {tuple(x.shape) for x in got} == {(8, 3, 20, 20)}
    want = CUDAPrefetcher(batches, device=device)
    assert all(torch.equal(a, b) for (b, _), a in zip(want, got, strict=True))


@pytest.mark.parametrize("kwargs, needle", [
    ({"seed": -1}, "seed must be an integer >= 0, got seed=-1"), ({"seed": 1.5}, "got seed=1.5"),
    ({"transforms": [RandomHorizontalFlip()]}, "wrap the list in Compose"),
    ({"transforms": "flip"}, "transforms must be a fastdata transform"),
])
def test_a_bad_seed_or_transforms_is_refused_when_the_prefetcher_is_made(kwargs, needle):
    # each failed only at the first batch: numpy's "expected non-negative integer", "'list' object is not callable"
    with pytest.raises(ConfigError, match=re.escape(needle)):
        CUDAPrefetcher([], device="cpu", **kwargs)
