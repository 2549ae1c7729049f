"""Mixture: the schedule's proportions in every window, exactly once per source epoch, resume and reweight at any
world size (real torchrun on gloo), mix="batch", tokens, streamed sources, bad input; on datasets made by
`fastdata preprocess`."""
from __future__ import annotations

import itertools
import json
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import sample_ids, torchrun
from PIL import Image
from test_fields import indexed_fields  # noqa: F401 - 30 samples whose every field encodes the sample

from fastdata.datasets.mixture import MASK, SHIFT, Mixture, cache_shares
from fastdata.errors import ConfigError
from fastdata.loading.loader import FastLoader
from fastdata.loading.mixing import MixtureSampler
from fastdata.loading.schedule import Q, Schedule, quantise

SIZES = {"a": 100, "b": 37, "c": 60}  # three sources, tagged 0, 1, 2 in their pixels
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
WORKER = Path(__file__).parent / "dist_mixture_worker.py"


def tagged_source(root: Path, n: int, tag: int) -> Path:
    """A CSV list of ``n`` (<= 100) uniform 8x8 PNGs: sample i's colour says i (as conftest.indexed_source) and
    the source's ``tag`` (blue), label i % 3."""
    root.mkdir(parents=True)
    rows = []
    for i in range(n):
        Image.new("RGB", (8, 8), (i // 10 * 25, i % 10 * 25, 9 + 40 * tag)).save(root / f"{i:05d}.png")
        rows.append(f"{i:05d}.png,{i % 3}")
    (root / "list.csv").write_text("\n".join(rows) + "\n")
    return root / "list.csv"


def tags_ids(x) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (source tag, sample index), read from its pixels (see tagged_source)."""
    blue = np.asarray(x)[..., 0, 0, 2].astype(float)
    return np.rint((blue - 9) / 40).astype(np.int64), sample_ids(x)


@pytest.fixture(scope="session")
def mixed_sets(tmp_path_factory) -> dict[str, Path]:
    """``{name: npy dataset folder}`` for SIZES, shards of 16 samples."""
    from fastdata.cli.main import main

    base = tmp_path_factory.mktemp("mixed")
    out = {}
    for tag, (name, n) in enumerate(SIZES.items()):
        csv = tagged_source(base / f"src-{name}", n, tag)
        out[name] = base / name
        assert main(["preprocess", "images", str(csv), str(out[name]), "--size", "8", "--format", "npy",
                     "--shard-size", "16", "--workers", "1", "--quiet"]) == 0
    return out


def open_mixture(sets: dict[str, Path], **kw) -> Mixture:
    from fastdata.datasets.images import FastDataset

    storage = kw.pop("storage", "mmap")
    return Mixture({k: FastDataset(v, storage=storage) for k, v in sets.items()}, **{"weights": WEIGHTS, **kw})


def stream(mix: Mixture, positions: int, state: dict | None = None, batch: int = 4) -> np.ndarray:
    """The global stream's first ``positions`` served indices (world-size independent), from ``state`` on."""
    s = MixtureSampler(mix, batch, rank=0, world_size=1)
    if state is not None:
        s.load_state_dict(state)
    return s.codes(s.seg, s.start + np.arange(positions, dtype=np.int64))


def per_source(codes: np.ndarray, k: int) -> np.ndarray:
    return codes[(codes >> SHIFT) == k] & MASK


def assert_epochs_exact(seq: np.ndarray, n: int) -> None:
    """A source's draws in order: each whole block of ``n`` is a permutation, the last block repeats nothing."""
    for e in range(0, len(seq), n):
        block = seq[e:e + n]
        assert len(set(block.tolist())) == len(block) and block.min() >= 0 and block.max() < n, (e, block)


def assert_windows(codes: np.ndarray, weights: list[float], window: int = 10_000, tol: float = 0.005) -> float:
    """Every window of ``window`` consecutive positions holds each source's weight within ``tol``."""
    worst = 0.0
    for k, w in enumerate(weights):
        c = np.concatenate([[0], np.cumsum((codes >> SHIFT) == k)])
        share = (c[window:] - c[:-window]) / window
        worst = max(worst, float(np.abs(share - w).max()))
    assert worst <= tol, worst
    return worst


# -- the schedule ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [0.5, 0.5], [3, 1, 0, 7, 2, 5, 0.01], [1.0]])
def test_schedule_keeps_every_window_within_a_few_samples(weights):
    q = quantise(weights)
    assert sum(q) == Q and all((a > 0) == (b > 0) for a, b in zip(q, weights))
    sched = Schedule(q, (11, 0, 0))
    n = 300_000
    src, rank = sched.locate(np.arange(n, dtype=np.int64))
    for k in range(len(weights)):
        mine = np.flatnonzero(src == k)
        assert np.array_equal(rank[mine], np.arange(len(mine)))  # the k-th position of a source is its k-th draw
        c = np.concatenate([[0], np.cumsum(src == k)])
        for window in (100, 10_000):  # any window, every start: within 2 * depth samples of the weight
            got = c[window:] - c[:-window]
            assert np.abs(got - window * q[k] / Q).max() <= 2 * sched.depth + 1e-9
        if q[k]:
            j = len(mine) // 2
            assert sched.positions_for(k, j) == mine[j - 1] + 1  # where the j-th draw falls


def test_schedule_jumps_to_any_position_without_replaying():
    sched = Schedule(quantise([0.6, 0.3, 0.1]), (0, 3, 0))
    far = 10**15 + np.arange(50_000, dtype=np.int64)  # far beyond any stream: int64 exact, nothing replayed
    src, rank = sched.locate(far)
    for k in range(3):
        before = sched.count(k, 10**15)
        mine = np.flatnonzero(src == k)
        assert np.array_equal(rank[mine], before + np.arange(len(mine)))
        assert abs(before - 10**15 * sched.weights[k] / Q) <= sched.depth
    other = Schedule(quantise([0.6, 0.3, 0.1]), (1, 3, 0)).locate(np.arange(1000))[0]
    assert not np.array_equal(other, sched.locate(np.arange(1000))[0])  # the seed moves the phases


# -- one process --------------------------------------------------------------------------------------------
def test_every_source_is_served_exactly_once_per_source_epoch(mixed_sets):
    mix = open_mixture(mixed_sets, seed=5, epoch_size=60_000)  # stream only: no sample is read
    s = MixtureSampler(mix, 8, rank=0, world_size=1)
    codes = np.concatenate([b for _ in range(3) for b in s])  # three mixture epochs, in position order
    for k, n in enumerate(SIZES.values()):
        seq = per_source(codes, k)
        assert len(seq) > 20 * n
        assert_epochs_exact(seq, n)
    assert assert_windows(codes, list(WEIGHTS.values())) < 0.001


def test_loader_batches_are_the_stream_and_storage_or_threads_do_not_change_them(mixed_sets):
    ref = stream(open_mixture(mixed_sets, seed=2), 208)  # epoch of 197 positions, rounded up to batches of 16
    got = {}
    for storage, threads in (("mmap", 1), ("ram", 3)):
        loader = FastLoader(open_mixture(mixed_sets, seed=2, storage=storage), 16, num_threads=threads)
        got[storage] = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got["mmap"]) == 13 and all(torch.equal(a, b) for p, q in zip(got["mmap"], got["ram"])
                                           for a, b in zip(p, q))
    for t, (x, y) in enumerate(got["mmap"]):
        want = np.sort(ref[t * 16:(t + 1) * 16])  # a batch's rows are grouped by source, ascending
        tag, ids = tags_ids(x)
        assert np.array_equal(tag, want >> SHIFT) and np.array_equal(ids, want & MASK)
        assert np.array_equal(y.numpy(), ids % 3)


def test_resume_continues_the_stream_exactly_across_epochs(mixed_sets):
    def served(loader, n):
        out = []
        for x, _ in loader:
            out.append(np.stack(tags_ids(x)))
            if len(out) == n:
                break
        return out
    whole = open_mixture(mixed_sets, seed=4, stop="first")
    loader = FastLoader(whole, 8, num_threads=2)
    ref = served(loader, 1000) + served(loader, 1000)  # two epochs, uninterrupted
    cut = FastLoader(open_mixture(mixed_sets, seed=4, stop="first"), 8, num_threads=2)
    first = served(cut, 5)
    state = json.loads(json.dumps(cut.state_dict()))  # what a checkpoint holds
    assert state["position"] == 40 and state["sources"]["a"]["epoch"] == 0
    again = FastLoader(open_mixture(mixed_sets, seed=4, stop="first"), 8, num_threads=1)
    again.load_state_dict(state)
    rest = served(again, 1000) + served(again, 1000)  # the rest of epoch 0, then epoch 1
    assert len(first + rest) == len(ref)
    assert all(np.array_equal(a, b) for a, b in zip(first + rest, ref))


def test_an_earlier_position_reported_by_a_prefetcher_resumes_exactly(mixed_sets):
    # CUDAPrefetcher reports the first batch it fetched but did not hand out, which may lie in the epoch before
    # the loader's; or, every batch handed out, (that epoch, num_samples): both must resume exactly
    s = MixtureSampler(open_mixture(mixed_sets, seed=7, stop="all"), 4, rank=0, world_size=2)
    epoch0 = list(s)
    state = s.state_dict()  # the loader is in epoch 1 already
    epoch1 = list(s.batches())
    for position, want in ((s.batch_position(len(epoch0) - 2), epoch0[-2:] + epoch1), (state["num_samples"], epoch1)):
        t = MixtureSampler(open_mixture(mixed_sets, seed=7, stop="all"), 4, rank=0, world_size=2)
        t.load_state_dict({**state, "epoch": 0, "position": position})
        t.set_epoch(0)  # what the Trainer does at a resume
        got = list(t.batches())
        t.end_epoch()
        got += list(t.batches())
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("how", ["set_weights", "new_mixture"])
def test_new_weights_at_resume_repeat_and_skip_nothing(mixed_sets, how):
    old = open_mixture(mixed_sets, seed=9, epoch_size=20_000)
    s = MixtureSampler(old, 8, rank=0, world_size=1)
    before = np.concatenate([b for _, b in zip(range(700), s.batches())])
    s.advance(700)
    state = json.loads(json.dumps(s.state_dict()))
    new_w = {"a": 0.1, "b": 0.1, "c": 0.8}
    if how == "set_weights":
        mix = open_mixture(mixed_sets, seed=9, epoch_size=20_000)
        t = MixtureSampler(mix, 8, rank=0, world_size=1)
        t.load_state_dict(state)
        mix.set_weights(new_w)
    else:
        mix = open_mixture(mixed_sets, seed=9, epoch_size=20_000, weights=new_w)
        t = MixtureSampler(mix, 8, rank=0, world_size=1)
        t.load_state_dict(state)
    after = np.concatenate([b for _ in range(3) for b in t])
    unchanged = stream(open_mixture(mixed_sets, seed=9, epoch_size=20_000), 400_000)
    for k, n in enumerate(SIZES.values()):  # each source goes on with its own order: a prefix of the same sequence
        seq = np.concatenate([per_source(before, k), per_source(after, k)])
        ref = per_source(unchanged, k)
        assert len(seq) <= len(ref) and np.array_equal(seq, ref[:len(seq)])
        assert_epochs_exact(seq, n)
    assert_windows(after, list(new_w.values()))  # the new proportions from the resumed position on
    assert t.state_dict()["weights"] == pytest.approx(new_w)


def test_set_weights_between_iterations_applies_from_the_next_one(mixed_sets):
    mix = open_mixture(mixed_sets, seed=9, epoch_size=30_000)
    s = MixtureSampler(mix, 8, rank=0, world_size=1)
    running = s.batches()
    head = [next(running) for _ in range(100)]
    s.advance(100)
    mix.set_weights({"a": 0.0, "b": 0.5, "c": 0.5})  # the loop that runs keeps its weights...
    assert np.array_equal(next(running), stream(open_mixture(mixed_sets, seed=9, epoch_size=30_000), 808)[800:])
    rest = list(s.batches())  # ...the next one takes the new ones, from where the first one stopped
    assert not any((b >> SHIFT == 0).any() for b in rest) and len(rest) == 3750 - 100
    unchanged = stream(open_mixture(mixed_sets, seed=9, epoch_size=30_000), 100_000)
    for k, n in enumerate(SIZES.values()):
        seq = per_source(np.concatenate(head + rest), k)
        assert np.array_equal(seq, per_source(unchanged, k)[:len(seq)])


def test_a_source_with_a_field_named_source_is_refused():
    """A dict batch's "source" entry (each row's source) was written over a field of that name, silently."""
    from types import SimpleNamespace

    class WithFields(Sized):
        def __init__(self, n: int, names: tuple[str, ...]) -> None:
            super().__init__(n)
            self.fields = [SimpleNamespace(name=name) for name in names]

    Mixture({"a": WithFields(10, ("image", "caption")), "b": WithFields(10, ("image", "caption"))})
    with pytest.raises(ConfigError, match="source 'a' has a field named 'source'"):
        Mixture({"a": WithFields(10, ("image", "source")), "b": WithFields(10, ("image", "source"))})


@pytest.mark.parametrize("stop", ["first", "all"])
def test_len_after_set_weights_counts_the_batches_the_next_iteration_serves(stop):
    """len() right after set_weights counted the old weights' segment (the new one is made when the next
    iteration starts): a loop sized by it, or a schedule, was off."""
    mix = Mixture({"a": Sized(400), "b": Sized(100)}, weights={"a": 0.5, "b": 0.5}, seed=3, stop=stop)
    s = MixtureSampler(mix, 8, rank=0, world_size=1)
    for at_start in (True, False):
        if not at_start:
            s.set_epoch(1)
            s.advance(3)
        mix.set_weights({"a": 0.9, "b": 0.1})
        told, whole = len(s), s.epoch_batches()
        assert told == len(list(s.batches())) and whole == s.epoch_batches()
        assert told == whole - (0 if at_start else 3)  # (the 3 served before the new weights)
        mix.set_weights({"a": 0.5, "b": 0.5})


@pytest.mark.parametrize("epoch", [-1, 1.0, 10 ** 12 + 0.5])
def test_a_mixture_epoch_that_is_no_whole_number_is_refused_by_name(epoch):
    # -1 replayed from epoch 0 silently; a float was stepped to, one epoch at a time
    s = MixtureSampler(Mixture({"a": Sized(40), "b": Sized(10)}, seed=3), 8, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=f"set_epoch takes an epoch number >= 0, got {epoch!r}"):
        s.set_epoch(epoch)
    s.set_epoch(np.int64(2))
    assert s.epoch == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_trainer_resumes_a_mixture_with_new_weights(mixed_sets, tmp_path, device):
    # on a GPU, CUDAPrefetcher holds batches fetched ahead: the state it saves names the first one not trained
    from fastdata.gpu.prefetch import CUDAPrefetcher
    from fastdata.train.config import TrainConfig
    from fastdata.train.trainer import Trainer

    def run(weights, steps, resume):
        loader = CUDAPrefetcher(FastLoader(open_mixture(mixed_sets, seed=3, weights=weights), 8, num_threads=1),
                                device=device)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 3))  # 8x8 images
        t = Trainer(model, loader, config=TrainConfig(
            device=device, max_steps=steps, progress=False, checkpoint_dir=str(tmp_path / "ck"), resume=resume,
            log_every=10))
        t.fit()
        return t, loader.state_dict()
    _, saved = run(WEIGHTS, 30, False)  # an epoch is 25 batches: the cut is in the second epoch
    assert saved["epoch"] == 1 and saved["position"] == 40
    new_w = {"a": 0.2, "b": 0.2, "c": 0.6}
    t, final = run(new_w, 40, True)
    assert t.step == 40
    logged = [r["sources"] for r in t.history if r.get("event") == "train"]  # per log interval, per source
    assert logged and all(set(r) == set(WEIGHTS) and sum(v["share"] for v in r.values()) == pytest.approx(1)
                          and all(v["samples_per_s"] >= 0 for v in r.values()) for r in logged)
    want = MixtureSampler(open_mixture(mixed_sets, seed=3, weights=new_w), 8, rank=0, world_size=1)
    want.load_state_dict(saved)
    want.advance(10)
    assert final["sources"] == want.state_dict()["sources"] and final["weights"] == pytest.approx(new_w)


