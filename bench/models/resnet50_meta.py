"""ResNet-50 (He et al. 2016: bottleneck blocks [3, 4, 6, 3], widths 256-2048, 25.6M parameters)
for 224 x 224 ImageNet images, on the meta device: a CNN with skip connections at a real size, for
the plan-quality benchmark (bench/plan_quality.py). Written here, not taken from torchvision,
which partc does not depend on."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CLASSES = 1000
IMAGE = 224


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, depths: tuple[int, ...] = (3, 4, 6, 3), classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        c_in = 64
        for i, depth in enumerate(depths):
            width = 64 * 2 ** i
            for j in range(depth):
                layers.append(Bottleneck(c_in, width, stride=2 if (i > 0 and j == 0) else 1))
                c_in = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model() -> nn.Module:
    with torch.device("meta"):
        return ResNet50()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, IMAGE, IMAGE),)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
