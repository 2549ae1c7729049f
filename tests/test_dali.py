"""DALILoader on the CPU (DALI runs without a GPU there): order, coverage, sharding, resume, parity."""
from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import INDEXED_N, corrupt_lmdb_copy, indexed_source, sample_ids

from fastdata.datasets.images import FastDataset
from fastdata.loading.loader import FastLoader

pytestmark = pytest.mark.dali
UNIT = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}  # outputs in [0, 1]: pixel ids can be read back


def ids(x: torch.Tensor) -> list[int]:
    return sample_ids(torch.round(x.float().permute(0, 2, 3, 1) * 255).clamp(0, 255).to(torch.uint8)).tolist()


@pytest.fixture(params=[False, True], ids=["here", "ahead"])
def ahead(request):
    """DALILoader's pipe.run on the consumer's thread, or on its loader thread (NOTE [loader thread]; the
    default on a GPU): the same batches, order, state and error policy."""
    return request.param


def loader(path, **kw):
    from fastdata.dali import DALILoader

    args = {"size": 8, "train": False, "device": "cpu", **UNIT, **kw}
    return DALILoader(path, kw.pop("batch_size", 16), **{k: v for k, v in args.items() if k != "batch_size"})


def test_eval_shapes_values_and_every_sample_once(indexed_datasets, ahead):
    dl = loader(indexed_datasets["lmdb"], run_ahead=ahead)
    batches = list(dl)
    assert len(dl) == len(batches) == 7 and [len(x) for x, _ in batches] == [16] * 6 + [4]
    assert dl.loader_thread_batches == (7 if ahead else 0)  # what bench_dali reads of the loader thread
    x, y = batches[0]
    assert x.shape == (16, 3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.is_contiguous(memory_format=torch.channels_last) and 0 <= float(x.min()) and float(x.max()) <= 1
    seen = [i for x, _ in batches for i in ids(x)]
    assert sorted(seen) == list(range(INDEXED_N))
    assert [int(v) for _, y in batches for v in y] == [i % 3 for i in seen]


def test_same_batches_as_fastloader_for_the_same_seed_and_epoch(indexed_datasets, ahead):
    native = FastLoader(FastDataset(indexed_datasets["lmdb"]), 16, shuffle=True, seed=4, copy=True)
    dali = loader(indexed_datasets["lmdb"], shuffle=True, seed=4, run_ahead=ahead)
    for epoch in (0, 3):
        native.set_epoch(epoch)
        dali.set_epoch(epoch)
        assert [ids(x) for x, _ in dali] == [sample_ids(x).tolist() for x, _ in native]


def test_two_ranks_and_resume(indexed_datasets, ahead):
    per_rank = [[i for x, _ in loader(indexed_datasets["lmdb"], shuffle=True, rank=r, world_size=2, run_ahead=ahead)
                 for i in ids(x)]
                for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) and sorted(per_rank[0] + per_rank[1]) == list(range(INDEXED_N))
    three = [[i for x, _ in loader(indexed_datasets["lmdb"], rank=r, world_size=3) for i in ids(x)] for r in range(3)]
    assert sorted(sum(three, [])) == list(range(INDEXED_N))  # evaluation on 3 ranks: 34 + 33 + 33, no repeats
    a = loader(indexed_datasets["lmdb"], shuffle=True, seed=2, run_ahead=ahead)
    it = iter(a)
    first = [i for _ in range(3) for i in ids(next(it)[0])]
    b = loader(indexed_datasets["lmdb"], shuffle=True, seed=2)
    b.load_state_dict(a.state_dict())
    rest = [i for x, _ in b for i in ids(x)]
    assert Counter(first + rest) == Counter(range(INDEXED_N))


def test_a_state_saved_on_one_split_is_refused_on_the_other(indexed_datasets):
    # DALILoader's state named no split: resuming the train split's state on the val split served it silently
    from fastdata.datasets.splits import split
    from fastdata.errors import ConfigError

    train, val = split(FastDataset(indexed_datasets["lmdb"]), 0.5, seed=1)
    a = loader(train, shuffle=True, seed=2)
    next(iter(a))
    state = a.state_dict()
    assert state["dataset_key"]["split"] == "train"
    loader(train, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved on other samples of the dataset"):
        loader(val, shuffle=True, seed=2).load_state_dict(state)


def test_training_mode_augments_and_casts(indexed_datasets):
    x, y = next(iter(loader(indexed_datasets["lmdb"], train=True, size=6, dtype=torch.bfloat16,
                            mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))))
    assert x.shape == (16, 3, 6, 6) and x.dtype == torch.bfloat16 and y.shape == (16,)


def test_training_crops_and_flips_are_exact_after_a_resume(photo_folder, tmp_path, ahead):
    from fastdata.cli.main import main

    assert main(["preprocess", "images", str(photo_folder), str(tmp_path / "lm"), "--format", "lmdb", "--size", "64",
                 "--workers", "1", "--quiet"]) == 0
    kw = {"train": True, "shuffle": True, "seed": 5, "size": 24, "batch_size": 8, "run_ahead": ahead}
    whole = loader(tmp_path / "lm", **kw)
    whole.set_epoch(1)
    full = [x for x, _ in whole]
    a = loader(tmp_path / "lm", **kw)
    a.set_epoch(1)
    it = iter(a)
    head = [next(it)[0] for _ in range(2)]
    b = loader(tmp_path / "lm", **kw)
    b.load_state_dict(a.state_dict())
    rest = [x for x, _ in b]
    assert len(head) + len(rest) == len(full) == 6  # 42 photos in batches of 8
    for got, want in zip(head + rest, full):
        assert torch.equal(got, want)  # the same samples with the very same crops and flips
    evaluation = loader(tmp_path / "lm", train=False, shuffle=True, seed=5, size=24, batch_size=8)
    evaluation.set_epoch(1)
    assert not any(torch.equal(x, e) for x, (e, _) in zip(full, evaluation))  # random crops, not the centre


def test_crop_boxes_follow_the_rrc_rule_and_skip_nothing(indexed_datasets):
    dl = loader(indexed_datasets["lmdb"], train=True, batch_size=64)
    sizes = [(8, 8)] * 30 + [(90, 120)] * 34
    good = np.ones(64, dtype=bool)
    anchor, shape, mirror = dl._crops(sizes, good, position=64)
    h, w = np.array(sizes).T
    assert anchor.dtype == shape.dtype == mirror.dtype == np.int32 and anchor.shape == shape.shape == (64, 2)
    assert (anchor >= 0).all() and (shape > 0).all()
    assert (anchor[:, 0] + shape[:, 0] <= w).all() and (anchor[:, 1] + shape[:, 1] <= h).all()
    assert 0 < mirror.sum() < 64 and len({tuple(s) for s in shape[30:]}) > 20  # flips mixed, boxes differ
    assert np.array_equal(dl._crops(sizes, good, 64)[0], anchor)  # reproducible from the position...
    assert not np.array_equal(dl._crops(sizes, good, 128)[0], anchor)  # ...and different for another batch
    good[3] = False  # a skipped sample leaves the others' crops where they were
    a2, s2, m2 = dl._crops(sizes, good, 64)
    assert np.array_equal(a2, np.delete(anchor, 3, 0)) and np.array_equal(m2, np.delete(mirror, 3))


def test_eval_parity_with_the_cpu_decode_path(tmp_path):
    from PIL import Image

    from fastdata.cli.main import main

    # Smooth pictures: the two paths use different resize kernels and sub-pixel crop positions, so the
    # comparison is of the images, not of the kernels (high-frequency stripes would differ by ~13/255).
    yy, xx = np.mgrid[0:90, 0:120] / 120.0
    for c in range(2):
        (tmp_path / "src" / f"c{c}").mkdir(parents=True)
        for i in range(6):
            img = np.stack([200 * xx + 20 * i, 150 * yy + 40 * c, 100 + 80 * xx * yy], -1)
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(tmp_path / "src" / f"c{c}" / f"{i}.jpg", quality=95)
    assert main(["preprocess", "images", str(tmp_path / "src"), str(tmp_path / "lm"), "--format", "lmdb",
                 "--size", "48", "--workers", "1", "--quiet"]) == 0
    dali = torch.cat([x for x, _ in loader(tmp_path / "lm", size=40, shuffle=False)])
    ref, _ = FastDataset(tmp_path / "lm", size=40).get_batch(np.arange(len(dali)))
    diff = (dali.permute(0, 2, 3, 1) * 255 - ref.float()).abs()
    assert dali.shape == (12, 3, 40, 40) and float(diff.mean()) < 3.0, float(diff.mean())


def test_corrupt_record_fails_clearly_or_is_skipped(indexed_datasets, tmp_path):
    from fastdata.errors import ImageDecodeError

    root = corrupt_lmdb_copy(indexed_datasets["lmdb"], tmp_path / "lm", 5)
    with pytest.raises(ImageDecodeError, match=r"samples \[5\]"):
        list(loader(root))
    dl = loader(root, on_error="skip")
    seen = [i for x, _ in dl for i in ids(x)]
    assert sorted(seen) == [i for i in range(INDEXED_N) if i != 5] and dl.skipped == [5]


def claiming_copy(src, dst, sample: int, height: int, width: int):
    """A copy of an LMDB dataset whose record ``sample`` has its frame header damaged in place to claim ``height`` x
    ``width`` pixels, its data unchanged: a whole JPEG by its markers (damaged as `corrupt_lmdb_copy` damages)."""
    import shutil
    import struct

    from fastdata.formats.lmdb_store import open_lmdb
    from fastdata.formats.manifest import load_manifest
    from fastdata.imaging.decode_batch import jpeg_size, looks_like_jpeg

    root = shutil.copytree(src, dst)
    reader = open_lmdb(root, load_manifest(root))
    blob, store = reader.get_many([sample])[0], reader.path_of(sample)
    sof = blob.index(b"\xff\xc0")
    bad = blob[:sof + 5] + struct.pack(">HH", height, width) + blob[sof + 9:]
    assert jpeg_size(bad) == (height, width) and looks_like_jpeg(bad)
    data = store.read_bytes()
    at = data.find(blob)
    store.write_bytes(data[:at] + bad + data[at + len(blob):])
    return root


def test_a_header_claiming_13000_pixels_is_refused_before_dali_as_fastdataset_refuses_it(indexed_datasets, tmp_path,
                                                                                          ahead):
    # The host check asked only for a whole JPEG: a header damaged to claim 13000 x 13000 went to DALI's decoder
    # (half a GB for a grey tile, or a DALI error). FastDataset's bounds (NOTE [damaged records] 2) now refuse it
    # on the host, with FastDataset's words
    from fastdata.errors import ImageDecodeError

    root = claiming_copy(indexed_datasets["lmdb"], tmp_path / "lm", 5, 13000, 13000)
    with pytest.raises(ImageDecodeError) as native:
        FastDataset(root).get_batch([4, 5])
    for train in (False, True):
        with pytest.raises(ImageDecodeError, match=r"sample 5 is not a decodable JPEG \(its header says 13000 x 13000 "
                                                   r"pixels, but the dataset stores images with the shorter side at "
                                                   r"most 8 \(its manifest's max_short_side\)") as got:
            list(loader(root, train=train, run_ahead=ahead))
        assert str(got.value).startswith(str(native.value)) and str(got.value).endswith("or pass on_error='skip'")
    # skipped as a record that is not a JPEG at all is: the same samples, crops, flips and state
    kw = {"train": True, "shuffle": True, "seed": 1, "on_error": "skip", "run_ahead": ahead}
    got = loader(root, **kw)
    want = loader(corrupt_lmdb_copy(indexed_datasets["lmdb"], tmp_path / "zeroed", 5), **kw)
    served = 0
    for a, b in itertools.zip_longest(got, want):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and got.state_dict() == want.state_dict()
        served += len(a[1])
    assert served == INDEXED_N - 1 and got.skipped == want.skipped == [5]


@pytest.mark.parametrize("bound", ["zero_side", "max_side", "pillow_limit"])
def test_every_bound_of_fastdatasets_header_check_refuses_a_record_before_dali(indexed_datasets, tmp_path, monkeypatch,
                                                                             bound):
    # A side of 0, a longer side over the manifest's max_side (--resize max-side), or over twice Pillow's pixel
    # limit: refused as FastDataset refuses them, or skipped. Before, DALI decoded the last two (a tile of grey
    # below the data) and called the first "not a whole JPEG"
    from PIL import Image

    from fastdata.cli.main import main
    from fastdata.errors import ImageDecodeError

    src, n = indexed_datasets["lmdb"], INDEXED_N
    if bound == "zero_side":
        claim, needle = (0, 8), r"0 x 8 pixels: the header is damaged"
    elif bound == "max_side":
        src, n = tmp_path / "max-side", 20
        assert main(["preprocess", "images", str(indexed_source(tmp_path / "src", n)), str(src), "--size", "8",
                     "--format", "lmdb", "--resize", "max-side", "--workers", "1", "--quiet", "--quality", "95"]) == 0
        claim, needle = (8, 20), r"8 x 20 pixels, but the dataset stores images with the longer side at most 8 \(its"
    else:  # the dataset bounds only the shorter side (8): a panorama's longer side is bounded by Pillow's limit
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # (lowered: the old way decoded the claim)
        claim, needle = (8, 400), r"8 x 400 pixels, 3200 pixels: it exceeds limit of 2000 pixels"
    root = claiming_copy(src, tmp_path / "lm", 5, *claim)
    with pytest.raises(ImageDecodeError, match=rf"sample 5 is not a decodable JPEG \(its header says {needle}"):
        list(loader(root, batch_size=8))
    dl = loader(root, batch_size=8, on_error="skip")
    assert sorted(i for x, _ in dl for i in ids(x)) == [i for i in range(n) if i != 5] and dl.skipped == [5]


def test_a_jpeg_dali_cannot_decode_follows_the_same_policy(photo_folder, tmp_path, ahead):
    from fastdata.cli.main import main
    from fastdata.errors import ImageDecodeError

    assert main(["preprocess", "images", str(photo_folder), str(tmp_path / "lm"), "--format", "lmdb", "--size", "64",
                 "--workers", "1", "--quiet"]) == 0
    inside = corrupt_lmdb_copy(tmp_path / "lm", tmp_path / "huffman", 17, huffman=True)  # fails inside DALI
    outside = corrupt_lmdb_copy(tmp_path / "lm", tmp_path / "zeroed", 17)  # caught on the host before DALI
    with pytest.raises(ImageDecodeError, match="on_error='skip'"):
        list(loader(inside, batch_size=8, run_ahead=ahead))
    kw = {"train": True, "shuffle": True, "seed": 1, "size": 16, "batch_size": 8, "on_error": "skip", "prefetch": 3,
          "run_ahead": ahead}
    got, want = loader(inside, **kw), loader(outside, **kw)
    for epoch in (0, 1):
        got.set_epoch(epoch)
        want.set_epoch(epoch)
        served = 0
        for a, b in itertools.zip_longest(got, want):  # the same samples, crops and flips after the restart
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and got.state_dict() == want.state_dict()
            served += len(a[1])
        assert served == 41  # 42 photos, one left out
    assert got.skipped == want.skipped == [17]
    # an iteration left after k batches, then iterated again: DALI's batches in flight are run out (the
    # undecodable one among them for some k: a new pipeline then) and the rest follows exactly
    want.set_epoch(2)
    full = [(a.clone(), b.clone()) for a, b in want]
    for k in range(1, len(full)):
        dl = loader(inside, **kw)
        dl.set_epoch(2)
        it = iter(dl)
        head = [next(it) for _ in range(k)]
        if k % 2:
            del it  # closed first (the Trainer's way at max_steps), or left open while the loader goes on
        rest = list(dl)
        assert len(head) + len(rest) == len(full)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(head + rest, full)), k


