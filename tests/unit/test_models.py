"""The registry and every model: forward, backward, sizes of the flavors, FLOPs."""

from __future__ import annotations

import ast

import pytest
import torch
from conftest import GPT_DEBUG_ON_TOKENS, REPO, THREE_HEADS_CANNOT_BUILD

from models import DataInfo, build_model, flops_per_sample, get_spec, model_names
from models.registry import count_flops_per_sample

IMAGES = DataInfo(kind="image", input_shape=(1, 8, 8), num_classes=10)
TOKENS = DataInfo(kind="tokens", input_shape=(16,), num_classes=64)


def test_registry_lists_the_builtin_models():
    assert {"digits_cnn", "mlp", "gpt"} <= set(model_names())
    for name in model_names():
        spec = get_spec(name)
        assert "debug" in spec.flavors and spec.default_flavor in spec.flavors


@pytest.mark.parametrize("name", ["digits_cnn", "mlp", "gpt"])
def test_debug_flavor_forward_and_backward(name: str):
    info = TOKENS if name == "gpt" else IMAGES
    torch.manual_seed(0)
    model = build_model(name, "debug", {}, info)
    if info.kind == "tokens":
        x = torch.randint(0, info.num_classes, (3, *info.input_shape))
        expected = (3, info.input_shape[0], info.num_classes)
    else:
        x = torch.randn(3, *info.input_shape)
        expected = (3, info.num_classes)
    out = model(x)
    assert out.shape == expected
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("flavor, low, high", [("small", 9e6, 13e6), ("medium", 90e6, 115e6), ("1b", 0.95e9, 1.15e9)])
def test_gpt_flavor_sizes(flavor: str, low: float, high: float):
    with torch.device("meta"):
        model = build_model("gpt", flavor, {}, DataInfo("tokens", (256,), 256))
    n = sum(p.numel() for p in model.parameters())
    assert low <= n <= high, f"gpt {flavor}: {n:,} parameters"


def test_gpt_flops_formula_matches_torch_counter():
    model = build_model("gpt", "debug", {}, TOKENS)
    formula = flops_per_sample("gpt", model, TOKENS)
    counted = count_flops_per_sample(model, TOKENS)
    # torch's counter does not see the CPU attention kernel; the formula adds it (12 x L x d x T^2).
    t = TOKENS.input_shape[0]
    attention = 12 * model.n_layers * model.dim * t * t
    assert formula - attention == pytest.approx(counted, rel=1e-6)


def test_user_model_by_import_path():
    model = build_model("user_model:build_tiny", "", {"hidden": 4}, IMAGES)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        build_model("user_model:not_a_module", "", {}, IMAGES)


def test_models_import_nothing_from_torch_distributed():
    for path in REPO.joinpath("models").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("torch.distributed") for n in names), f"{path.name} imports {names}"


def test_a_registered_model_that_its_arguments_cannot_build_is_one_line_before_ray():
    """Built on the meta device in preflight: a relation between arguments that no range states."""
    from rayjobs import preflight
    from rayjobs.config import load_config
    from rayjobs.errors import ConfigError

    gpt = GPT_DEBUG_ON_TOKENS
    with pytest.raises(ConfigError) as err:
        preflight.check_model_builds(load_config(None, [*gpt, "model.kwargs.n_heads=3"]))
    assert str(err.value) == THREE_HEADS_CANNOT_BUILD
    with pytest.raises(ConfigError) as err:  # a CNN over rows of 5 features (image kind: any shape)
        preflight.check_model_builds(load_config(None, ["data.name=synthetic", "data.kwargs.shape=[5]"]))
    assert str(err.value) == (
        "model.name: digits_cnn (flavor default) cannot be built for inputs (5,) of data.name=synthetic: ValueError: "
        "digits_cnn takes images shaped (channels, height, width), at least 2x2; got (5,)"
    ), err.value
    preflight.check_model_builds(load_config(None, [*gpt, "model.kwargs.n_heads=2"]))
    preflight.check_model_builds(load_config(None, ["model.name=user_model:build_tiny", "model.flavor="]))
