"""A small CNN for 8x8 single-channel digit images (scikit-learn's digits)."""

from __future__ import annotations

from torch import Tensor, nn

from models.registry import DataInfo, ModelSpec, register


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks, a pooling step and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.LazyLinear(4 * width),
            nn.ReLU(),
            nn.Linear(4 * width, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build(info: DataInfo, width: int = 32, dropout: float = 0.1) -> nn.Module:
    """Build a DigitsCNN sized for ``info`` (channels-first images)."""
    import torch

    model = DigitsCNN(info.input_shape[0], info.num_classes, width, dropout)
    with torch.no_grad():  # materialize the lazy layer so parameter counts and DDP see it
        model.eval()
        model(torch.zeros(1, *info.input_shape))
        model.train()
    return model


register(
    ModelSpec(
        name="digits_cnn",
        builder=build,
        flavors={"debug": {"width": 4}, "default": {"width": 32}},
        data_kinds=("image",),
        description="small CNN for 8x8 digit images",
        ranges={"width": (1, None), "dropout": (0.0, 1.0)},
    )
)