def test_pipelined_state_counts_only_served_batches_and_all_skipped_batches(indexed_datasets, tmp_path, ahead):
    from fastdata.errors import ConfigError

    root = corrupt_lmdb_copy(indexed_datasets["lmdb"], tmp_path / "lm", 5)
    dl = loader(root, batch_size=1, on_error="skip", prefetch=4, run_ahead=ahead)  # DALI pulls 4 batches ahead
    it = iter(dl)
    head = [ids(next(it)[0])[0] for _ in range(6)]
    assert head == [0, 1, 2, 3, 4, 6] and dl.state_dict()["position"] == 7  # sample 5's batch was skipped
    resumed = loader(root, batch_size=1, on_error="skip")
    resumed.load_state_dict(dl.state_dict())
    assert [i for x, _ in resumed for i in ids(x)] == list(range(7, INDEXED_N))
    pipe = dl._pipe
    again = iter(dl)  # the abandoned iteration's loader, iterated again, goes on from where it was left
    assert ids(next(again)[0]) == [7]
    assert dl._pipe is pipe  # with the same pipeline: the batches DALI held were run out, not rebuilt
    with pytest.raises(StopIteration):  # the new iteration closed it (and stopped its loader thread)
        next(it)
    del it  # dropping it leaves the running one alone
    assert [i for x, _ in again for i in ids(x)] == list(range(8, INDEXED_N))
    assert [ids(x)[0] for x, _ in dl][:2] == [0, 1]  # then a new epoch
    it = iter(dl)
    assert [ids(next(it)[0])[0] for _ in range(3)] == [0, 1, 2]
    del it  # an iteration closed unfinished keeps its pipeline for the next one
    assert [ids(x)[0] for x, _ in dl][:2] == [3, 4] and dl._pipe is pipe
    with pytest.raises(ConfigError, match="prefetch"):
        loader(root, prefetch=0)
    with pytest.raises(ConfigError, match="hw_decoder_load"):
        loader(root, hw_decoder_load=1.5)


