"""Small reference models with no torchvision dependency: for the demo, the benchmarks and tests.

``cnn-small`` (a 4-block conv net for small images), ``resnet18`` / ``resnet50`` (He et al.; conv -> BN
with no conv bias, zero-initialised last BN gamma per block), ``gpt-tiny`` (a causal transformer using
``scaled_dot_product_attention``, for token datasets).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError


def _conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """4 conv blocks (32-64-128-256 channels), each halving the resolution, global pool, linear."""

    min_input_size = 16  # four 2x2 max-pools: smaller inputs pool down to nothing

    def __init__(self, num_classes: int = 10, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for i in range(4):
            cout = width * 2 ** i
            layers += _conv_bn(cin, cout) + [nn.MaxPool2d(2)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        nn.init.zeros_(self.bn2.weight)  # each residual branch starts as identity (Goyal et al., 2017)
        self.down = _downsample(cin, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + (self.down(x) if self.down is not None else x), inplace=True)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)  # stride on the 3x3 (ResNet v1.5)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        nn.init.zeros_(self.bn3.weight)
        self.down = _downsample(cin, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        return F.relu(self.bn3(self.conv3(out)) + (self.down(x) if self.down is not None else x), inplace=True)


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, n in enumerate(layers):
            planes = 64 * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, planes, 2 if (j == 0 and i > 0) else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1), 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small pre-norm causal transformer; ``forward(tokens)`` -> logits ``(B, T, vocab)``."""

    def __init__(self, vocab_size: int, seq_len: int = 256, dim: int = 128, layers: int = 4, heads: int = 4,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embeddings
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ConfigError(f"sequence of {t} tokens is longer than the model's seq_len={self.seq_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn-small": lambda num_classes=10, **kw: SmallCNN(num_classes, **kw),
    "resnet18": lambda num_classes=1000, **kw: ResNet(BasicBlock, [2, 2, 2, 2], num_classes, **kw),
    "resnet50": lambda num_classes=1000, **kw: ResNet(Bottleneck, [3, 4, 6, 3], num_classes, **kw),
    "gpt-tiny": lambda vocab_size=257, **kw: GPT(vocab_size, **kw),
}


def image_models() -> list[str]:
    """The models that train on image batches, sorted: every model in `MODELS` but gpt-tiny (it reads tokens)."""
    return sorted(m for m in MODELS if m != "gpt-tiny")


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by name (see `MODELS`)."""
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


def is_convnet(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
