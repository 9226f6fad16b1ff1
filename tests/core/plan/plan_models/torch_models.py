"""torch models for the planner's tests: an MLP, a CNN and a small Transformer, all nn.Sequential.

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