def test_hw_decoder_load_is_a_share_none_or_auto(indexed_datasets):
    from fastdata.errors import ConfigError

    for bad in ("fastest", "AUTO", -0.1, 1.5, True, [0.5]):
        with pytest.raises(ConfigError, match="'auto'"):
            loader(indexed_datasets["lmdb"], hw_decoder_load=bad)
    for ok in (0, 0.5, 1, None):
        assert loader(indexed_datasets["lmdb"], hw_decoder_load=ok).hw_decoder_load_chosen == ok


def test_auto_hw_decoder_load_on_the_cpu_is_dalis_default(indexed_datasets, ahead):
    kw = {"shuffle": True, "seed": 2, "run_ahead": ahead}
    auto = loader(indexed_datasets["lmdb"], hw_decoder_load="auto", **kw)
    default = loader(indexed_datasets["lmdb"], **kw)
    assert all(torch.equal(a, b) for (a, _), (b, _) in itertools.zip_longest(auto, default))
    assert auto.hw_decoder_load_trial is None and auto.hw_decoder_load_chosen is None  # nothing to measure


def test_choosing_the_hw_decoder_load_from_measurements():
    from fastdata.gpu.dali_tune import CANDIDATES, HwLoadTrial, choose, flat

    assert choose({}) is None
    assert choose({0.65: 1.0, 0.0: 1.5, 1.0: 0.8, 0.9: 0.7, 0.5: 0.9}) == 0.9  # the fastest
    assert choose({0.65: 1.0, 0.0: 1.5, 1.0: 1.02}) == 1.0  # within 3%: the most to the hardware decoder
    assert choose({0.65: 1.0, 1.0: 1.04}) == 0.65
    assert flat([1.0, 1.01, 1.029]) and not flat([1.0, 1.01]) and not flat([1.0, 1.01, 1.05])
    trial = HwLoadTrial(torch.device("cpu"))
    assert trial.load == CANDIDATES[0] == 0.65 and not trial.done  # DALI's default first
    for load, s in zip(CANDIDATES, (1.0, 1.3, 0.9, 0.8, 0.85)):
        assert trial.load == load and trial.window().warmup == (12 if load == 0.65 else 4)
        trial.record(load, s)
    assert trial.done and trial.chosen == trial.load == 0.9 and trial.window() is None
    even = HwLoadTrial(torch.device("cpu"))  # no difference between the first three: settled after them
    for s in (1.0, 1.01, 0.995):
        even.record(even.load, s)
    assert even.chosen == 1.0 and list(even.seconds_per_batch) == [0.65, 0.0, 1.0]
    timed = HwLoadTrial(torch.device("cpu"), warmup=2, first_warmup=3, batches=2, seconds=0.5)
    window = timed.window()  # 3 outputs untimed, then at least 2 and 0.5 s
    assert [window.tick() for _ in range(6)] == [False] * 6 and not timed.seconds_per_batch
    time.sleep(0.55)
    assert window.tick() and 0.55 / 4 <= timed.seconds_per_batch[0.65] < 1.0  # 4 timed outputs
    assert timed.load == 0.0 and timed.window().warmup == 2
    carried = HwLoadTrial(torch.device("cpu"), warmup=1, first_warmup=1, batches=4, seconds=0.0)
    window = carried.window()
    assert [window.tick() for _ in range(3)] == [False] * 3  # 1 untimed, 2 timed: then the epoch ends
    window.close()
    window = carried.window()  # the next epoch's: warmed up again, 2 more timed make the 4
    assert [window.tick() for _ in range(3)] == [False, False, True] and list(carried.seconds_per_batch) == [0.65]


