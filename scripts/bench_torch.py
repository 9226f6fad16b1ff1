"""The torch model the benchmark scripts share: ``blocks`` x (Linear(width, width), ReLU), seeded."""
import torch
from torch import nn


def linear_relu(width: int, blocks: int) -> nn.Sequential:
    """``blocks`` x (Linear(width, width), ReLU) after ``torch.manual_seed(0)``: the same weights in every process."""
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)
