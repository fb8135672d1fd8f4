"""A multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import math

from torch import Tensor, nn

from models.registry import DataInfo, ModelSpec, register


class MLP(nn.Module):
    """Flatten, then ``depth`` hidden layers of width ``hidden`` with GELU, then a linear head."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, depth: int, dropout: float) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def build(info: DataInfo, hidden: int = 256, depth: int = 2, dropout: float = 0.0) -> nn.Module:
    """Build an MLP for classification of ``info``-shaped inputs."""
    return MLP(math.prod(info.input_shape), info.num_classes, hidden, depth, dropout)


def _flops(model: nn.Module, info: DataInfo) -> float:
    params = sum(p.numel() for p in model.parameters())
    return 6.0 * params  # 2 FLOPs per weight forward, 4 backward


register(
    ModelSpec(
        name="mlp",
        builder=build,
        flavors={"debug": {"hidden": 16, "depth": 1}, "default": {"hidden": 256, "depth": 2}},
        data_kinds=("image",),
        description="multi-layer perceptron over flattened inputs",
        flops_per_sample=_flops,
        ranges={"hidden": (1, None), "depth": (0, None), "dropout": (0.0, 1.0)},
    )
)