def test_a_lockstep_trial_ends_its_windows_on_a_count_and_measures_every_load(monkeypatch):
    # NOTE [hw_decoder_load auto] 9: under DDP no window waits on the host's clock and none settles early
    from fastdata.gpu import dali_tune
    from fastdata.gpu.dali_tune import CANDIDATES, HwLoadTrial

    monkeypatch.setattr(dali_tune, "LOCKSTEP_BATCHES", 3)
    trial = HwLoadTrial(torch.device("cpu"), warmup=1, first_warmup=2, batches=50, seconds=10.0, lockstep=True)
    window = trial.window()
    assert [window.tick() for _ in range(5)] == [False, False, False, False, True]  # 2 untimed, 3 timed
    for s in (1.01, 0.995, 1.0, 1.0):  # the first three are even: a lone rank would settle here
        trial.record(trial.load, s)
    assert trial.done and list(trial.seconds_per_batch) == list(CANDIDATES)


def test_ranks_switch_pipelines_at_the_same_batch_during_a_lockstep_trial(indexed_datasets, monkeypatch):
    from fastdata.gpu import dali_tune
    from fastdata.gpu.dali_tune import HwLoadTrial

    monkeypatch.setattr(dali_tune, "LOCKSTEP_BATCHES", 4)
    loads, seen = [], []
    for rank in (0, 1):
        dl = loader(indexed_datasets["lmdb"], batch_size=4, shuffle=True, seed=3, rank=rank, world_size=2)
        dl.hw_decoder_load_trial = HwLoadTrial(dl.device, warmup=1, first_warmup=2, lockstep=True)
        mine, served = [], []
        for epoch in range(4):
            dl.set_epoch(epoch)
            for x, _ in dl:
                mine.append(None if dl.hw_decoder_load_trial.done else dl._load)  # each rank chooses its own
                served += ids(x) if epoch == 0 else []
            if rank == 0:
                time.sleep(0.05)  # the ranks' clocks differ: their windows still end together
        loads.append(mine)
        seen.append(served)
        assert dl.hw_decoder_load_trial.done and len(dl.hw_decoder_load_trial.seconds_per_batch) == 5
    assert loads[0] == loads[1] and len(set(loads[0])) == 6  # every switch, and the end, at the same batch
    assert not set(seen[0]) & set(seen[1]) and len(seen[0]) + len(seen[1]) == 100  # each sample once


