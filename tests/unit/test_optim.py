"""Optimizers: weight decay on matrices only by default; torch.optim.<Name> and a user's factory."""

from __future__ import annotations

import pytest
import torch

from models import DataInfo, build_model
from rayjobs import stepping
from rayjobs.config import load_config
from rayjobs.errors import ConfigError

INFO = DataInfo(kind="tokens", input_shape=(16,), num_classes=32)


def _gpt():
    return build_model("gpt", "debug", {}, INFO)  # linears, embeddings, LayerNorms, biases


def test_norms_and_biases_get_no_weight_decay_unless_asked():
    model = _gpt()
    cfg = load_config(
        None, ["model.name=gpt", "data.name=synthetic", "data.kwargs.kind=tokens", "optim.weight_decay=0.1"]
    )
    opt = stepping.build_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.ndim >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and no_decay["no_decay"] and all(p.ndim == 1 for p in no_decay["params"])
    norms = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    assert norms and norms <= {id(p) for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    every = stepping.build_optimizer(
        model, cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"decay_norms_and_biases": True})})
    )
    assert len(every.param_groups) == 1 and every.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    "overrides, kind",
    [
        (["optim.name=torch.optim.RMSprop", "optim.kwargs={alpha: 0.95}"], torch.optim.RMSprop),
        (["optim.name=user_model:lion_like", "optim.kwargs={beta: 0.8}"], torch.optim.SGD),
        (["optim.name=sgd", "optim.momentum=0.5"], torch.optim.SGD),
    ],
)
def test_an_optimizer_by_torch_name_or_a_users_factory(overrides, kind):
    cfg = load_config(None, ["model.name=mlp", *overrides])
    opt = stepping.build_optimizer(build_model("mlp", "debug", {}, DataInfo("image", (1, 8, 8), 10)), cfg)
    assert type(opt) is kind and opt.param_groups[0]["lr"] == cfg.optim.lr
    if "alpha" in str(overrides):
        assert opt.param_groups[0]["alpha"] == 0.95
    if "beta" in str(overrides):
        assert opt.param_groups[0]["momentum"] == 0.8 and opt.param_groups[0]["nesterov"]


@pytest.mark.parametrize(
    "name, line",
    [
        ("torch.optim.Adamm", "optim.name: torch.optim has no optimizer 'Adamm', got 'torch.optim.Adamm'"),
        (
            "user_model:nope",
            "optim.name: cannot import it: AttributeError: module 'user_model' has no attribute 'nope', got 'user_model:nope'",
        ),
        ("rmsprop", "optim.name: must be adamw, sgd, torch.optim.<Name> or package.module:callable, got 'rmsprop'"),
    ],
)
def test_an_unknown_optimizer_is_one_line(name, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"optim.name={name}"])
    assert str(err.value).splitlines() == [line]


@pytest.mark.parametrize(
    "overrides, error",
    [
        (["optim.kwargs={betas: [0.9, 1.5]}"], "adamw cannot be built with them: ValueError: Invalid beta parameter"),
        (["optim.kwargs={nosuch: 1}"], "adamw cannot be built with them: TypeError: "),
        (
            ["optim.name=sgd", "optim.kwargs={nesterov: true, dampening: 0.5}"],
            "ValueError: Nesterov momentum requires a momentum",
        ),
        (["optim.name=torch.optim.RMSprop", "optim.kwargs={alpha: -1}"], "ValueError: Invalid alpha value: -1"),
        (["optim.kwargs={fused: true, foreach: true}"], "RuntimeError: `fused` and `foreach` cannot be `True`"),
        (["optim.name=user_model:lion_like", "optim.kwargs={beta: 0}"], "ValueError: Nesterov momentum requires"),
        (["optim.kwargs={betas: [0.8, 0.9]}"], None),
        (["optim.name=torch.optim.RMSprop", "optim.kwargs={alpha: 0.95}"], None),
        (["optim.name=user_model:lion_like", "optim.kwargs={beta: 0.8}"], None),
    ],
)
def test_the_optimizer_is_checked_on_its_arguments_before_ray(overrides, error):
    from rayjobs.preflight import check_optimizer

    cfg = load_config(None, overrides)
    if error is None:
        check_optimizer(cfg)
        return
    with pytest.raises(ConfigError) as err:
        check_optimizer(cfg)
    assert len(str(err.value).splitlines()) == 1 and error in str(err.value), err.value
    assert str(err.value).startswith("optim.kwargs: "), err.value


def test_checking_torchs_own_optimizer_does_not_import_dynamo():
    """A parameter makes torch import torch._dynamo (about 1 s) on the driver; torch's own optimizers
    are checked without one. A user's optimizer is built over a layer, and that import is paid."""
    import subprocess
    import sys

    from conftest import subprocess_env

    probe = (
        "import sys; from rayjobs.config import load_config; from rayjobs.preflight import check_optimizer; "
        "check_optimizer(load_config(None, sys.argv[1:])); print('torch._dynamo' in sys.modules)"
    )
    for overrides, imported in [
        ([], "False"),
        (["optim.name=sgd"], "False"),
        (["optim.name=user_model:lion_like"], "True"),
    ]:
        out = subprocess.run(
            [sys.executable, "-c", probe, *overrides], env=subprocess_env(), capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == imported, (overrides, out.stdout, out.stderr[-2000:])
