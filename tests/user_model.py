"""A user's own model, outside models/, for tests of ``model.name: package.module:callable``."""

from torch import nn


def build_tiny(hidden: int = 8) -> nn.Module:
    """A one-hidden-layer classifier for 1x8x8 images and 10 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def not_a_module() -> str:
    """Returns something that is not an nn.Module."""
    return "nope"


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        raise RuntimeError("boom: this model always fails")


def build_broken() -> nn.Module:
    """A model whose forward pass raises, for tests of a failed training."""
    return _Broken()