def trial_loader(path, **kw):
    """A DALILoader running the ``"auto"`` trial with short windows (8 batches, no least duration): on the
    CPU, where "auto" has no trial of its own, the pipeline switches run on DALI's CPU decoder (which
    ignores the load), timed by the host clock."""
    from fastdata.gpu.dali_tune import HwLoadTrial

    dl = loader(path, **kw)
    dl.hw_decoder_load_trial = HwLoadTrial(dl.device, warmup=1, first_warmup=2, batches=8, seconds=0.0)
    return dl


def test_the_hw_decoder_load_trial_serves_every_batch_once_in_order_and_resumes(indexed_datasets, ahead):
    """NOTE [hw_decoder_load auto] 4-5: the candidates' pipelines take turns in the epoch's plan, their
    batches in flight served at each switch; a break or a resume anywhere in the trial changes nothing."""
    import weakref

    kw = {"batch_size": 4, "shuffle": True, "seed": 3, "run_ahead": ahead}
    fixed, dl = loader(indexed_datasets["lmdb"], **kw), trial_loader(indexed_datasets["lmdb"], **kw)
    pipes = []
    for epoch in range(4):  # 25 batches an epoch; the trial about 50 (30 when the first three loads are even)
        fixed.set_epoch(epoch)
        dl.set_epoch(epoch)
        for (a, _), (b, _) in itertools.zip_longest(fixed, dl):
            assert torch.equal(a, b)
            pipe = dl._pipe  # None for a moment while the loader thread switches pipelines
            if pipe is not None and all(r() is not pipe for r in pipes):
                pipes.append(weakref.ref(pipe))
            del pipe
            assert len(dl._kept) <= 1  # the best so far, beside the one under trial
        assert epoch > 0 or not dl.hw_decoder_load_trial.done  # the trial goes on into the next epoch
        if dl.hw_decoder_load_trial.done:
            break
    trial = dl.hw_decoder_load_trial
    assert trial.done and dl.hw_decoder_load_chosen == trial.chosen in trial.seconds_per_batch
    assert len(trial.seconds_per_batch) in (3, 5) and dl._load == trial.chosen and not dl._kept
    gc.collect()
    assert len(pipes) >= 2 and [r() for r in pipes if r() is not None] == [dl._pipe]  # the others freed
    fixed.set_epoch(0)
    full = [ids(x) for x, _ in fixed]
    for k in range(1, 25, 3):
        a = trial_loader(indexed_datasets["lmdb"], **kw)
        it = iter(a)
        head = [ids(next(it)[0]) for _ in range(k)]
        b = trial_loader(indexed_datasets["lmdb"], **kw)
        b.load_state_dict(a.state_dict())
        assert head + [ids(x) for x, _ in b] == full, k
        if k % 2:
            del it  # closed during the trial, or left open while the loader goes on
        assert head + [ids(x) for x, _ in a] == full, k  # the same loader: batches in flight run out


