"""A torchvision-style ResNet-50 (Bottleneck blocks 3-4-6-3, in-place ReLU), random weights, no torchvision needed.

The same modules and forward as `torchvision.models.resnet50()`, so what autograd saves for it (and what
the cost model predicts) is what a practitioner's ResNet-50 saves. `width` scales every channel count
(1.0 is the real model) for cheap tests.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet50", "resnet50"]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision v1.5), 1x1 expand by 4, each with BatchNorm; a residual."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """Stem (7x7 conv, BatchNorm, ReLU, 3x3 max pool), four stages of Bottlenecks, average pool, classifier."""

    def __init__(self, *, width: float = 1.0, classes: int = 1000) -> None:
        super().__init__()
        base = max(1, round(64 * width))
        self.conv1 = nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, cin = [], base
        for i, blocks in enumerate((3, 4, 6, 3)):
            planes = base * 2**i
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, planes, stride=2 if b == 0 and i > 0 else 1))
                cin = planes * Bottleneck.expansion
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(*, width: float = 1.0, classes: int = 1000) -> ResNet50:
    """A ResNet-50 with random weights (`width` < 1 narrows every layer for tests)."""
    return ResNet50(width=width, classes=classes)
