"""Batched transforms against straightforward per-sample references, with the very same random draws."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdata.errors import ConfigError
from fastdata.imaging.transforms import (CenterCrop, Compose, Normalize, RandomCrop, RandomHorizontalFlip,
                                         RandomResizedCrop, rrc_boxes)


def batch(b=6, h=20, w=24, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nhwc = torch.randint(0, 256, (b, h, w, 3), generator=g, dtype=torch.uint8)
    return nhwc.permute(0, 3, 1, 2)  # the channels_last view CUDAPrefetcher hands to transforms


def gen(seed=1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_flip_matches_per_sample_reference():
    x, t = batch(), RandomHorizontalFlip(0.5)
    flip = t.params(x, gen())
    assert 0 < int(flip.sum()) < len(flip)  # this draw flips some and keeps others
    out = t.apply(x, flip)
    for b in range(len(x)):
        assert torch.equal(out[b], x[b].flip(-1) if flip[b] else x[b])
    assert out.dtype == torch.uint8


def test_random_crop_with_padding_matches_reference():
    x, t = batch(), RandomCrop(16, padding=4)
    off = t.params(x, gen())
    assert off.min() >= 0 and off[:, 0].max() <= 20 + 8 - 16 and off[:, 1].max() <= 24 + 8 - 16
    out = t.apply(x, off)
    assert out.shape == (6, 3, 16, 16) and out.is_contiguous(memory_format=torch.channels_last)
    for b in range(len(x)):
        padded = F.pad(x[b], (4, 4, 4, 4))
        top, left = off[b].tolist()
        assert torch.equal(out[b], padded[:, top:top + 16, left:left + 16])


def test_center_crop():
    x = batch(h=21, w=24)
    out = CenterCrop((10, 12))(x)
    assert torch.equal(out, x[:, :, 6:16, 6:18])  # round((21-10)/2) = 6 (round half to even), (24-12)/2 = 6


def test_random_resized_crop_matches_crop_then_interpolate():
    x, t = batch(b=8, h=40, w=48).float(), RandomResizedCrop(16, scale=(0.3, 1.0))
    boxes = t.params(x, gen(3))
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 40).all() and (left + w <= 48).all()
    assert ((h * w) / (40 * 48)).min() >= 0.3 - 0.05
    out = t.apply(x, boxes)
    assert out.shape == (8, 3, 16, 16) and out.dtype == torch.float32
    for b in range(8):
        t0, l0, hh, ww = (int(v) for v in boxes[b])
        ref = F.interpolate(x[b:b + 1, :, t0:t0 + hh, l0:l0 + ww], size=(16, 16), mode="bilinear",
                            align_corners=False)[0]
        # Inside the box the two sample the same points; at the edge grid_sample may read the pixel just
        # outside the box where interpolate clamps to the box: compare the interior exactly-ish.
        assert torch.allclose(out[b, :, 1:-1, 1:-1], ref[:, 1:-1, 1:-1], atol=1e-3), b


def test_random_resized_crop_falls_back_to_centre_when_nothing_fits():
    x, t = batch(b=4, h=10, w=40).float(), RandomResizedCrop(8, scale=(0.99, 1.0), ratio=(1.0, 1.0))
    boxes = t.params(x, gen())  # a 1:1 box of 99% of a 10x40 image can never fit
    assert boxes.tolist() == [[0.0, 15.0, 10.0, 10.0]] * 4


def test_rrc_boxes_for_one_size_given_as_numbers_are_those_of_per_image_sizes():
    """A batch tensor's boxes take the image size as numbers (host constants, fewer kernels): the same
    boxes, bit for bit, as the per-image path (the decode-time crops and DALI), fallbacks included."""
    ratios = [(3 / 4, 4 / 3), (0.5, 2.0), (1.0, 1.0), (0.9, 1.1)]
    for h, w in [(375, 500), (500, 375), (10, 40), (40, 10), (224, 224), (7, 300), (333, 257), (1, 1)]:
        for ratio in ratios:
            u = torch.rand(200, 10, 4, generator=gen(h + w))
            u[:50, :, 0] = 1.0  # whole-image areas: most fall back
            for scale in [(0.08, 1.0), (0.9, 1.0)]:
                n = len(u)
                per_image = rrc_boxes(torch.full((n,), h), torch.full((n,), w), u, scale, ratio)
                assert torch.equal(rrc_boxes(h, w, u, scale, ratio), per_image), (h, w, ratio, scale)


def test_rrc_boxes_per_image_size_match_torchvisions_rule_sample_by_sample():
    import math

    sizes = [(375, 500), (500, 375), (10, 40), (40, 10), (224, 224), (7, 300)]
    H = torch.tensor([h for h, _ in sizes])
    W = torch.tensor([w for _, w in sizes])
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    u = torch.rand(len(sizes), 10, 4, generator=gen(5))
    u[2:4, :, 0] = 1.0  # whole-image area at a 3:4..4:3 aspect cannot fit 10x40 or 40x10: the fallback
    boxes = rrc_boxes(H, W, u, scale, ratio)
    for b, (h0, w0) in enumerate(sizes):  # torchvision's get_params, one image at a time, same draws
        for k in range(10):
            area = h0 * w0 * (scale[0] + float(u[b, k, 0]) * (scale[1] - scale[0]))
            aspect = math.exp(math.log(ratio[0]) + float(u[b, k, 1]) * (math.log(ratio[1]) - math.log(ratio[0])))
            w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < w <= w0 and 0 < h <= h0:
                top, left = math.floor(float(u[b, k, 2]) * (h0 - h + 1)), math.floor(float(u[b, k, 3]) * (w0 - w + 1))
                break
        else:
            if w0 / h0 < ratio[0]:
                w, h = w0, round(w0 / ratio[0])
            elif w0 / h0 > ratio[1]:
                w, h = round(h0 * ratio[1]), h0
            else:
                w, h = w0, h0
            top, left = (h0 - h) // 2, (w0 - w) // 2
        assert boxes[b].tolist() == [top, left, h, w], (b, sizes[b])
    assert boxes[2].tolist() == [0, 13, 10, 13] and boxes[3].tolist() == [13, 0, 13, 10]


def test_normalize_values_and_dtypes():
    x = batch()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    ref = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    out = Normalize(mean, std)(x)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        low = Normalize(mean, std, dtype)(x)
        assert low.dtype == dtype and torch.allclose(low.float(), ref, atol=2e-2, rtol=1e-2)
    assert torch.allclose(Normalize(None, None)(x), x.float() / 255)


def test_normalize_without_mean_takes_any_channel_count():
    x = batch()
    gray, n = x[:, :1], Normalize(None, None)
    for images in (gray, x, gray):  # x / 255: the coefficients of each channel count, cached apart
        assert torch.allclose(n(images), images.float() / 255)
    with pytest.raises(ConfigError, match="mean/std have 3 channels, the images 1"):
        Normalize()(gray)


def test_compose_is_reproducible_with_the_same_generator():
    x = batch()
    t = Compose([RandomResizedCrop(12), RandomHorizontalFlip()])
    assert torch.equal(t(x, gen(5)), t(x, gen(5)))
    assert not torch.equal(t(x, gen(5)), t(x, gen(6)))


def test_draws_are_uniform_independent_of_how_they_are_split_and_of_the_seed():
    from fastdata.imaging.draws import Draws

    def splitmix64(x: int) -> int:  # the published algorithm, in Python's unbounded integers
        m = (1 << 64) - 1
        z = (x * 0x9E3779B97F4A7C15 + 2 ** 40 + 7) & m
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & m
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & m
        return z ^ (z >> 31)

    whole = Draws(2 ** 40 + 7).rand(300_000)
    assert whole[:50].tolist() == [(splitmix64(i) >> 40) / 2 ** 24 for i in range(50)]
    d = Draws(2 ** 40 + 7)
    parts = torch.cat([d.rand(7), d.rand(3, 10).flatten(), d.rand(300_000 - 37)])
    assert torch.equal(whole, parts) and d.used == 300_000
    assert whole.dtype == torch.float32 and 0 <= float(whole.min()) and float(whole.max()) < 1
    counts = torch.histc(whole, bins=20, min=0, max=1)  # 15,000 expected a bin; chi-square, 19 dof
    assert float(((counts - 15_000) ** 2 / 15_000).sum()) < 50
    assert abs(float(torch.corrcoef(torch.stack([whole[:-1], whole[1:]]))[0, 1])) < 0.01  # neighbours
    other = Draws(2 ** 40 + 8).rand(300_000)  # seeds one apart (and apart in the high word only) differ
    assert float((whole == other).float().mean()) < 1e-3
    assert not torch.equal(Draws(7).rand(1000), Draws(2 ** 40 + 7).rand(1000))


def test_transforms_take_draws_as_they_take_a_generator():
    from fastdata.imaging.draws import Draws

    x = batch()
    t = Compose([RandomResizedCrop(12), RandomHorizontalFlip()])
    assert torch.equal(t(x, Draws(5)), t(x, Draws(5)))
    assert not torch.equal(t(x, Draws(5)), t(x, Draws(6)))


def test_draws_keyed_by_a_tensor_read_the_key_when_they_draw():
    """What a CUDA graph's replays rely on (NOTE [graphed convert]): a stream keyed by a tensor draws what a
    stream of that key draws, for every key (those above 2**63 included), and follows the tensor's value."""
    from fastdata.imaging.draws import Draws

    key = torch.zeros((), dtype=torch.int64)
    for seed in (0, 7, 2 ** 40 + 7, 2 ** 63 + 5, 2 ** 64 - 1):
        key.fill_(Draws(seed).key)
        keyed, plain = Draws.keyed(key, used=3), Draws(seed)
        plain.rand(3)
        assert torch.equal(keyed.rand(5, 40), plain.rand(5, 40)) and keyed.used == plain.used == 203, seed
    t = Compose([RandomResizedCrop(12), RandomHorizontalFlip()])
    key.fill_(Draws(5).key)
    assert torch.equal(t(batch(), Draws.keyed(key)), t(batch(), Draws(5)))