def test_a_decode_error_during_the_hw_decoder_load_trial(photo_folder, tmp_path, ahead):
    """A JPEG that fails inside DALI while the trial switches pipelines: the same policy, samples and crops."""
    from fastdata.cli.main import main

    assert main(["preprocess", "images", str(photo_folder), str(tmp_path / "lm"), "--format", "lmdb", "--size", "64",
                 "--workers", "1", "--quiet"]) == 0
    inside = corrupt_lmdb_copy(tmp_path / "lm", tmp_path / "huffman", 17, huffman=True)  # fails inside DALI
    outside = corrupt_lmdb_copy(tmp_path / "lm", tmp_path / "zeroed", 17)  # caught on the host before DALI
    kw = {"train": True, "shuffle": True, "seed": 1, "size": 16, "batch_size": 2, "on_error": "skip", "prefetch": 3,
          "run_ahead": ahead}
    got, want = trial_loader(inside, **kw), loader(outside, **kw)
    for epoch in range(4):  # 21 batches an epoch, the trial about 55 (prefetch 3: each switch runs out 2)
        got.set_epoch(epoch)
        want.set_epoch(epoch)
        for a, b in itertools.zip_longest(got, want):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and got.state_dict() == want.state_dict()
    assert got.skipped == [17] and got.hw_decoder_load_trial.done and not got._kept


