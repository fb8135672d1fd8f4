"""A user's own model, outside models/, for tests of ``model.name: package.module:callable``."""

import torch
from torch import nn


def build_tiny(hidden: int = 8) -> nn.Module:
    """A one-hidden-layer classifier for 1x8x8 images and 10 classes."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


build_tinÿ = build_tiny  # a callable named in Unicode (run.name's default must still be ASCII)


def not_a_module() -> str:
    """Returns something that is not an nn.Module."""
    return "nope"


class _Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x):
        if self.training:  # evaluated, it answers: the check before Ray (eval mode, one sample) passes
            raise RuntimeError("boom: this model always fails")
        return self.linear(x.flatten(1))


def build_broken() -> nn.Module:
    """A model whose forward pass raises in training, for tests of a failed training."""
    return _Broken()


class Huber:
    """A user's regression task (outside rayjobs): Huber loss; mae and the share within 0.5."""

    name, targets = "huber", "real"
    metrics = ("loss", "mae", "within_half")
    metric, mode = "within_half", "max"

    def __init__(self, delta: float = 1.0) -> None:
        self.delta = delta

    def loss(self, output, target):
        import torch.nn.functional as F

        return F.huber_loss(output.reshape(target.shape), target, delta=self.delta)

    def sums(self, output, target) -> dict[str, float]:
        import torch.nn.functional as F

        pred = output.reshape(target.shape).float()
        err = (pred - target).abs()
        huber = F.huber_loss(pred, target, delta=self.delta, reduction="sum")
        return {"huber": huber.item(), "abs": err.sum().item(), "hits": (err < 0.5).sum().item(), "n": target.numel()}

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["n"], 1)
        return {"loss": sums["huber"] / n, "mae": sums["abs"] / n, "within_half": sums["hits"] / n}


def huber_task(delta: float = 1.0) -> Huber:
    """A user's task builder."""
    return Huber(delta)


class Half:
    """A task that forgot sums and finish."""

    name, targets, metrics, metric, mode = "half", "real", ("loss",), "loss", "min"

    def loss(self, output, target):
        return (output - target).pow(2).mean()


def half_task() -> Half:
    """A user's task builder whose task is incomplete."""
    return Half()


class _Rows(torch.utils.data.Dataset):
    """A plain map-style dataset (not a TensorDataset) of (features, target) rows."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def sine_data(rows: int = 512, noise: float = 0.05):
    """A user's regression data: y = sin(3 x0) + x1 / 2 + noise, as (train, val, test) datasets."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(rows, 2, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + x[:, 1] / 2 + noise * torch.randn(rows, generator=g)
    a, b = rows * 7 // 10, rows * 85 // 100
    return _Rows(x[:a], y[:a]), _Rows(x[a:b], y[a:b]), _Rows(x[b:], y[b:])


def two_things():
    """Not datasets."""
    return [1, 2]


def lion_like(groups, lr: float, weight_decay: float, beta: float = 0.9):
    """A user's optimizer factory (here torch's SGD with Nesterov momentum under another name)."""
    return torch.optim.SGD(groups, lr=lr, weight_decay=weight_decay, momentum=beta, nesterov=True)


def user_gpt(vocab_size: int = 32, seq_len: int = 16):
    """A user's transformer outside models/ (here rayjobs' own GPT class, built directly), which
    carries its parallel plan as data: the tensor-parallel plan and the pipeline split points."""
    from models.gpt import GPT

    return GPT(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=seq_len)


def _user_gpt_plan():
    from models import ParallelPlan

    return ParallelPlan(
        layers_attr="layers",
        tp_plan={
            "layers.*.attn.q_proj": "colwise",
            "layers.*.attn.k_proj": "colwise",
            "layers.*.attn.v_proj": "colwise",
            "layers.*.attn.o_proj": "rowwise",
            "layers.*.ffn.up_proj": "colwise",
            "layers.*.ffn.down_proj": "rowwise",
        },
        pipeline_first=("tok_embeddings", "pos_embeddings"),
        pipeline_last=("norm", "output"),
    )


user_gpt.parallel_plan = _user_gpt_plan()


class MetricObjectsRegression:
    """A user's regression task whose r2 and mae are torchmetrics objects (its sums give only the loss)."""

    name, targets = "tm_regression", "real"
    metrics = ("loss", "r2", "mae")
    metric, mode = "r2", "max"

    def loss(self, output, target):
        return (output.reshape(target.shape) - target).pow(2).mean()

    def sums(self, output, target) -> dict[str, float]:
        return {"sse": (output.reshape(target.shape) - target).pow(2).sum().item(), "n": target.numel()}

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        return {"loss": sums["sse"] / max(sums["n"], 1)}

    def metric_objects(self) -> dict:
        import torchmetrics

        return {"r2": torchmetrics.R2Score(), "mae": torchmetrics.MeanAbsoluteError()}

    def metric_inputs(self, output, target) -> tuple:
        return output.reshape(target.shape), target


def metric_objects_task() -> MetricObjectsRegression:
    """A user's task builder with torchmetrics metrics."""
    return MetricObjectsRegression()


class _NotAMetric:
    name, targets, metrics, metric, mode = "bad", "real", ("loss", "r2"), "r2", "max"
    loss, sums, finish = MetricObjectsRegression.loss, MetricObjectsRegression.sums, MetricObjectsRegression.finish

    def metric_objects(self) -> dict:
        return {"r2": "not a metric"}


def not_a_metric_task() -> _NotAMetric:
    """metric_objects() gives something that is not a torchmetrics.Metric."""
    return _NotAMetric()


def build_with_module(
    act: nn.Module | None = None,
    width: "UnresolvableName" = 4,  # noqa: F821
    depth: int = 1,
) -> nn.Module:
    """A builder whose hints are not plain data: its kwargs are passed as given."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10), act or nn.Identity())