def test_the_trainers_schedule_spans_the_epochs_a_stop_first_mixture_serves(mixed_sets):
    """Epochs of stop="first" end with their sources, so they differ in length: the schedule (and the bar)
    took every epoch as long as the first, and --epochs 4 ended at 32 of 48 steps, lr at a quarter of its peak."""
    from fastdata.gpu.prefetch import CUDAPrefetcher
    from fastdata.train.config import TrainConfig
    from fastdata.train.trainer import Trainer

    mix = open_mixture(mixed_sets, seed=4, stop="first")
    counts = MixtureSampler(mix, 8, rank=0, world_size=1).epochs_batches(4)
    assert len(set(counts)) > 1  # (else this test shows nothing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 3))
    t = Trainer(model, CUDAPrefetcher(FastLoader(mix, 8, num_threads=1), device="cpu"),
                config=TrainConfig(epochs=4, accum=3, device="cpu", progress=False))
    assert t.total_steps == sum(-(-c // 3) for c in counts)
    t.fit()
    assert t.step == t.total_steps and t.optimizer.param_groups[0]["lr"] < 1e-3  # the cosine ran to its end


def test_fastdata_train_mix_logs_each_source_and_resumes_with_new_weights(tmp_path):
    from test_text import make_docs, preprocess, write_jsonl

    from fastdata.cli.main import main
    from fastdata.datasets.tokens import TokenDataset

    for name, docs in (("web", 300), ("code", 120)):
        preprocess(write_jsonl(tmp_path / f"{name}.jsonl", make_docs(docs)), tmp_path / name, "--val-fraction", "0")
    web, code = tmp_path / "web", tmp_path / "code"
    common = ["train", "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--checkpoint", str(tmp_path / "ck"),
              "--log-every", "2", "--log-file", str(tmp_path / "log.jsonl"), "--quiet"]
    assert main([*common, "--mix", f"web={web}:0.75", "--mix", f"code={code}:0.25", "--max-steps", "4"]) == 0
    assert main([*common, "--mix", f"web={web}:0.25", "--mix", f"code={code}:0.75", "--max-steps", "8",
                 "--resume"]) == 0
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    shares = [r["sources"] for r in logged if "sources" in r]
    assert len(shares) == 4 and all(set(r) == {"web", "code"} for r in shares)
    loader_state = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)["loader"]

    def sampler(weights):
        return MixtureSampler(Mixture({"web": TokenDataset(web, seq_len=16), "code": TokenDataset(code, seq_len=16)},
                                      weights), 8, rank=0, world_size=1)
    first = sampler({"web": 0.75, "code": 0.25})
    first.advance(4)
    then = sampler({"web": 0.25, "code": 0.75})
    then.load_state_dict(first.state_dict())
    then.advance(4)  # 4 steps under the first weights, 4 under the new ones, every source on its cursor
    assert loader_state["sources"] == then.state_dict()["sources"]
    assert loader_state["weights"] == pytest.approx({"web": 0.25, "code": 0.75})
    assert main(["train", "--mix", f"web={web}:0.5", str(web)]) != 0  # DATA and --mix: one or the other


def token_folders(root: Path, **val_fractions: str) -> dict[str, Path]:
    """``{name: token folder}``, one for each name, of 200 documents, with that share held out for its val split."""
    from test_text import make_docs, preprocess, write_jsonl

    out = {}
    for seed, (name, val) in enumerate(val_fractions.items()):
        out[name] = root / name
        preprocess(write_jsonl(root / f"{name}.jsonl", make_docs(200, seed)), out[name], "--val-fraction", val)
    return out


def test_fastdata_train_mix_of_tokens_validates_on_val(tmp_path, capsys):
    from fastdata.cli.main import main

    sets = token_folders(tmp_path, web="0", held="0.3")
    log = tmp_path / "log.jsonl"
    common = ["train", "--mix", f"web={sets['web']}:0.7", "--mix", f"held={sets['held']}:0.3", "--seq-len", "16",
              "--batch-size", "8", "--max-steps", "2", "--val-every-steps", "2", "--device", "cpu", "--quiet"]
    assert main([*common, "--val", str(sets["held"]), "--log-file", str(log)]) == 0
    vals = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "val"]
    assert len(vals) == 1 and vals[0]["val_perplexity"] > 1  # held's val split, in windows of --seq-len
    capsys.readouterr()
    assert main([*common, "--val", str(sets["web"])]) == 1  # web holds no val split: said, not ignored
    err = capsys.readouterr().err
    assert f"--val {sets['web']} has 0 tokens in its val split" in err
    for flags, said in ((["--crop", "8"], "--crop"), (["--augment", "rrc-flip", "--crop", "8"],
                                                      "--crop, --augment rrc-flip")):  # (both were ignored)
        assert main([*common, *flags]) == 1
        assert f"fastdata: error: --mix web holds tokens: drop {said}, for image" in capsys.readouterr().err