def test_a_decode_error_on_one_rank_keeps_the_lockstep_trials_switches_together(indexed_datasets, tmp_path,
                                                                               monkeypatch):
    # NOTE [hw_decoder_load auto] 9: the window a decode error cuts counts on, on the rank that met it
    from fastdata.gpu import dali_tune
    from fastdata.gpu.dali_tune import HwLoadTrial

    monkeypatch.setattr(dali_tune, "LOCKSTEP_BATCHES", 4)
    bad = corrupt_lmdb_copy(indexed_datasets["lmdb"], tmp_path / "bad", 7, huffman=True)  # fails inside DALI
    loads = []
    for rank in (0, 1):
        dl = loader(bad, batch_size=4, shuffle=True, seed=3, rank=rank, world_size=2, on_error="skip")
        dl.hw_decoder_load_trial = HwLoadTrial(dl.device, warmup=1, first_warmup=2, lockstep=True)
        mine = []
        for epoch in range(4):
            dl.set_epoch(epoch)
            mine += [None if dl.hw_decoder_load_trial.done else dl._load for _ in dl]
        loads.append(mine)
        assert dl.skipped == [7] and dl.hw_decoder_load_trial.done
    assert loads[0] == loads[1] and len(set(loads[0])) == 6


def test_without_dali_the_error_names_the_extra():
    code = ("import sys; sys.modules['nvidia.dali'] = None\n"
            "from fastdata.dali import _dali\n"
            "from fastdata.errors import MissingDependencyError\n"
            "try: _dali()\n"
            "except MissingDependencyError as e: print(e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'fastdata[dali]'" in r.stdout and "nvidia-dali-cuda120" in r.stdout


@pytest.mark.slow
def test_fastdata_train_backend_dali(indexed_datasets, tmp_path):
    from fastdata.cli.main import main

    assert main(["train", str(indexed_datasets["lmdb"]), "--backend", "dali", "--model", "resnet18", "--crop", "8",
                 "--batch-size", "16", "--max-steps", "3", "--device", "cpu", "--quiet", "--val-fraction", "0.2"]) == 0


@pytest.mark.cuda
def test_gpu_decode_matches_cpu_decode(indexed_datasets):
    cpu = torch.cat([x for x, _ in loader(indexed_datasets["lmdb"])])
    for hw in (None, 1.0, 0.0):  # DALI's default share, all JPEGs, none for the hardware decoder
        gpu = torch.cat([x for x, _ in loader(indexed_datasets["lmdb"], device="cuda", hw_decoder_load=hw)])
        assert gpu.is_cuda and float((gpu.cpu() - cpu).abs().mean()) < 0.02, hw


@pytest.mark.cuda
def test_gpu_training_batches_are_bf16_channels_last_and_exact_after_a_resume(indexed_datasets):
    kw = {"train": True, "shuffle": True, "seed": 3, "device": "cuda", "dtype": torch.bfloat16, "batch_size": 16}
    whole = [(x, y) for x, y in loader(indexed_datasets["lmdb"], **kw)]
    x, y = whole[0]
    assert x.is_cuda and y.is_cuda and x.dtype == torch.bfloat16 and y.dtype == torch.int64
    assert x.shape == (16, 3, 8, 8) and x.is_contiguous(memory_format=torch.channels_last)
    a = loader(indexed_datasets["lmdb"], **kw)
    it = iter(a)
    head = [next(it)[0] for _ in range(3)]
    b = loader(indexed_datasets["lmdb"], **kw)
    b.load_state_dict(a.state_dict())
    for got, (want, _) in zip(head + [x for x, _ in b], whole):
        assert torch.equal(got, want)  # nvJPEG decode and the host-drawn crops are deterministic
    # NOTE [DALI outputs on the stream]: outputs bound to a busy consumer stream are copied only once DALI
    # wrote them, and equal the host-synchronous ones; NOTE [loader thread]: the loader
    # thread's batches (the default on a GPU) equal those of pipe.run on this thread
    synced = [x for x, _ in loader(indexed_datasets["lmdb"], stream_outputs=False, run_ahead=False, **kw)]
    here = [x for x, _ in loader(indexed_datasets["lmdb"], run_ahead=False, **kw)]
    assert len(here) == len(whole) and all(torch.equal(a, b) for a, b in zip(here, synced))
    streamed = []
    for x, _ in loader(indexed_datasets["lmdb"], **kw):
        streamed.append(x)
        torch.cuda._sleep(20_000_000)  # the stream the next batch is bound to is busy for a while
    assert len(streamed) == len(whole) and all(torch.equal(a, b) for a, b in zip(streamed, synced))


@pytest.mark.cuda
def test_gpu_auto_hw_decoder_load_serves_a_fixed_loads_samples_chooses_and_frees_the_rest(indexed_datasets):
    """NOTE [hw_decoder_load auto] on a GPU: the trial spans epochs of 100 one-image batches, each candidate's
    window half a second; then short windows, with breaks and resumes inside the trial."""
    import weakref

    from fastdata.gpu.dali_tune import CANDIDATES

    kw = {"train": True, "shuffle": True, "seed": 6, "device": "cuda", "batch_size": 1}  # crops of flat colours
    fixed = loader(indexed_datasets["lmdb"], hw_decoder_load=0.65, **kw)
    auto = loader(indexed_datasets["lmdb"], hw_decoder_load="auto", **kw)
    trial = auto.hw_decoder_load_trial
    assert trial is not None and auto.hw_decoder_load_chosen is None
    pipes = []
    for epoch in range(300):  # the trial lasts a few seconds, an epoch of one-image batches a fraction of one
        fixed.set_epoch(epoch)
        auto.set_epoch(epoch)
        got = []
        for x, _ in auto:
            got.append(ids(x))
            pipe = auto._pipe  # None for a moment while the loader thread switches pipelines
            if pipe is not None and all(r() is not pipe for r in pipes):
                pipes.append(weakref.ref(pipe))
            del pipe
        assert got == [ids(x) for x, _ in fixed], epoch  # the same samples in the same order
        if trial.done:
            break
    assert trial.done and auto.hw_decoder_load_chosen in CANDIDATES and len(trial.seconds_per_batch) in (3, 5)
    assert all(s > 0 for s in trial.seconds_per_batch.values()), trial.seconds_per_batch
    gc.collect()
    assert len(pipes) >= 2 and [r() for r in pipes if r() is not None] == [auto._pipe] and not auto._kept
    fixed.set_epoch(0)
    want = [ids(x) for x, _ in fixed]
    for k in (3, 9, 14, 22, 33):  # short windows (10 batches a candidate): breaks all through the trial
        a = trial_loader(indexed_datasets["lmdb"], hw_decoder_load="auto", **kw)
        it = iter(a)
        head = [ids(next(it)[0]) for _ in range(k)]
        b = trial_loader(indexed_datasets["lmdb"], hw_decoder_load="auto", **kw)
        b.load_state_dict(a.state_dict())
        assert head + [ids(x) for x, _ in b] == want, k
        del it
        assert head + [ids(x) for x, _ in a] == want, k
        assert a.hw_decoder_load_trial.done and a.hw_decoder_load_chosen in CANDIDATES


def test_outputs_go_to_the_consumers_stream_with_dalis_default_executor():
    """NOTE [DALI outputs on the stream]: which pipelines hand their outputs to a CUDA stream."""
    import nvidia.dali as dali

    from fastdata.dali import _stream_outputs

    assert _stream_outputs(dali.Pipeline(batch_size=2, num_threads=1, device_id=None))  # the default executor
    assert not _stream_outputs(dali.Pipeline(batch_size=2, num_threads=1, device_id=None, exec_dynamic=False))


def test_a_trial_chosen_as_an_epoch_ends_keeps_one_pipeline(indexed_datasets):
    """The window that ends the trial closes with the epoch and picks the pipeline running: the candidate
    kept beside it goes too (it stayed for good, with DALI's pools, before)."""
    from fastdata.gpu.dali_tune import HwLoadTrial

    dl = loader(indexed_datasets["lmdb"], batch_size=4, shuffle=True, seed=3, run_ahead=False)
    dl.hw_decoder_load_trial = HwLoadTrial(dl.device, candidates=(0.65, 0.0), warmup=1, first_warmup=1,
                                           batches=1, seconds=0.3)
    for epoch in range(2):
        dl.set_epoch(epoch)
        for n, _ in enumerate(dl, 1):
            if epoch == 0:
                time.sleep(0.005)  # 0.65 looks slow
            if n == 25:
                time.sleep(0.35)  # the window's host time passes its least only when the epoch ends
    trial = dl.hw_decoder_load_trial
    assert trial.done and trial.chosen == dl._load == 0.0 and not dl._kept, (trial.chosen, dl._load, dl._kept)
