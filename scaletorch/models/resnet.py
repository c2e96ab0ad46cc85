"""A ResNet image classifier (He et al., 2015) for chapter 12; it knows nothing of parallelism.

    image (b, 3, H, W)
      stem     conv 3x3 (or 7x7 stride 2 + max-pool at full size), BatchNorm, ReLU
      layers   BasicBlocks, flat in one list: stage i has ``blocks[i]`` blocks of
               ``channels[i]`` channels; the first block of a stage after the first halves H, W
      head     global average pool -> (b, C_last) -> linear -> logits (b, num_classes)

A BasicBlock is conv 3x3 -> BN -> ReLU -> conv 3x3 -> BN, plus its input (through a 1x1 conv
and BN when the shape changes), then ReLU. No activation is in place: a hook or a saved
tensor never sees a value that was overwritten. The blocks sit in one ``nn.ModuleList`` named
``layers``, as a Llama's do, so sharding by block (ZeRO units, FSDP2) treats both alike.

``ResNetConfig()`` is ResNet-18's layout at 224 x 224; ``tiny_resnet_config()`` is the one the
tests and the CPU tour train. ``channels_last`` stores activations as (b, H, W, C) in memory,
the layout GPU convolution kernels prefer; the numbers are the same. Only the input is
converted: a convolution follows its input's layout, and the weights stay contiguous, which
FSDP2 (it refuses strided parameters) and ZeRO's flat units need.
"""

from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ResNetConfig:
    num_classes: int = 1000
    image_size: int = 224
    stem_channels: int = 64
    channels: List[int] = field(default_factory=lambda: [64, 128, 256, 512])
    blocks: List[int] = field(default_factory=lambda: [2, 2, 2, 2])  # ResNet-18
    imagenet_stem: bool = True  # 7x7 stride-2 conv and a max-pool (False: one 3x3 conv)
    channels_last: bool = False
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1

    def __post_init__(self) -> None:
        if len(self.channels) != len(self.blocks) or not self.channels:
            raise ValueError(f"channels {self.channels} and blocks {self.blocks} must be "
                             f"non-empty lists of one length (one entry per stage)")
        sizes = dict(num_classes=self.num_classes, image_size=self.image_size,
                     stem_channels=self.stem_channels)
        bad = {k: v for k, v in sizes.items() if v < 1}
        bad.update({f"channels[{i}]": c for i, c in enumerate(self.channels) if c < 1})
        bad.update({f"blocks[{i}]": n for i, n in enumerate(self.blocks) if n < 1})
        if bad:
            raise ValueError(f"ResNet sizes must be positive, got {bad}")


def tiny_resnet_config(num_classes: int = 4, image_size: int = 16) -> ResNetConfig:
    """Two stages of one block (8 and 16 channels), a 3x3 stem: 5,164 parameters, 6 BN layers."""
    return ResNetConfig(num_classes=num_classes, image_size=image_size, stem_channels=8,
                        channels=[8, 16], blocks=[1, 1], imagenet_stem=False)


def _bn(config: ResNetConfig, channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=config.bn_eps, momentum=config.bn_momentum)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual; (b, c_in, H, W) -> (b, c_out, H/stride, W/stride)."""

    def __init__(self, config: ResNetConfig, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _bn(config, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = _bn(config, c_out)
        self.shortcut = nn.Sequential()  # identity
        if stride != 1 or c_in != c_out:  # projection: the residual must match the shape
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          _bn(config, c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """images (b, 3, H, W) float -> logits (b, num_classes) float."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        c = config.stem_channels
        if config.imagenet_stem:
            self.stem = nn.Sequential(nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False),
                                      _bn(config, c), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), _bn(config, c),
                                      nn.ReLU())
        blocks: List[nn.Module] = []
        for stage, (width, count) in enumerate(zip(config.channels, config.blocks)):
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(config, c, width, stride))
                c = width
        self.layers = nn.ModuleList(blocks)
        self.fc = nn.Linear(c, config.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.config.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        x = self.stem(images)  # (b, C0, H', W')
        for block in self.layers:
            x = block(x)
        x = x.mean(dim=(2, 3))  # global average pool: (b, C_last)
        return self.fc(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_resnet(config: ResNetConfig, seed: int) -> ResNet:
    """The full model, weights a function of ``seed`` only (as ``build_model``); on CPU."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return ResNet(config)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch, in fp32. logits (b, K), labels (b,) int64."""
    return F.cross_entropy(logits.float(), labels)