def test_fastdata_train_allow_new_sources_resumes_a_mix_with_another_source(tmp_path, capsys):
    from fastdata.cli.main import main
    from fastdata.datasets.mix_config import open_mixture as open_spec, parse_mix

    sets = token_folders(tmp_path, web="0", code="0", books="0")
    ck = tmp_path / "ck"
    common = ["train", "--seq-len", "16", "--batch-size", "8", "--device", "cpu", "--checkpoint", str(ck), "--quiet"]
    two = [f"--mix={name}={sets[name]}:1" for name in ("web", "code")]
    three = [*two, f"--mix=books={sets['books']}:1"]
    assert main([*common, *two, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*common, *three, "--max-steps", "4", "--resume"]) == 1
    err = capsys.readouterr().err
    assert "source 'books' is not in the saved state" in err
    assert "allow_new_sources=True" in err and "--allow-new-sources" in err  # (Python's and the CLI's spellings)
    assert main([*common, *three, "--max-steps", "4", "--resume", "--allow-new-sources"]) == 0
    state = torch.load(ck / "checkpoint.pt", weights_only=True)["loader"]
    assert set(state["sources"]) == {"web", "code", "books"} and state["position"] == 4 * 8
    (tmp_path / "mix.toml").write_text("allow_new_sources = true\n" + "".join(
        f'[sources.{name}]\npath = "{path}"\n' for name, path in sets.items()))
    assert open_spec(parse_mix([str(tmp_path / "mix.toml")]), seq_len=16).allow_new_sources
    assert main(["train", str(sets["web"]), "--allow-new-sources", "--device", "cpu"]) == 1  # one dataset: no sources
    assert "--allow-new-sources applies to --mix" in capsys.readouterr().err