@pytest.mark.cuda
def test_draws_and_the_transforms_drawing_them_are_the_same_on_the_gpu():
    from fastdata.imaging.draws import Draws

    assert torch.equal(Draws(123).rand(4, 1000, device="cuda").cpu(), Draws(123).rand(4, 1000))
    x = batch(b=32)
    for t in (RandomResizedCrop(12), RandomCrop(16, padding=4), RandomHorizontalFlip()):
        assert torch.equal(t.params(x.cuda(), Draws(9)).cpu(), t.params(x, Draws(9))), t
    t = Compose([RandomResizedCrop(12), RandomHorizontalFlip()])
    assert torch.allclose(t(x.cuda().float(), Draws(3)).cpu(), t(x.float(), Draws(3)), atol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_flip_folded_into_the_crop_gives_the_bits_of_the_two_steps(device):
    """NOTE [flip folded into the crop]: Compose runs crop + flip as one step; the draws and pixels are those
    of the crop, then the flip, run one after the other (a mirrored grid lands on the mirrored points)."""
    from fastdata.imaging.draws import Draws

    cases = [(RandomResizedCrop(12), (20, 24)), (RandomResizedCrop((17, 31)), (40, 37)),
             (RandomResizedCrop(64, scale=(0.5, 1.0)), (48, 50)), (RandomCrop(16, padding=4), (20, 24)),
             (RandomCrop((9, 13)), (20, 24))]
    for crop, (h, w) in cases:
        x = batch(b=64, h=h, w=w, seed=h).to(device)
        for make in (lambda: Draws(7), lambda: torch.Generator(device).manual_seed(7)):
            g = make()
            two_steps = RandomHorizontalFlip()(crop(x, g), g)
            fused = Compose([crop, RandomHorizontalFlip()])(x, make())
            assert torch.equal(fused, two_steps), (crop, make())
            unflipped = crop(x, make())
            mirrored = (fused != unflipped).flatten(1).any(1)
            assert 10 < int(mirrored.sum()) < 54  # about half the samples were mirrored


def test_normalize_writes_the_asked_layout_with_the_same_values():
    x = batch(h=20, w=24)
    nchw = x.contiguous()  # grid_sample's output layout: a channels_last copy was needed after it
    for dtype in (torch.float32, torch.bfloat16):
        plain = Normalize(dtype=dtype)(nchw)
        out = Normalize(dtype=dtype, memory_format=torch.channels_last)(nchw)
        assert out.is_contiguous(memory_format=torch.channels_last) and not plain.is_contiguous(
            memory_format=torch.channels_last)
        assert out.dtype == dtype and torch.equal(out, plain)


@pytest.mark.parametrize("make, needle", [
    (lambda: RandomHorizontalFlip(2), "p must be"), (lambda: RandomCrop(0), "size must be"),
    (lambda: RandomCrop(8, padding=-1), "padding"), (lambda: RandomResizedCrop(8, scale=(0.5, 0.1)), "scale"),
    (lambda: Normalize((0.5,), None), "both mean and std"), (lambda: Normalize(dtype=torch.int32), "floating"),
    (lambda: Normalize((0.5, 0.4, 0.3), (0.2,)), "one value per channel")])
def test_bad_arguments(make, needle):
    with pytest.raises(ConfigError, match=needle):
        make()


@pytest.mark.cuda
def test_deterministic_parts_are_bit_equal_on_the_gpu():
    x = batch()
    for t in (Normalize(), CenterCrop(10), Normalize(dtype=torch.bfloat16)):
        assert torch.equal(t(x.cuda()).cpu(), t(x))
    flip, crop = RandomHorizontalFlip(), RandomCrop(16, padding=4)
    f, o = flip.params(x, gen()), crop.params(x, gen())
    assert torch.equal(flip.apply(x.cuda(), f.cuda()).cpu(), flip.apply(x, f))
    assert torch.equal(crop.apply(x.cuda(), o.cuda()).cpu(), crop.apply(x, o))


TRANSFORMS = [RandomHorizontalFlip(), CenterCrop(4), RandomCrop(4, padding=1), RandomResizedCrop(4),
              Compose([RandomResizedCrop(4), RandomHorizontalFlip()]), Compose([RandomCrop(4), RandomHorizontalFlip()])]


@pytest.mark.parametrize("t", TRANSFORMS, ids=repr)
def test_an_empty_batch_gives_an_empty_batch(t):
    x = batch(b=0, h=6, w=6)
    side = 6 if isinstance(t, RandomHorizontalFlip) else 4
    assert t(x, gen()).shape == (0, 3, side, side)
    out = t({"image": x, "mask": torch.zeros(0, 6, 6, dtype=torch.uint8)}, gen())
    assert out["image"].shape[0] == 0 and out["mask"].shape[0] == 0


@pytest.mark.parametrize("t", [*TRANSFORMS, Normalize()], ids=repr)
def test_fields_that_are_no_tensors_pass_through_every_transform(t):
    """NOTE [spatial fields]: fields other than the image, its masks and boxes pass through, tensors or not
    (a DataLoader's default_collate gives a list of file names, a dict of metadata)."""
    x = batch(b=2, h=6, w=6)
    meta = {"id": torch.arange(2)}
    out = t({"image": x, "mask": torch.ones(2, 6, 6, dtype=torch.uint8), "path": ["a.png", "b.png"], "meta": meta},
            gen())
    assert out["path"] == ["a.png", "b.png"] and out["meta"] is meta and out["image"].shape[0] == 2
    assert out["mask"].shape == (2, *out["image"].shape[-2:])
