"""The models the workloads train or run, defined here so benchmarks do not depend on tests/."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    """Linear layers of the given widths with a ReLU between consecutive ones."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Two Conv+BatchNorm+ReLU stages, pooling, Dropout, a Linear classifier; 3x32x32 inputs."""

    def __init__(self, classes: int = 10):
        super().__init__()
        # no conv bias before BatchNorm: its gradient is float noise around 0, which Adam's
        # normalisation turns into lr-sized updates that differ between any two summation orders
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(self.drop(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, softmax self-attention, LayerNorm, GELU MLP; mean-pooled head."""

    def __init__(self, width: int = 64, heads: int = 4, classes: int = 10):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(batch, tokens, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.proj(attended)
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x.mean(dim=1))


class ElementwiseChain(nn.Module):
    """The elementwise_chain workload as a module, so torch.jit.trace and freeze can take it."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return elementwise_chain(x, y)


def elementwise_chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x * y + 1).sigmoid() * x - y).tanh() * 0.5 + x
