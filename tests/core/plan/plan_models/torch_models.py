"""torch models for the planner's tests: an MLP, a CNN and a small Transformer (nn.Sequential), and two graphs:
a small ResNet and a Transformer encoder with a padding mask.

Widths are keyword arguments so the memory tests can make them large enough to measure.
"""
import torch
from torch import nn


class MeanPool(nn.Module):
    """Average over the sequence axis: (batch, tokens, width) -> (batch, width)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def mlp(width: int = 512, depth: int = 4, features: int = 256, classes: int = 10) -> nn.Sequential:
    layers = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def cnn(channels: int = 128, blocks: int = 4, classes: int = 10) -> nn.Sequential:
    """For 3 x 32 x 32 images: a strided stem, then equal conv blocks, so parameters spread over the layers."""
    layers = [nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
    for block in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
        if block % 2:
            layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes))


def transformer(vocab: int = 1000, width: int = 128, heads: int = 4, blocks: int = 2, classes: int = 10) -> nn.Sequential:
    """For int64 token ids of shape (tokens,)."""
    encoder = [nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True)
               for _ in range(blocks)]
    return nn.Sequential(nn.Embedding(vocab, width), *encoder, MeanPool(), nn.Linear(width, classes))


def mlp_big() -> nn.Sequential:
    return mlp(width=2048, depth=4, features=1024)


def cnn_big() -> nn.Sequential:
    return cnn(channels=64)


def transformer_big() -> nn.Sequential:
    return transformer(vocab=8000, width=256, heads=8, blocks=4)


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions and a skip connection (a 1x1 convolution when the shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.shortcut = nn.Identity()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet (torchvision's layout: stem, layer1..layer4 of basic blocks, pooling, fc) for 3 x H x W images."""

    def __init__(self, widths=(32, 64, 128, 256), blocks=(2, 2, 2, 2), classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        channels, stages = widths[0], []
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            stride = 1 if stage == 0 else 2
            stages.append(nn.Sequential(*[BasicBlock(channels if b == 0 else width, width, stride if b == 0 else 1)
                                          for b in range(count)]))
            channels = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class MaskedEncoder(nn.Module):
    """A Transformer encoder over int64 token ids with a padding mask (id 0 is padding), read by every block.

    The mask and the position embedding live in ``forward``, outside any block: values between nodes.
    """

    def __init__(self, vocab: int = 1000, tokens: int = 64, width: int = 128, heads: int = 4, blocks: int = 2,
                 classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(tokens, width))
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True)
                                     for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padding = tokens == 0
        x = self.embed(tokens) + self.position
        for block in self.blocks:
            x = block(x, src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1).clamp(min=1.0))


def resnet() -> ResNet:
    return ResNet()


def resnet_big() -> ResNet:
    """For 3 x 32 x 32 images: activations of a few hundred MiB at batch 32, measurable on this CPU."""
    return ResNet(widths=(32, 64, 128, 256), blocks=(2, 2, 2, 2))


def masked_encoder() -> MaskedEncoder:
    return MaskedEncoder()


def masked_encoder_big() -> MaskedEncoder:
    return MaskedEncoder(vocab=8000, tokens=128, width=256, heads=8, blocks=6)