@pytest.mark.parametrize("world", [1, 2])
def test_drop_last_without_pad_serves_only_full_batches(mixed_sets, world):
    """As a single dataset's: drop_last cuts each epoch to whole steps whatever ``pad`` says (a 17-position
    epoch at batch 4 ended with a batch of 1)."""
    mix = open_mixture(mixed_sets, seed=3, epoch_size=17)
    for rank in range(world):
        s = MixtureSampler(mix, 4, drop_last=True, pad=False, rank=rank, world_size=world)
        for _ in range(2):
            counted = len(s)
            sizes = [len(b) for b in s]
            assert sizes == [4] * (16 // (4 * world)) and counted == len(sizes), (rank, sizes)


@pytest.mark.parametrize("stop, world, rank", [("first", 1, 0), ("all", 2, 1), (None, 2, 0)])
def test_epochs_batches_counts_each_coming_epoch_as_served(mixed_sets, stop, world, rank):
    """A learning-rate schedule over --epochs needs every epoch's length: with ``stop`` they differ, and
    ``len`` counts the current one only."""
    s = MixtureSampler(open_mixture(mixed_sets, seed=4, stop=stop), 8, rank=rank, world_size=world)
    counts = s.epochs_batches(6)
    assert counts == [sum(1 for _ in s) for _ in range(6)]
    assert (len(set(counts)) > 1) == (stop is not None), counts  # (with stop, epochs end where sources do)
    assert s.epochs_batches(2) == [sum(1 for _ in s) for _ in range(2)]  # from the current epoch on


def test_a_resume_says_when_its_weights_or_its_source_order_are_not_the_saved_ones(mixed_sets, caplog):
    """A --resume without the :WEIGHTs trained on equal weights without a word; another order of the same
    sources continues each exactly once, but not the saved interleaving."""
    import logging

    s = MixtureSampler(open_mixture(mixed_sets, seed=2), 4, rank=0, world_size=1)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    with caplog.at_level(logging.INFO, logger="fastdata.loading.mixing"):
        MixtureSampler(open_mixture(mixed_sets, seed=2), 4, rank=0, world_size=1).load_state_dict(state)
        assert caplog.text == ""
        equal = open_mixture(mixed_sets, seed=2, weights={"a": 1, "b": 1, "c": 1})
        MixtureSampler(equal, 4, rank=0, world_size=1).load_state_dict(state)
        assert ("mixture weights {a: 0.5, b: 0.3, c: 0.2} (saved) -> {a: 0.333, b: 0.333, c: 0.333} from epoch 0, "
                "position 12") in caplog.text
        reordered = open_mixture({k: mixed_sets[k] for k in "cab"}, seed=2)
        MixtureSampler(reordered, 4, rank=0, world_size=1).load_state_dict(state)
        assert "mixture sources in another order than saved (a, b, c, now c, a, b)" in caplog.text


def test_stop_first_and_all_end_the_epoch_with_the_sources(mixed_sets):
    for stop in ("first", "all"):
        s = MixtureSampler(open_mixture(mixed_sets, seed=1, stop=stop), 4, rank=0, world_size=1)
        for epoch in range(3):
            start = s.seg.cursors.copy()
            codes = np.concatenate(list(s))
            done = [np.count_nonzero((codes >> SHIFT) == k) + start[k] >= (start[k] // n + 1) * n
                    for k, n in enumerate(SIZES.values())]
            if stop == "first":  # one source ran out (the epoch rounded up to a step of 4): the others had samples left
                assert sum(done) == 1, (epoch, done)
            else:
                assert all(done), (epoch, done)


def test_mix_batch_serves_each_batch_from_one_source_and_says_which(mixed_sets):
    mix = open_mixture(mixed_sets, seed=3, mix="batch", epoch_size=4000)
    sources = []
    for x, y, source in FastLoader(mix, 8, num_threads=2):
        tag, _ = tags_ids(x)
        assert len(set(tag.tolist())) == 1 and torch.equal(source, torch.from_numpy(tag))
        sources.append(int(tag[0]))
    x, y, source, release = next(FastLoader(mix, 8, num_threads=1).iter_manual())  # the same, held until released
    assert torch.equal(source, torch.full((8,), int(tags_ids(x)[0][0])))
    release()
    counts = Counter(sources)
    assert len(sources) == 500 and all(abs(counts[k] / 500 - w) <= 0.01 for k, w in enumerate(WEIGHTS.values()))
    s = MixtureSampler(open_mixture(mixed_sets, seed=3, mix="batch", epoch_size=40_000), 8, rank=0, world_size=1)
    codes = np.concatenate(list(s))
    for k, n in enumerate(SIZES.values()):
        assert_epochs_exact(per_source(codes, k), n)


@pytest.mark.parametrize("mix", ["sample", "batch"])
def test_sources_with_fields_give_dict_batches_with_their_source(indexed_fields, mix):
    from test_fields import check_batch

    from fastdata.datasets.images import FastDataset

    mixture = Mixture({"x": FastDataset(indexed_fields), "y": FastDataset(indexed_fields, storage="ram")},
                      weights=[0.6, 0.4], seed=1, mix=mix)
    ref = stream(mixture, 16 if mix == "sample" else 4, batch=4)  # 16 served indices either way
    batches = list(FastLoader(mixture, 4, num_threads=2, copy=True))
    assert len(batches) == 15  # 60 positions
    for t, b in enumerate(batches[:4]):
        want = np.sort(ref[t * 4:(t + 1) * 4])  # (with mix="batch" a position is a whole batch of 4)
        assert np.array_equal(check_batch(b), want & MASK)  # every field's rows (and offsets) of the same sample
        assert torch.equal(b["source"], torch.from_numpy(want >> SHIFT))
        if mix == "batch":
            assert len(set(b["source"].tolist())) == 1


def test_token_sources_mix_as_windows(tmp_path, mixed_sets):
    from test_text import make_docs, preprocess, write_jsonl

    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.tokens import TokenDataset

    sets = {}
    for name, docs in (("web", 300), ("code", 120)):
        preprocess(write_jsonl(tmp_path / f"{name}.jsonl", make_docs(docs)), tmp_path / name, "--val-fraction", "0",
                   "--shard-tokens", "1000")
        sets[name] = TokenDataset(tmp_path / name, seq_len=16)
    from fastdata.datasets.mix_config import open_mixture as open_spec, parse_mix

    mix = open_spec(parse_mix([f"web={tmp_path / 'web'}:0.75", f"code={tmp_path / 'code'}:0.25"]), seq_len=16)
    assert isinstance(mix.sources[0], TokenDataset) and mix.weights == {"web": 0.75, "code": 0.25}
    for spec in ([f"web={tmp_path / 'web'}", f"pics={mixed_sets['a']}"], [f"pics={mixed_sets['a']}",
                                                                       f"web={tmp_path / 'web'}"]):
        with pytest.raises(ConfigError, match="sources '(web|pics)' and '(web|pics)' differ"):  # (AttributeError)
            open_spec(parse_mix(spec), seq_len=16)
    ref = stream(mix, 64)
    for t, (x, y) in enumerate(FastLoader(mix, 16, num_threads=2)):
        want = np.sort(ref[t * 16:(t + 1) * 16])
        assert x.dtype == sets["web"].sample_dtype and torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        for k, name in enumerate(sets):
            rows = np.flatnonzero(want >> SHIFT == k)
            wx, wy = sets[name].get_batch(want[rows] & MASK)
            assert torch.equal(x[rows], wx) and torch.equal(y[rows], wy)
        if t == 3:
            break
    shuffled = ref[:16][np.random.default_rng(0).permutation(16)]  # get_batch in the caller's order too
    x, y = mix.get_batch(shuffled)
    for i, code in enumerate(shuffled.tolist()):
        wx, wy = list(sets.values())[code >> SHIFT].get_batch([code & MASK])
        assert torch.equal(x[i], wx[0]) and torch.equal(y[i], wy[0])
    with pytest.raises(ConfigError, match="'web' and 'pics' differ"):
        Mixture({"web": sets["web"], "pics": FastDataset(mixed_sets["a"])})


def test_a_mixture_pickles_and_its_copy_gives_the_same_batches(tmp_path, mixed_sets):
    """A copy (pickle, deepcopy, another process) holds no lock or gather of the original's: it makes its own."""
    import copy
    import pickle

    from test_text import make_docs, preprocess, write_jsonl

    from fastdata.datasets.tokens import TokenDataset

    images = open_mixture(mixed_sets)
    for name in ("web", "code"):
        preprocess(write_jsonl(tmp_path / f"{name}.jsonl", make_docs(80)), tmp_path / name, "--val-fraction", "0",
                   "--shard-tokens", "1000")
    tokens = Mixture({n: TokenDataset(tmp_path / n, seq_len=16) for n in ("web", "code")}, weights=[0.75, 0.25])
    for mix in (images, tokens):
        codes = stream(mix, 32)
        for twin in (pickle.loads(pickle.dumps(mix)), copy.deepcopy(mix)):
            assert twin._count_lock is not mix._count_lock and twin.weights == mix.weights
            assert (twin._copy is None) == (mix._copy is None) and (twin._copy is None or twin._copy is not mix._copy)
            for a, b in zip(twin.get_batch(codes), mix.get_batch(codes)):
                assert torch.equal(a, b)


@pytest.mark.parametrize("storage", ["mmap", "ram"])
def test_token_windows_gathered_by_torch_or_numpy_are_the_streams(tmp_path, monkeypatch, storage):
    """One-shard token sources: many windows a source (torch's index_select, on a thread of one intra-op
    thread) and a few (numpy), alone and in a mixture's batch, are the token stream's windows."""
    from test_text import make_docs, preprocess, stream as token_stream, write_jsonl

    import fastdata.datasets.tokens as tokens

    sets, streams = {}, {}
    for name, docs, kw in (("web", 900, {}), ("code", 500, {}), ("math", 500, {"stride": 5})):
        preprocess(write_jsonl(tmp_path / f"{name}.jsonl", make_docs(docs, seed=len(sets))), tmp_path / name,
                   "--val-fraction", "0")
        sets[name] = tokens.TokenDataset(tmp_path / name, seq_len=16, storage=storage, **kw)
        sets[name]._compiled()
        sets[name]._copy.usable = False  # the gather's rules (the compiled copy: tests/test_window_copy.py)
        streams[name] = token_stream(tmp_path / name, "train")
        assert sets[name]._flat_rows is not None and len(sets[name]) > 3 * tokens.TORCH_GATHER_ROWS
    selects = []
    real = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: selects.append(1) or real(*a, **k))

    def want(name: str, idx: np.ndarray) -> np.ndarray:
        ds = sets[name]
        return streams[name][ds.starts(idx)[:, None] + np.arange(17)]

    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    try:
        for intra in (1, 2):
            torch.set_num_threads(intra)
            for n in (5, tokens.TORCH_GATHER_ROWS, 3 * tokens.TORCH_GATHER_ROWS):
                before = len(selects)
                idx = np.sort(rng.choice(len(sets["web"]), n, replace=False))
                x, y = sets["web"].get_batch(idx, out=torch.zeros((n + 3, 17), dtype=torch.uint16))
                assert np.array_equal(x.numpy(), want("web", idx)[:, :-1]) and torch.equal(x[:, 1:], y[:, :-1])
                assert (len(selects) > before) == (intra == 1 and n >= tokens.TORCH_GATHER_ROWS)
            for names in (("web", "code"), ("web", "code", "math")):  # one stride (starts once); strides differ
                mix = Mixture({k: sets[k] for k in names})
                mix._copy.usable = False  # WindowGather's rules (the compiled copy: tests/test_window_copy.py)
                parts = [np.sort(rng.choice(len(sets[k]), m, replace=False))
                         for k, m in zip(names, (3 * tokens.TORCH_GATHER_ROWS, 7, 2 * tokens.TORCH_GATHER_ROWS))]
                codes = np.concatenate([p | (k << SHIFT) for k, p in enumerate(parts)])
                buf = torch.zeros((len(codes), 17), dtype=torch.uint16)
                x, y = mix.get_batch(codes, out=(buf, torch.zeros(len(codes), dtype=torch.int64)))
                assert np.array_equal(buf.numpy(), np.concatenate([want(k, p) for k, p in zip(names, parts)]))
                assert x.data_ptr() == buf.data_ptr() and torch.equal(x[:, 1:], y[:, :-1])
    finally:
        torch.set_num_threads(threads)


def test_ascending_draws_give_the_codes_of_any_order():
    """The sampler's path for ascending positions (each source epoch one run of draws) gives what the general
    path gives, with sources far smaller than a chunk (many source epochs a call), both mixes, 1 and 3 ranks."""
    rng = np.random.default_rng(1)
    for trial in range(24):
        sizes = rng.integers(1, 300, int(rng.integers(1, 5))).tolist()
        mix = Mixture([Sized(n) for n in sizes], weights=rng.random(len(sizes)).tolist(), seed=trial,
                      mix=("sample", "batch")[trial % 2])
        for world in (1, 3):
            s = MixtureSampler(mix, int(rng.integers(1, 40)), rank=world - 1, world_size=world)
            for _ in range(3):
                positions = np.arange(int(rng.integers(1, 2000)), dtype=np.int64) * world + world - 1
                fast = s.codes(s.seg, positions, [{} for _ in sizes], ascending=True)
                assert np.array_equal(fast, s.codes(s.seg, positions, [{} for _ in sizes]))
                s.end_epoch()


def test_token_shard_bounds_give_the_windowed_order_exactly_once_without_a_number_per_window(tmp_path):
    from test_text import make_docs, preprocess, write_jsonl

    from fastdata.datasets.tokens import TokenDataset
    from fastdata.loading.order import group_by_shard
    from fastdata.loading.sampler import DistributedBatchSampler

    preprocess(write_jsonl(tmp_path / "t.jsonl", make_docs(300)), tmp_path / "t", "--val-fraction", "0",
               "--shard-tokens", "1000")
    for seq_len, stride in ((16, None), (16, 7), (8, 3), (40, 1500)):  # (1500: shards no window starts in)
        ds = TokenDataset(tmp_path / "t", seq_len=seq_len, stride=stride)
        bounds = ds.shard_bounds()
        assert np.array_equal(bounds, group_by_shard(ds.sample_shards())[0]), (seq_len, stride)
        assert bounds[0] == 0 and bounds[-1] == len(ds)
    assert TokenDataset(tmp_path / "t", seq_len=16, random_windows=True).shard_bounds() is None

    ds = TokenDataset(tmp_path / "t", seq_len=16)
    bounds, shards = ds.shard_bounds(), ds.sample_shards()
    assert len(bounds) > 8  # several shards
    loader = FastLoader(ds, 8, shuffle_window=2, num_threads=2)
    assert np.array_equal(loader.sampler._bounds, bounds)  # the loader's order takes them
    by_number = DistributedBatchSampler(len(ds), 8, shuffle_window=2, shards=shards, rank=0, world_size=1)
    for epoch in range(2):  # the order a number per window gave, exactly once per epoch, two shards at a time
        loader.sampler.set_epoch(epoch)
        by_number.set_epoch(epoch)
        seq = np.concatenate(list(loader.sampler.batches()))
        assert np.array_equal(seq, np.concatenate(list(by_number.batches())))
        assert np.array_equal(np.sort(seq[:len(ds)]), np.arange(len(ds)))
        where = np.argsort(seq[:len(ds)], kind="stable")  # each window's position in the epoch
        spans = [np.ptp(where[a:c]) + 1 for a, c in zip(bounds[:-1], bounds[1:])]
        assert max(spans) <= 2 * max(np.diff(bounds)) < len(ds) // 3  # a shard is read within its window
    mix = Mixture({"x": ds, "y": TokenDataset(tmp_path / "t", seq_len=16, stride=5)}, shuffle_window=2, seed=3)
    codes = stream(mix, 3 * len(ds))
    for k, src in enumerate(mix.sources):
        assert_epochs_exact(per_source(codes, k), len(src))


def test_mix_options_and_files(tmp_path):
    from fastdata.datasets.mix_config import parse_mix

    spec = parse_mix(["web=s3://b/web:0.7", "data/books:0.3", "code=/d/code"])
    assert spec.sources == {"web": ("s3://b/web", 0.7), "books": ("data/books", 0.3), "code": ("/d/code", 1.0)}
    (tmp_path / "m.toml").write_text('stop = "all"\n[sources.web]\npath = "s3://b/web"\nweight = 0.7\n'
                                     '[sources.books]\npath = "data/books"\nweight = 0.3\n')
    (tmp_path / "m.json").write_text(json.dumps({"sources": {"web": {"path": "s3://b/web", "weight": 0.7},
                                                             "books": {"path": "data/books", "weight": 0.3}},
                                                 "stop": "all"}))
    for name in ("m.toml", "m.json"):
        got = parse_mix([str(tmp_path / name)])
        assert got.sources == {"web": ("s3://b/web", 0.7), "books": ("data/books", 0.3)} and got.stop == "all"
    (tmp_path / "bad.json").write_text(json.dumps({"sources": {"web": {"path": "x"}}, "weights": {}}))
    for values, needle in ((["a=x:1", "a=y:2"], "source 'a' twice"), (["w=p:abc"], "'abc'"), (["w=p:-1"], "'-1'"),
                           ([str(tmp_path / "bad.json")], "unknown key 'weights'")):
        with pytest.raises(ConfigError, match=needle):
            parse_mix(values)


def test_a_mix_file_refuses_unknown_keys_of_a_source_and_bad_option_values(tmp_path):
    from fastdata.datasets.mix_config import parse_mix

    (tmp_path / "typo.toml").write_text('[sources.web]\npath = "data/web"\nweight = 0.95\n'
                                        '[sources.books]\npath = "data/books"\nwieght = 0.05\n')
    (tmp_path / "nested.toml").write_text('[sources.web]\npath = "data/web"\n[sources.web.extra]\nx = 1\n')
    web = {"sources": {"web": {"path": "data/web"}}}
    for name, options in (("size.json", {"epoch_size": True}), ("allow.json", {"allow_new_sources": "yes"}),
                          ("good.json", {"epoch_size": 50, "allow_new_sources": True})):
        (tmp_path / name).write_text(json.dumps({**web, **options}))
    for name, needle in (("typo.toml", r"source 'books': unknown key 'wieght' \(keys: path, weight\)"),
                         ("nested.toml", r"source 'web': unknown key 'extra' \(keys: path, weight\)"),
                         ("size.json", "epoch_size must be a positive integer .*got True"),
                         ("allow.json", "allow_new_sources must be true or false, got 'yes'")):
        with pytest.raises(ConfigError, match=needle):
            parse_mix([str(tmp_path / name)])
    good = parse_mix([str(tmp_path / "good.json")])
    assert good.epoch_size == 50 and good.allow_new_sources and not parse_mix(["web=data/web"]).allow_new_sources


class Sized:
    """A source of ``n`` samples that stores none: for the order alone (the loader never reads it here)."""
    sample_shape, sample_dtype = (2,), torch.uint8

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get_batch(self, idx, out=None):
        raise AssertionError("not read here")


def served_in_order(samplers: list[MixtureSampler], steps: int | None) -> tuple[np.ndarray, int]:
    """The served indices of every rank in global position order, for ``steps`` steps (None: the epoch's rest),
    and the steps taken; checks that every rank serves the same number of batches."""
    s0 = samplers[0]
    world, per, start = s0.world_size, s0.per, s0.start
    got = [list(s.batches())[:steps] for s in samplers]
    assert len({len(g) for g in got}) == 1
    n = len(got[0])
    out = np.full((n * per * world, s0.unit), -1, dtype=np.int64)
    for r, batches in enumerate(got):
        for t, b in enumerate(batches):
            units = b.reshape(-1, s0.unit)
            out[(t * world + r) * per + np.arange(len(units))] = units  # (rank r's block of each step)
    for s in samplers:
        s.advance(n)
    assert start == s0.start
    return out[(out >= 0).all(axis=1)].ravel(), n


def test_any_weights_worlds_resumes_and_reweights_keep_each_source_in_its_order():
    from fastdata.loading.order import EpochOrder

    rng = np.random.default_rng(0)
    for trial in range(40):
        k = int(rng.integers(2, 5))
        sizes = rng.integers(5, 60, k).tolist()
        weights = [float(w) * (rng.random() > 0.2) for w in rng.random(k)]
        weights[0] += 0.1
        opts = {"mix": ["sample", "batch"][trial % 2], "stop": [None, "first", "all"][trial % 3],
                "epoch_size": 150 if trial % 3 == 0 else None, "seed": trial}
        batch = int(rng.integers(1, 6))
        mix = Mixture([Sized(n) for n in sizes], weights=weights, **opts)
        w1, w2 = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        ranks = [MixtureSampler(mix, batch, rank=r, world_size=w1) for r in range(w1)]
        head, _ = served_in_order(ranks, int(rng.integers(0, 8)))
        state = json.loads(json.dumps(ranks[0].state_dict()))
        assert all(s.state_dict() == state for s in ranks)  # the same on every rank
        if trial % 4 == 1:
            mix.set_weights([float(w) + 0.05 for w in rng.random(k)])
        ranks = [MixtureSampler(mix, batch, rank=r, world_size=w2) for r in range(w2)]
        for s in ranks:
            s.load_state_dict(state)
        parts = [head]
        for _ in range(3):  # the rest of this epoch, then two more
            part, _ = served_in_order(ranks, None)
            parts.append(part)
            for s in ranks:
                s.end_epoch()
        codes = np.concatenate(parts)
        for j, n in enumerate(sizes):  # each source: its own orders, epoch after epoch, nothing left out
            seq = per_source(codes, j)
            ref = np.concatenate([EpochOrder(n, mix.source_seed(j), e).at(np.arange(n)) for e in
                                  range(len(seq) // n + 1)])
            assert np.array_equal(seq, ref[:len(seq)]), (trial, j)


def test_sources_of_two_billion_samples_cost_a_window(mixed_sets):
    class Big:
        """A source of 2e9 samples in shards of 65,536 that stores no data (the order needs only its shards)."""
        sample_shape, sample_dtype = (8, 8, 3), torch.uint8

        def __len__(self):
            return 2 * 10**9

        def shard_bounds(self):
            return np.r_[np.arange(0, len(self), 1 << 16, dtype=np.int64), len(self)]

        def get_batch(self, idx, out=None):
            raise AssertionError("not read here")
    mix = Mixture({"x": Big(), "y": Big(), "z": Big()}, weights=[0.5, 0.3, 0.2], shuffle_window=4, seed=0)
    tracemalloc.start()
    s = MixtureSampler(mix, 256, rank=1, world_size=8)
    first = next(iter(s.batches()))
    s.advance(1)
    state = s.state_dict()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # a window of 4 shards is 2 MB of int64 per source and epoch; the shard deal 0.25 MB: far from 2e9 * 8 bytes
    assert peak < 64 * 2**20, peak
    assert len(first) == 256 and (first & MASK).max() < 2 * 10**9 and len(set(first.tolist())) == 256
    t = MixtureSampler(mix, 256, rank=0, world_size=3)
    t.load_state_dict(state)
    assert t.position() == 8 * 256 and t.state_dict()["sources"]["x"]["epoch"] == 0


def _each_source_in_its_orders(mix: Mixture, sizes, codes: np.ndarray) -> None:
    from fastdata.loading.order import EpochOrder

    for j, n in enumerate(sizes):  # each source: its own orders, epoch after epoch, nothing left out
        seq = per_source(codes, j)
        ref = np.concatenate([EpochOrder(n, mix.source_seed(j), e).at(np.arange(n)) for e in range(len(seq) // n + 1)])
        assert np.array_equal(seq, ref[:len(seq)]), j


@pytest.mark.parametrize("stop", ["first", "all"])
@pytest.mark.parametrize("world", [1, 3])
def test_drop_last_never_leaves_an_epoch_of_stop_first_or_all_empty(stop, world):
    """NOTE [mixture] 4: an epoch drop_last rounds down leaves a source's rest under a step; the next epoch of
    stop="first" aimed at that rest alone, was cut to no batch, and so was every epoch after it (nothing moved:
    training went on with empty epochs). Sources smaller than a step did it from the first epoch. Every epoch
    serves a batch now, the same on every rank, and each source still walks its orders exactly once each."""
    for sizes, weights in (((100, 37, 60), [0.5, 0.3, 0.2]), ((3, 5), [0.5, 0.5]), ((2000, 9), [0.9, 0.1])):
        mix = Mixture([Sized(n) for n in sizes], weights=weights, seed=4, stop=stop)
        ranks = [MixtureSampler(mix, 16, drop_last=True, rank=r, world_size=world) for r in range(world)]
        parts = []
        for epoch in range(8):
            part, steps = served_in_order(ranks, None)
            assert steps >= 1, (sizes, epoch)
            parts.append(part)
            for s in ranks:
                s.end_epoch()
        _each_source_in_its_orders(mix, sizes, np.concatenate(parts))
    loader = FastLoader(Mixture({"a": Sized(100), "b": Sized(37)}, seed=4, stop=stop), 16, drop_last=True)
    for epoch in range(6):
        loader.set_epoch(epoch)
        assert len(loader) >= 1, epoch
    mix = Mixture([Sized(40), Sized(41)], weights=[0.5, 0.5], seed=0, stop=stop)  # new weights between epochs
    ranks = [MixtureSampler(mix, 8, drop_last=True, rank=r, world_size=world) for r in range(world)]
    parts = []
    for epoch in range(8):
        if epoch in (2, 5):
            mix.set_weights([0.2, 0.8] if epoch == 2 else [0.7, 0.3])
        part, steps = served_in_order(ranks, None)
        assert steps >= 1, epoch  # (the review's case: [5, 4, 0] batches)
        parts.append(part)
        for s in ranks:
            s.end_epoch()
    _each_source_in_its_orders(mix, (40, 41), np.concatenate(parts))
    with pytest.raises(ConfigError, match="epoch_size=20 is less than one step"):
        MixtureSampler(Mixture([Sized(50), Sized(50)], epoch_size=20), 8, drop_last=True, rank=0, world_size=3)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_every_ranks_batch_holds_each_sources_share(world):
    """NOTE [mixture] 1: ranks took every world-th position, which the schedule's alternation lines up with:
    at weights 0.5/0.5 on 2 ranks rank 0 served only one source and rank 1 only the other (per-rank BatchNorm
    saw one source). Each rank's batch is a block of the step now: within the schedule's bound of every share."""
    for weights in ([0.5, 0.5], [0.5, 0.3, 0.2], [0.25] * 4, [0.7, 0.3]):
        mix = Mixture([Sized(1000) for _ in weights], weights=weights, seed=0)
        depth = max(1, (len(weights) - 1).bit_length())
        for r in range(world):
            s = MixtureSampler(mix, 32, rank=r, world_size=world)
            for b in itertools.islice(s.batches(), 20):
                counts = np.bincount(b >> SHIFT, minlength=len(weights))
                assert np.all(np.abs(counts - 32 * np.array(weights)) <= 2 * depth + 1), (weights, r, counts)


def test_a_state_with_other_orders_data_or_batch_positions_is_refused_by_name():
    """A state resumed on another shuffle or shuffle_window of a source, on other data of a source (its
    manifest's digest), or with mix="batch" at another batch_size (a position is a batch: positions counted
    in the old one) was accepted and repeated and skipped samples; now each is refused, by name."""
    class Versioned(WindowedSized):
        def __init__(self, n: int, version: str, key: dict | None = None) -> None:
            super().__init__(n, 10)
            self.manifest_sha256 = version
            if key is not None:
                self.state_key = key  # (a split's, token windows)

    def state_of(**kw):
        sources = kw.pop("sources", {"a": Versioned(50, "1" * 64), "b": Versioned(30, "2" * 64)})
        s = MixtureSampler(Mixture(sources, seed=1, **kw), 4, rank=0, world_size=1)
        s.advance(3)
        return json.loads(json.dumps(s.state_dict()))

    def resume(state, batch=4, **kw):
        sources = kw.pop("sources", {"a": Versioned(50, "1" * 64), "b": Versioned(30, "2" * 64)})
        MixtureSampler(Mixture(sources, seed=1, **kw), batch, rank=0, world_size=2).load_state_dict(state)

    resume(state_of())  # (the same at another world size)
    with pytest.raises(ConfigError, match="source 'a' was saved with shuffle_window=2 \\(now None\\)"):
        resume(state_of(shuffle_window={"a": 2, "b": None}))
    with pytest.raises(ConfigError, match="source 'b' was saved with shuffle=True \\(now False\\)"):
        resume(state_of(), shuffle={"a": True, "b": False})
    with pytest.raises(ConfigError, match="source 'b' was saved with other data: its manifest's sha256 was 2222"):
        resume(state_of(), sources={"a": Versioned(50, "1" * 64), "b": Versioned(30, "3" * 64)})
    keyed = {"a": Versioned(50, "1" * 64, {"split": "train", "seed": 0}), "b": Versioned(30, "2" * 64)}
    state = state_of(sources=keyed)
    resume(state, sources={"a": Versioned(50, "1" * 64, {"split": "train", "seed": 0}), "b": Versioned(30, "2" * 64)})
    with pytest.raises(ConfigError, match="source 'a' was saved with other samples of its data: .*'seed': 0"):
        resume(state, sources={"a": Versioned(50, "1" * 64, {"split": "train", "seed": 1}),
                               "b": Versioned(30, "2" * 64)})
    with pytest.raises(ConfigError, match="mix='batch' and batch_size=4 .* resume with batch_size=4"):
        resume(state_of(mix="batch"), batch=8, mix="batch")
    resume(state_of(mix="batch"), batch=4, mix="batch")
    resume(state_of(), batch=8)  # (mix="sample": a position is a sample, at any batch size)
    old = state_of()
    for key in ("shuffle", "shuffle_window", "versions", "keys", "draws_a_position"):  # saved before these
        del old["mixture"][key]
    resume(old, shuffle={"a": True, "b": False})


def _tampered(state: dict, path: tuple, value) -> dict:
    state = json.loads(json.dumps(state))
    *head, last = path
    at = state
    for key in head:
        at = at[key]
    if value is KeyError:
        del at[last]
    else:
        at[last] = value
    return state


@pytest.mark.parametrize("path, value", [
    (("position",), None), (("position",), "12"), (("position",), -4), (("epoch",), 1.5), (("epoch",), True),
    (("segments",), None), (("segments",), []), (("segments", 0, "weights"), KeyError),
    (("segments", 0, "cursors", "b"), KeyError), (("segments", 0, "cursors", "a"), "x"),
    (("segments", 0, "cursors", "a"), 2 ** 70), (("segments", 0, "cursors", "a"), -500),
    (("segments", 0, "weights", "a"), 0), (("segments", 0, "start"), None), (("mixture", "sources"), None),
    (("mixture", "sizes"), [50]), (("mixture", "sources"), ["a", "a"])])
def test_a_damaged_state_is_refused_with_what_is_wrong(path, value):
    """Each damage gave a bare TypeError/KeyError/OverflowError, or was accepted (a missing cursor read as
    0: the source started its epoch over)."""
    s = MixtureSampler(Mixture({"a": Sized(50), "b": Sized(30)}, seed=1), 4, rank=0, world_size=1)
    s.advance(3)
    state = s.state_dict()
    t = MixtureSampler(Mixture({"a": Sized(50), "b": Sized(30)}, seed=1), 4, rank=0, world_size=1)
    t.load_state_dict(json.loads(json.dumps(state)))  # (the state itself loads)
    with pytest.raises(ConfigError, match="damaged|another mixture"):
        t.load_state_dict(_tampered(state, path, value))


def test_weights_of_numpy_numbers_int_keys_and_huge_values_are_taken():
    mix = Mixture([Sized(10), Sized(10)], weights=np.array([1, 3]))
    assert mix.weights == {"0": 0.25, "1": 0.75}
    mix.set_weights(np.array([0.5, 0.5], dtype=np.float32))
    assert mix.weights == {"0": 0.5, "1": 0.5}
    mix.set_weights({0: 0.7, 1: 0.3})  # (a list's sources are named "0", "1")
    assert mix.weights == {"0": 0.7, "1": 0.3}
    mix.set_weights([1e308, 1e308])  # (their sum overflows)
    assert mix.weights == {"0": 0.5, "1": 0.5}


def test_shuffle_by_name_keeps_the_default_and_a_list_is_per_source():
    """A source that a ``{name: ...}`` does not name keeps the default (shuffled, no windows); a list gives each
    source its own value in source order, as for weights; anything else is refused by name."""
    def mixture(**kw) -> Mixture:
        return Mixture({n: WindowedSized(50, 10) for n in "abc"}, **kw)

    def in_order(mix: Mixture) -> list[bool]:  # each source's first epoch drawn 0, 1, 2...: unshuffled
        codes = stream(mix, 300)
        return [np.array_equal(per_source(codes, k)[:50], np.arange(50)) for k in range(3)]

    mix = mixture(shuffle={"c": False})
    assert mix.shuffle == [True, True, False] and in_order(mix) == [False, False, True]
    mix = mixture(shuffle=[False, True, False])
    assert mix.shuffle == [False, True, False] and in_order(mix) == [True, False, True]
    assert mixture(shuffle=[False] * 3).shuffle == [False] * 3
    assert mixture(shuffle=np.array([True, False, True])).shuffle == [True, False, True]
    assert mixture(shuffle_window={"a": 2}).shuffle_window == [2, None, None]
    assert mixture(shuffle_window=(None, np.int64(3), None)).shuffle_window == [None, 3, None]
    for kw, needle in (({"shuffle": [False, False]}, r"shuffle has 2 values for 3 sources"),
                       ({"shuffle": "no"}, "shuffle of source 'a' must be True or False, got 'no'"),
                       ({"shuffle": {"b": None}}, "shuffle of source 'b' must be True or False, got None"),
                       ({"shuffle": {"d": False}}, "shuffle names source 'd'"),
                       ({"shuffle_window": [2]}, "shuffle_window has 1 values for 3 sources"),
                       ({"shuffle_window": True}, "shuffle_window of source 'a' must be a positive number")):
        with pytest.raises(ConfigError, match=needle):
            mixture(**kw)


def test_an_epoch_size_of_a_bool_is_refused():
    for size in (True, False, 0, 2.5):
        with pytest.raises(ConfigError, match=f"epoch_size must be a positive integer.*epoch_size={size!r}"):
            Mixture([Sized(10), Sized(10)], epoch_size=size)
    assert len(Mixture([Sized(10), Sized(10)], epoch_size=7)) == 7


def test_a_mix_option_keeps_a_urls_port():
    from fastdata.datasets.mix_config import parse_one

    assert parse_one("web=http://localhost:9000/bucket/web") == ("web", "http://localhost:9000/bucket/web", 1.0)
    assert parse_one("web=http://localhost:9000/bucket/web:0.5") == ("web", "http://localhost:9000/bucket/web", 0.5)
    assert parse_one("http://127.0.0.1:8080/data/web") == ("web", "http://127.0.0.1:8080/data/web", 1.0)
    assert parse_one("web=http://localhost:9000") == ("web", "http://localhost:9000", 1.0)
    assert parse_one("web=s3://bucket/web:2") == ("web", "s3://bucket/web", 2.0)
    assert parse_one("web=s3://webdata:3") == ("web", "s3://webdata", 3.0)  # (a bucket's root: 3 is a weight)
    assert parse_one("books=gs://books:2") == ("books", "gs://books", 2.0)
    assert parse_one("/data/web:0.25") == ("web", "/data/web", 0.25)
    with pytest.raises(ConfigError, match="must be a number"):
        parse_one("web=/data/web:lots")


# -- bad input ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights, needle", [
    ({"a": -1, "b": 1, "c": 1}, "'a'"), ({"a": float("nan"), "b": 1, "c": 1}, "'a'"),
    ({"a": 0, "b": 0, "c": 0}, "not all be zero"), ({"a": 1, "b": 1, "c": 1, "web": 1}, "'web'"),
    ({"a": 1, "b": 1}, "'c'"), ([1, 2], "3 sources")])
def test_bad_weights_are_refused_by_name(mixed_sets, weights, needle):
    with pytest.raises(ConfigError, match=needle):
        open_mixture(mixed_sets, weights=weights)
    mix = open_mixture(mixed_sets)
    with pytest.raises(ConfigError, match=needle):
        mix.set_weights(weights)


def test_sources_that_disagree_or_are_empty_are_refused_by_name(mixed_sets, tmp_path):
    from fastdata.cli.main import main
    from fastdata.datasets.images import FastDataset

    csv = tagged_source(tmp_path / "src", 5, 0)
    assert main(["preprocess", "images", str(csv), str(tmp_path / "big"), "--size", "10", "--quiet",
                 "--workers", "1"]) == 0
    with pytest.raises(ConfigError, match="'a' and 'big' differ"):
        Mixture({"a": FastDataset(mixed_sets["a"]), "big": FastDataset(tmp_path / "big")})
    csv = tagged_source(tmp_path / "src2", 2, 0)  # labels 0 and 1 only: classes ['0', '1'], not ['0', '1', '2']
    assert main(["preprocess", "images", str(csv), str(tmp_path / "two"), "--size", "8", "--quiet",
                 "--workers", "1"]) == 0
    with pytest.raises(ConfigError, match=r"'a' and 'two' have different classes .*one label space"):
        Mixture({"a": FastDataset(mixed_sets["a"]), "two": FastDataset(tmp_path / "two")})  # (only open_mixture said)

    class Empty:
        sample_shape, sample_dtype = (8, 8, 3), torch.uint8

        def __len__(self):
            return 0

        def get_batch(self, idx, out=None):
            raise AssertionError
    with pytest.raises(ConfigError, match="source 'none' is empty"):
        Mixture({"a": FastDataset(mixed_sets["a"]), "none": Empty()})
    with pytest.raises(ConfigError, match="seed, shuffle and shuffle_window to Mixture"):
        FastLoader(open_mixture(mixed_sets), 4, shuffle_window=2)
    mix = open_mixture(mixed_sets)
    with pytest.raises(IndexError, match="sample 37 of source 'b', which has 37"):  # b holds 0..36
        mix.get_batch(np.array([3, (1 << SHIFT) | 36, (1 << SHIFT) | 37]))
    with pytest.raises(IndexError, match="names source 3"):
        mix.get_batch(np.array([3, 3 << SHIFT]))


def test_a_state_from_another_mixture_is_refused_by_name(mixed_sets):
    s = MixtureSampler(open_mixture(mixed_sets, seed=1), 4, rank=0, world_size=1)
    state = s.state_dict()
    with pytest.raises(ConfigError, match="seed=1"):
        MixtureSampler(open_mixture(mixed_sets, seed=2), 4, rank=0, world_size=1).load_state_dict(state)
    two = {k: mixed_sets[k] for k in ("a", "b")}
    with pytest.raises(ConfigError, match="source 'c', which this mixture lacks"):
        MixtureSampler(open_mixture(two, seed=1, weights=None), 4, rank=0, world_size=1).load_state_dict(state)
    small = MixtureSampler(open_mixture(two, seed=1, weights=None), 4, rank=0, world_size=1)
    head = np.concatenate([b for _, b in zip(range(3), small.batches())])
    small.advance(3)
    grown_state = small.state_dict()
    with pytest.raises(ConfigError, match="source 'c' is not in the saved state: pass allow_new_sources"):
        MixtureSampler(open_mixture(mixed_sets, seed=1), 4, rank=0, world_size=1).load_state_dict(grown_state)
    grown = MixtureSampler(open_mixture(mixed_sets, seed=1, allow_new_sources=True), 4, rank=0, world_size=1)
    grown.load_state_dict(grown_state)
    assert grown.state_dict()["sources"]["c"] == {"epoch": 0, "position": 0} and grown.position() == 12
    rest = np.concatenate(list(grown.batches()))
    ref = stream(open_mixture(mixed_sets, seed=1), 3000)  # each source's order is its own, whatever the others
    for k in range(3):  # a and b go on where they were, c starts at its epoch 0: nothing repeated or skipped
        seq = np.concatenate([per_source(head, k), per_source(rest, k)])
        assert len(seq) and np.array_equal(seq, per_source(ref, k)[:len(seq)])
    from fastdata.loading.sampler import DistributedBatchSampler

    with pytest.raises(ConfigError, match="not a Mixture's"):
        s.load_state_dict(DistributedBatchSampler(10, 2, rank=0, world_size=1).state_dict())


# -- streamed sources ------------------------------------------------------------------------------------
def test_cache_shares_takes_weights_as_a_mixture_does():
    """A list of weights (Mixture's other spelling) was an AttributeError."""
    assert cache_shares("200GB", [0.7, 0.3]) == {"0": 140_000_000_000, "1": 60_000_000_000}
    assert cache_shares(1000, {"web": 1, "books": 3}) == {"web": 250, "books": 750}
    with pytest.raises(ConfigError, match="not all zero"):
        cache_shares(1000, [0, 0])


def test_a_streamed_source_from_loopback_s3_gives_the_local_batches(mixed_sets, tmp_path, s3):
    from fastdata.datasets.images import FastDataset
    from fastdata.storage.push import push

    url = s3("mixture") + "/b"
    push(mixed_sets["b"], url)
    local = open_mixture(mixed_sets, seed=6)
    share = cache_shares("1MB", WEIGHTS)  # one node budget split by weight: b may keep 300 kB
    assert share == {"a": 500_000, "b": 300_000, "c": 200_000}
    remote = Mixture({"a": FastDataset(mixed_sets["a"]),
                      "b": FastDataset(url, cache_dir=tmp_path / "cache", cache_limit=share["b"]),
                      "c": FastDataset(mixed_sets["c"])}, weights=WEIGHTS, seed=6)
    want = [(x.clone(), y.clone()) for x, y in FastLoader(local, 8, num_threads=2)]
    got = [(x.clone(), y.clone()) for x, y in FastLoader(remote, 8, num_threads=2)]
    assert len(got) == len(want) and all(torch.equal(a, b) for p, q in zip(got, want) for a, b in zip(p, q))
    report = remote.download_report()
    assert report["a"] == report["c"] == []  # local: nothing downloaded
    assert report["b"][0]["downloads"] == 3 and report["b"][0]["repeats"] == 0  # its 3 shards, once each


def test_a_split_of_a_streamed_source_mixes_with_datasets_plans_and_takes_its_budget_share(mixed_sets, tmp_path,
                                                                                            s3):
    """A split's view was refused beside a FastDataset ("differ": the class names did), and a view of a streamed
    dataset got no planned prefetch and no share of the mixture's cache budget."""
    from fastdata.datasets.images import FastDataset
    from fastdata.datasets.splits import split
    from fastdata.storage.push import push

    url = s3("mixture-split") + "/b"
    push(mixed_sets["b"], url)
    local = Mixture({"a": FastDataset(mixed_sets["a"]), "b": split(FastDataset(mixed_sets["b"]), 0.25)[0]},
                    weights=[0.6, 0.4], seed=2)
    view = split(FastDataset(url, cache_dir=tmp_path / "cache"), 0.25)[0]
    remote = Mixture({"a": FastDataset(mixed_sets["a"]), "b": view}, weights=[0.6, 0.4], seed=2, cache_limit=50_000)
    assert view.streamed and remote.cache_limits() == {"b": 50_000} and view.base.cache_limit == 50_000
    want = [(x.clone(), y.clone()) for x, y in FastLoader(local, 8, num_threads=2)]
    got = [(x.clone(), y.clone()) for x, y in FastLoader(remote, 8, num_threads=2)]
    assert len(got) == len(want) and all(torch.equal(a, b) for p, q in zip(got, want) for a, b in zip(p, q))
    assert view.download_report()[0]["downloads"] == 3  # planned: b's 3 shards, each once


@pytest.mark.filterwarnings("ignore:cache_limit=.* holds about")  # a at 10 kB under a plain shuffle: expected
def test_streamed_sources_share_one_cache_budget_split_again_by_new_weights(mixed_sets, tmp_path, s3):
    from fastdata.datasets.images import FastDataset
    from fastdata.storage.push import push

    base = s3("mixture-budget")
    for name in ("a", "b"):
        push(mixed_sets[name], f"{base}/{name}")

    def sources() -> dict:
        return {"a": FastDataset(f"{base}/a", cache_dir=tmp_path / "cache"),
                "b": FastDataset(f"{base}/b", cache_dir=tmp_path / "cache"), "c": FastDataset(mixed_sets["c"])}

    budget = 40_000  # shards of about 3.4 kB: a holds its 7 at 25 kB, b its 3 at 15 kB
    remote = Mixture(sources(), weights=WEIGHTS, seed=6, cache_limit=budget)
    assert remote.cache_limits() == cache_shares(budget, {"a": 0.5, "b": 0.3}) == {"a": 25_000, "b": 15_000}
    loader = FastLoader(remote, 8, num_threads=2)
    want = [(x.clone(), y.clone()) for x, y in FastLoader(open_mixture(mixed_sets, seed=6), 8, num_threads=2)]
    got = [(x.clone(), y.clone()) for x, y in loader]
    assert len(got) == len(want) and all(torch.equal(a, b) for p, q in zip(got, want) for a, b in zip(p, q))
    b_cache = remote.sources[1]._cache
    assert b_cache.cached().all()  # b's 3 shards fit its 15 kB

    remote.set_weights({"a": 0.45, "b": 0.05, "c": 0.5})  # b's share falls to 4 kB: one shard; at once
    assert remote.cache_limits() == {"a": 36_000, "b": 4_000}
    assert int(b_cache.sizes[b_cache.cached()].sum()) <= 4_000 < int(b_cache.sizes.sum())
    state = loader.state_dict()

    again = Mixture(sources(), weights={"a": 0.2, "b": 0.6, "c": 0.2}, seed=6, cache_limit=budget)  # a resume
    assert again.cache_limits() == {"a": 10_000, "b": 30_000}
    resumed = FastLoader(again, 8, num_threads=2)
    resumed.load_state_dict(state)
    local = FastLoader(open_mixture(mixed_sets, seed=6), 8, num_threads=2)
    list(local)
    local.dataset.set_weights({"a": 0.2, "b": 0.6, "c": 0.2})
    for (x, y), (wx, wy) in zip(resumed, local):  # the new budget serves the same batches as local sources
        assert torch.equal(x, wx) and torch.equal(y, wy)
    with pytest.raises(ConfigError, match="positive number of bytes"):
        b_cache.set_limit(0)


def test_open_mixture_passes_retry_seconds_to_url_sources(mixed_sets, tmp_path, s3, proxy):
    from fastdata.datasets.mix_config import open_mixture as open_spec, parse_mix
    from fastdata.errors import FormatError
    from fastdata.storage.push import push

    url = s3("mixture-retry") + "/b"
    push(mixed_sets["b"], url)
    spec = parse_mix([f"a={mixed_sets['a']}:0.5", f"b={url}:0.5"])
    mix = open_spec(spec, cache_dir=tmp_path / "cache", retry_seconds=7)
    assert mix.sources[1]._remote.retry.seconds == 7
    proxy.refuse(30)
    with pytest.raises(FormatError, match=r"retry_seconds=1\)"):  # given up on after 1 s, not the default 120
        open_spec(spec, cache_dir=tmp_path / "cache2", retry_seconds=1)


def test_open_mixture_splits_cache_limit_among_url_sources_all_of_weight_0(mixed_sets, tmp_path, s3):
    from fastdata.datasets.mix_config import open_mixture as open_spec, parse_mix
    from fastdata.storage.push import push

    base = s3("mixture-zero")
    for name in ("b", "c"):
        push(mixed_sets[name], f"{base}/{name}")
    spec = parse_mix([f"a={mixed_sets['a']}:1", f"b={base}/b:0", f"c={base}/c:0"])
    mix = open_spec(spec, cache_dir=tmp_path / "cache", cache_limit=40_000)
    assert mix.cache_limits() == {"b": 20_000, "c": 20_000}  # (not unbounded: weights may rise later)
    mix.set_weights({"a": 0.5, "b": 0.3, "c": 0.2})
    assert mix.cache_limits() == {"b": 24_000, "c": 16_000}


def test_dali_loader_refuses_a_mixture_by_name_before_importing_dali(mixed_sets, monkeypatch):
    import sys

    from fastdata.gpu.dali import DALILoader

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # (importing DALI fails: the refusal comes before it)
    with pytest.raises(ConfigError, match=r"DALILoader does not serve mixtures.*FastLoader.*CUDAPrefetcher"):
        DALILoader(open_mixture(mixed_sets), 8, device="cpu")


# -- real torchrun on gloo ----------------------------------------------------------------------------------
def run_ranks(nproc: int, out: Path, cfg: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "cfg.json").write_text(json.dumps(cfg))
    r = torchrun(nproc, str(WORKER), str(out / "cfg.json"), str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(nproc)]


def steps(ranks: list[dict]) -> list[Counter]:
    """Each step's rows over all ranks, as (tag, id) counts."""
    assert len({len(r["batches"]) for r in ranks}) == 1  # equal batch counts on every rank
    return [Counter(tuple(row) for r in ranks for row in r["batches"][t]) for t in range(len(ranks[0]["batches"]))]


def rows(codes: np.ndarray) -> Counter:
    return Counter(zip((codes >> SHIFT).tolist(), (codes & MASK).tolist()))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_ranks_share_the_global_stream_exactly_once(mixed_sets, tmp_path, nproc):
    cfg = {"sets": {k: str(v) for k, v in mixed_sets.items()}, "weights": WEIGHTS, "seed": 8, "batch": 4,
           "stop_after": -1, "state": None}
    got = steps(run_ranks(nproc, tmp_path / "run", cfg))
    step = 4 * nproc
    assert len(got) == -(-197 // step)  # the epoch's 197 positions in whole steps
    ref = stream(open_mixture(mixed_sets, seed=8), len(got) * step)
    for t, counts in enumerate(got):  # step t of the ranks is the stream's positions [t * step, (t + 1) * step)
        assert counts == rows(ref[t * step:(t + 1) * step])


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_two_ranks_on_three_with_new_weights(mixed_sets, tmp_path):
    cfg = {"sets": {k: str(v) for k, v in mixed_sets.items()}, "weights": WEIGHTS, "seed": 8, "batch": 4,
           "stop_after": 5, "state": None}
    first = run_ranks(2, tmp_path / "a", cfg)
    state = first[0]["state"]
    assert first[1]["state"] == state and state["position"] == 40
    (tmp_path / "state.json").write_text(json.dumps(state))
    new_w = {"a": 0.2, "b": 0.2, "c": 0.6}
    second = run_ranks(3, tmp_path / "b", {**cfg, "weights": new_w, "stop_after": -1,
                                           "state": str(tmp_path / "state.json")})
    before = stream(open_mixture(mixed_sets, seed=8), 40)
    after = stream(open_mixture(mixed_sets, seed=8, weights=new_w), 12 * len(second[0]["batches"]), state=state)
    for t, counts in enumerate(steps(first)):
        assert counts == rows(before[t * 8:(t + 1) * 8])
    for t, counts in enumerate(steps(second)):  # the stream from the saved position on, under the new weights
        assert counts == rows(after[t * 12:(t + 1) * 12])
    mix = open_mixture(mixed_sets, seed=8, weights=new_w)
    for r in second:  # each rank's batches are those of an uninterrupted 3-rank run from that position
        s = MixtureSampler(mix, 4, rank=r["rank"], world_size=3)
        s.load_state_dict(state)
        want = [np.sort(b) for b in s.batches()]
        assert [[list(p) for p in zip((w >> SHIFT).tolist(), (w & MASK).tolist())] for w in want] == r["batches"]
    ref = stream(open_mixture(mixed_sets, seed=8), 10_000)
    for k, n in enumerate(SIZES.values()):  # no source repeats or skips a sample across the cut
        seq = np.concatenate([per_source(before, k), per_source(after, k)])
        assert np.array_equal(seq, per_source(ref, k)[:len(seq)])


# -- dealing without a division per position (NOTE [mixture schedule] 5) ----------------------------------------
# (a separate block: Schedule.deal of ranges, the sampler's runs of draws, EpochOrder.span)
def assert_deals_as_locate(sched: Schedule, n: range | np.ndarray, runs: bool = False) -> None:
    """`deal` gives every position exactly once, grouped by source, with the source and rank `locate` gives."""
    positions = np.arange(n.start, n.stop, n.step, dtype=np.int64) if isinstance(n, range) else n
    src, rank = sched.locate(positions)
    seen = np.zeros(len(positions), dtype=np.int64)
    got = sched.deal(n, runs=runs)
    assert [k for k, _, _ in got] == sorted({k for k, _, _ in got})
    for k, where, m in got:
        places = np.arange(len(positions)) if where is None else where
        assert np.all(np.diff(places) > 0)
        if isinstance(m, range):
            assert runs and isinstance(n, range) and n.step == 1
            m = np.arange(m.start, m.stop, dtype=np.int64)
        assert m.dtype == np.int64 and np.array_equal(src[places], np.full(len(places), k))
        assert np.array_equal(m, rank[places])
        seen[places] += 1
    assert np.all(seen == 1)


@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.2], [1.0], [0, 1.0, 0], [0.7, 0, 0.3, 0], [1e-6, 1, 1e-6],
                                     [1, 1e-6], [3, 1e-6, 2, 1e-6, 1e-6], list(range(1, 17)),
                                     [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
def test_deal_of_ranges_and_arrays_is_locate(weights):
    rng = np.random.default_rng(len(weights))
    q = quantise(weights)
    for key in [(0, 0, 0), (7, 3, 123_456)]:
        sched = Schedule(q, key)
        for start in (0, 1, 99_991, (1 << 40) - 5_000, (1 << 40) + 3, 10**15):
            for step in (1, 2, 3, 8, 64, 1000):
                n = range(start, start + 20_000 * step, step)
                for runs in (False, True):
                    assert_deals_as_locate(sched, n, runs)
                assert_deals_as_locate(sched, np.arange(n.start, n.stop, n.step, dtype=np.int64))
            assert_deals_as_locate(sched, range(start, start + 1))
            assert_deals_as_locate(sched, range(start, start), runs=True)
            assert_deals_as_locate(sched, range(start + 50, start, -7))
        scattered = rng.integers(0, 1 << 45, 5_000)
        assert_deals_as_locate(sched, scattered)  # any order, repeats allowed
        assert_deals_as_locate(sched, np.sort(scattered))


def test_deal_of_a_range_of_step_one_gives_runs_that_tile_each_sources_ranks():
    sched = Schedule(quantise([0.45, 0.35, 0.2]), (2, 0, 0))
    runs = [sched.deal(range(a, b), runs=True) for a, b in [(0, 1000), (1000, 1001), (1001, 70_000)]]
    for k in range(3):  # consecutive runs of positions: each source's ranks continue where they stopped
        ranks = [m for got in runs for j, _, m in got if j == k]
        assert all(isinstance(m, range) for m in ranks)
        assert [r.start for r in ranks[1:]] == [r.stop for r in ranks[:-1]] and ranks[0].start == 0
        assert ranks[-1].stop == sched.count(k, 70_000)


class WindowedSized(Sized):
    """`Sized` with shards of ``shard`` samples (for shuffle_window)."""

    def __init__(self, n: int, shard: int) -> None:
        super().__init__(n)
        self.shard = shard

    def shard_bounds(self) -> np.ndarray:
        return np.r_[np.arange(0, self.n, self.shard, dtype=np.int64), self.n]


def test_the_samplers_runs_give_the_codes_of_the_general_path():
    """`_stream`'s positions are a range: the per-run path (no division per position, slices of each source
    epoch's order) gives what the general path gives for the same positions as an array, in any layout."""
    rng = np.random.default_rng(4)
    for trial in range(30):
        sizes = rng.integers(1, 3000, int(rng.integers(1, 6))).tolist()
        weights = (rng.random(len(sizes)) * (rng.random(len(sizes)) > 0.25)).tolist()
        weights[0] += 0.01
        window = (None, 2)[trial % 3 == 0]
        sources = [WindowedSized(n, 100) for n in sizes] if window else [Sized(n) for n in sizes]
        shuffle = [bool(b) for b in rng.random(len(sizes)) > 0.2]
        mix = Mixture(sources, weights=weights, seed=trial, mix=("sample", "batch")[trial % 2],
                      shuffle=shuffle, shuffle_window=window)
        assert mix.shuffle == shuffle  # (a list: each source's own, in source order)
        served = stream(mix, 3000)
        for k, n in enumerate(sizes):  # an unshuffled source's first epoch is drawn 0, 1, 2...; a shuffled one's not
            draws = per_source(served, k)[:n]
            if n >= 10 and len(draws) >= 5:
                assert np.array_equal(draws, np.arange(len(draws))) != shuffle[k]
        for world in (1, 2, 5):
            rank = int(rng.integers(world))
            s = MixtureSampler(mix, int(rng.integers(1, 50)), rank=rank, world_size=world)
            for _ in range(2):
                first = int(rng.integers(0, 5000)) * world + rank
                positions = range(first, first + int(rng.integers(1, 9000)) * world, world)
                want = s.codes(s.seg, np.arange(positions.start, positions.stop, world), [{} for _ in sizes])
                assert np.array_equal(s.codes(s.seg, positions, [{} for _ in sizes]), want)
                assert np.array_equal(s.codes(s.seg, positions), want)  # (the sampler's own orders)
                s.end_epoch()


def test_span_is_at_of_a_run():
    from fastdata.loading.order import EpochOrder

    for kw in ({}, {"shuffle": False}, {"window": 3, "bounds": np.arange(0, 1001, 50)}):
        order = EpochOrder(1000, 5, 2, **kw)
        whole = order.at(np.arange(1000, dtype=np.int64))
        for lo, hi in [(0, 1000), (0, 0), (17, 18), (333, 999), (950, 1000)]:
            assert np.array_equal(order.span(lo, hi), whole[lo:hi])
        assert np.array_equal(np.sort(whole), np.arange(1000))


def test_the_served_stream_is_the_one_of_before_the_runs():
    """A digest of the global stream three epochs of a fixed mixture give on 1 and 3 ranks (each rank's batches
    put at their positions), both mixes, a weight-0 source, small sources (many source epochs a chunk), as the
    sampler served it before it dealt runs, and before ranks took blocks of each step: the order a saved state
    resumes is the same across versions."""
    import hashlib

    h = hashlib.sha256()
    for mix_kind in ("sample", "batch"):
        mix = Mixture([Sized(n) for n in (3000, 1700, 900, 50)], weights=[0.4, 0.3, 0.0, 0.3], seed=3, mix=mix_kind)
        for world in (1, 3):
            ranks = [MixtureSampler(mix, 24, rank=r, world_size=world) for r in range(world)]
            for _ in range(3):
                h.update(served_in_order(ranks, None)[0].tobytes())
                for s in ranks:
                    s.end_epoch()
    assert h.hexdigest() == "568ab6dfe21ece0edb74efcb6de82f585d2f75b89270e5e8db011e88daa65086"
