"""A small CNN for 8x8 single-channel digit images (scikit-learn's digits)."""

from __future__ import annotations

from torch import Tensor, nn

from models.registry import DataInfo, ModelSpec, register


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks, a pooling step and a linear classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int, dropout: float, height: int, wide: int) -> None:
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
        classifier = nn.Linear(4 * width, num_classes)
        # made after the classifier, as the lazy layer it replaced was, so that a seed gives the same weights
        hidden = nn.Linear(2 * width * (height // 2) * (wide // 2), 4 * width)
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), hidden, nn.ReLU(), classifier)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build(info: DataInfo, width: int = 32, dropout: float = 0.1) -> nn.Module:
    """Build a DigitsCNN sized for ``info`` (channels-first images of at least 2x2)."""
    shape = tuple(info.input_shape)
    if len(shape) != 3 or min(shape[1:]) < 2:
        raise ValueError(f"digits_cnn takes images shaped (channels, height, width), at least 2x2; got {shape}")
    channels, height, wide = shape
    return DigitsCNN(channels, info.num_classes, width, dropout, height, wide)


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
