"""Config parsing, overrides, and every error form (one line naming the field)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TypedDict

import pytest
import yaml

from rayjobs.config import CONFIG_DIR, RunConfig, apply_override, from_dict, load_config, to_yaml
from rayjobs.errors import ConfigError

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def problems(*overrides: str, path: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    return info.value.problems


def test_defaults_and_run_name():
    cfg = from_dict({})
    assert cfg.model.name == "digits_cnn" and cfg.model.flavor == "default"
    assert cfg.run.name == "digits_cnn-digits"
    assert os.path.isabs(cfg.storage_path)
    # The default name comes from the model's callable or hf: folder, which may be named in any script;
    # Ray Train tags its metrics with it, in ASCII only.
    assert from_dict({"model": {"name": "user_model:build_tinÿ"}}).run.name == "build_tiny-digits"
    typed = from_dict({"data": {"name": "synthetic", "kwargs": {"num_samples": "100", "shape": ["1", 8, 8]}}})
    assert typed.data.kwargs == {"num_samples": 100, "shape": [1, 8, 8]}  # as the loader takes them
    model = from_dict({"model": {"name": "mlp", "kwargs": {"hidden": "64", "dropout": 0}}})
    assert model.model.kwargs == {"hidden": 64, "dropout": 0.0}  # as the builder takes them
    assert type(model.model.kwargs["dropout"]) is float
    gpt = from_dict({"model": {"name": "gpt"}, "data": {"name": "synthetic", "kwargs": {"kind": "tokens"}}})
    assert gpt.model.flavor == "small"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_validates_and_opens_with_its_command(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    first_lines = path.read_text().splitlines()[:6]
    assert any(("rayjobs train" in line or "rayjobs tune" in line) and line.startswith("#") for line in first_lines), (
        first_lines
    )


def header_commands(path: Path) -> list[list[str]]:
    """The `rayjobs train|tune` commands in a config's leading comment, continuation lines joined."""
    import shlex

    commands, pending = [], ""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = f"{pending} {line.lstrip('#').strip()}".strip()
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        if text.startswith(("rayjobs train", "rayjobs tune")):
            commands.append(shlex.split(text, comments=True))
    return commands


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_command_in_a_shipped_configs_header_is_a_valid_config(path: Path):
    """What a config's header tells the user to run loads: its own --config with every --set."""
    commands = header_commands(path)
    assert commands, path
    for argv in commands:
        config = argv[argv.index("--config") + 1]
        assert Path(config).stem == path.stem, argv
        load_config(config, [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])


def test_set_values_are_typed_by_the_schema():
    cfg = load_config(
        None,
        [
            "optim.lr=1e-3",
            "training.epochs=3",
            "scaling.use_gpu=false",
            "model.flavor=debug",
            "run.name=007",
            "model.kwargs.width=8",
        ],
    )
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.training.epochs == 3 and cfg.scaling.use_gpu is False
    assert cfg.run.name == "007" and cfg.model.kwargs == {"width": 8}


def test_exponents_without_a_dot_are_numbers_in_files_and_sets(tmp_path: Path):
    """YAML 1.1 reads ``1e-4`` as a string (it wants ``1.0e-4``): a search space of ``loguniform:
    [1e-4, 1e-2]`` was refused as "two numbers, got ['1e-4', '1e-2']", and a choice trained on strings."""
    space = "{optim.lr: {loguniform: [1e-4, 1e-2]}, optim.weight_decay: {choice: [0, 1E-5, 2.5e-3]}}"
    cfg = load_config("tune-digits", [f"tune.space={space}"])
    assert cfg.tune.space == {
        "optim.lr": {"loguniform": [1e-4, 1e-2]},
        "optim.weight_decay": {"choice": [0, 1e-5, 2.5e-3]},
    }
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 3e-4\nrun:\n  name: '1e3'\n")
    cfg = load_config(str(f))
    assert cfg.optim.lr == 3e-4 and cfg.run.name == "1e3"
    assert problems("tune.space={optim.lr: {choice: [1]}, optim.lr: {choice: [2]}}") == [
        "--set tune.space={optim.lr: {choice: [1]}, optim.lr: {choice: [2]}}: 'optim.lr' is given twice in one "
        "mapping (first at line 1); keep one"
    ]


def test_print_config_round_trips():
    cfg = load_config(None, ["optim.lr=0.01", "training.batch_size=32"])
    again = from_dict(yaml.safe_load(to_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optim.lr=-1"], "optim.lr: must be > 0, got -1"),
        (
            ["optim.name=adam"],
            "optim.name: must be adamw, sgd, torch.optim.<Name> or package.module:callable (did you mean 'adamw'?), got 'adam'",
        ),
        (["optim.lrr=1"], "optim.lrr: unknown key (did you mean 'lr'?)"),
        (["optimizer.lr=1"], "optimizer: unknown key (did you mean 'optim'?)"),
        # A key put in the wrong section is sent to its own (and a common other name to ours).
        (["data.batch_size=8"], "data.batch_size: unknown key (it is training.batch_size); allowed: name, kwargs"),
        (["epochs=3"], "epochs: unknown key (it is training.epochs); allowed: run, model,"),
        (["optim.learning_rate=0.1"], "optim.learning_rate: unknown key (it is optim.lr); allowed:"),
        (
            ["training.max_failures=1"],
            "training.max_failures: unknown key (it is failure.max_failures or tune.max_failures)",
        ),
        (["training.nosuch=1"], "training.nosuch: unknown key; allowed: epochs,"),
        (["training.epochs=abc"], "training.epochs: must be an integer, got 'abc'"),
        (["training.grad_accum=0"], "training.grad_accum: must be >= 1, got 0"),
        (["training.precision=fp8"], "training.precision: must be one of 'fp32', 'bf16', 'fp16', got 'fp8'"),
        (["scaling.num_workers=-2"], "scaling.num_workers: must be an integer >= 0 or 'auto', got -2"),
        (["scaling.use_gpu=maybe"], "scaling.use_gpu: must be true, false or 'auto', got 'maybe'"),
        (["model.name=gpy"], "model.name: unknown model 'gpy' (did you mean 'gpt'?)"),
        (["model.flavor=huge"], "model.flavor: digits_cnn has no flavor 'huge'"),
        (["model.kwargs.widht=3"], "model.kwargs.widht: digits_cnn takes no argument 'widht' (did you mean 'width'?)"),
        (["data.name=digit"], "data.name: unknown dataset 'digit' (did you mean 'digits'?)"),
        (
            ["data.name=synthetic", "data.kwargs.kind=tokens"],
            "model.name: digits_cnn needs image data, but data.name=synthetic gives tokens; images come from "
            "data.name=digits",
        ),
        # The mismatch names where the model's kind of data comes from.
        (["model.name=gpt"], "model.name: gpt needs tokens data, but data.name=digits gives image; tokens come from"),
        (["model.name=nosuchpkg.mod:build"], "model.name: cannot import 'nosuchpkg.mod:build'"),
        (["run.name=a/b"], "run.name: must be a plain name without '/'"),
        # An empty path was the working directory: the run's files landed among the user's own.
        (["run.storage_path="], "run.storage_path: empty; give a directory (the default is results) or an object"),
        # The bundled loaders' arguments are typed and bounded here: they failed inside the loader before.
        (["data.kwargs.split_seed=abc"], "data.kwargs.split_seed: must be an integer, got 'abc'"),
        (["data.kwargs.val_fraction=1.5"], "data.kwargs.val_fraction: must be >= 0 and < 1, got 1.5"),
        (["data.name=synthetic", "data.kwargs.num_classes=0"], "data.kwargs.num_classes: must be >= 1, got 0"),
        (["data.name=synthetic", "data.kwargs.shape=[-1, 3]"], "data.kwargs.shape: must be a list of positive"),
        # So are the registered models' arguments: they failed in the model's constructor, in every worker
        # (width=abc as "not all arguments converted during string formatting").
        (["model.kwargs.width=abc"], "model.kwargs.width: must be an integer, got 'abc'"),
        (["model.kwargs.width=0"], "model.kwargs.width: must be >= 1, got 0"),
        (["model.kwargs.dropout=1.5"], "model.kwargs.dropout: must be >= 0 and < 1, got 1.5"),
        (["model.name=mlp", "model.kwargs.hidden=2.5"], "model.kwargs.hidden: must be an integer, got 2.5"),
        (
            ["model.name=gpt", "data.name=synthetic", "data.kwargs.kind=tokens", "model.kwargs.dim=-4"],
            "model.kwargs.dim: must be >= 1, got -4",
        ),
        (
            ["model.name=gpt", "data.name=synthetic", "data.kwargs.kind=tokens", "model.kwargs.vocab_size=x"],
            "model.kwargs.vocab_size: must be an integer or null, got 'x'",
        ),
        (
            ["model.name=user_model:build_tiny", "model.flavor=", "model.kwargs.hidden=12a"],
            "model.kwargs.hidden: must be an integer, got '12a'",
        ),
        # Ray Train tags its metrics with the run's name, in ASCII only: a traceback in the controller before.
        (["run.name=versuch-ü"], "run.name: must be ASCII letters, digits and punctuation"),
        (["tune.name=suche-ü"], "tune.name: must be ASCII letters, digits and punctuation"),
        # A number is finite and never a YAML true/false: `lr: inf` trained to NaN, `epochs: true` ran 1 epoch,
        # and `val_fraction: nan` passed every bound (each comparison with NaN is false) to fail in the workers.
        (["optim.lr=inf"], "optim.lr: must be a finite number, got 'inf'"),
        (["optim.weight_decay=-inf"], "optim.weight_decay: must be a finite number, got '-inf'"),
        (["scaling.resources_per_worker={CPU: .nan}"], "scaling.resources_per_worker.CPU: must be a finite number"),
        (["training.epochs=true"], "training.epochs: must be an integer, got True"),
        (["tune.time_budget_s=false"], "tune.time_budget_s: must be a number, got False"),
        (["data.kwargs.val_fraction=nan"], "data.kwargs.val_fraction: must be a number, got 'nan'"),
        (["data.kwargs.split_seed=true"], "data.kwargs.split_seed: must be an integer, got True"),
        (["model.kwargs.width=true"], "model.kwargs.width: must be an integer, got True"),
        (["model.kwargs.dropout=.nan"], "model.kwargs.dropout: must be a number, got nan"),
        (["optim"], "--set optim: expected key=value"),
        (["optim.lr.x=1"], "--set optim.lr.x=1: optim.lr is not a section"),
    ],
)
def test_each_error_names_the_field(overrides, expected):
    lines = problems(*overrides)
    assert any(line.startswith(expected) for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_several_problems_are_all_reported():
    lines = problems("optim.lr=0", "training.epochs=0", "model.name=gpy", "data.name=x")
    assert {line.split(":")[0] for line in lines} == {"optim.lr", "training.epochs", "model.name", "data.name"}


def test_file_errors(tmp_path: Path):
    assert problems(path=str(tmp_path / "missing.yaml"))[0].startswith("--config: no file ")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: [1, 2\n")
    assert "invalid YAML" in problems(path=str(bad))[0] and "line" in problems(path=str(bad))[0]
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    assert "must be a mapping" in problems(path=str(scalar))[0]
    binary = tmp_path / "weights.pt"  # a traceback (UnicodeDecodeError) before
    binary.write_bytes(bytes(range(256)))
    assert problems(path=str(binary)) == [f"--config: cannot read {binary} as a YAML config: not UTF-8 text"]
    assert problems(path=str(tmp_path))[0].startswith(f"--config: {tmp_path} is a directory; ")
    # A key given twice: PyYAML kept the last one without a word (a `name: gpt` above was dropped).
    twice = tmp_path / "twice.yaml"
    twice.write_text("model:\n  name: gpt\n  flavor: debug\n  name: mlp\n")
    assert problems(path=str(twice)) == [
        f"config: invalid YAML in {twice} at line 4, column 3: 'name' is given twice in one mapping "
        "(first at line 2); keep one"
    ]


def test_a_users_builder_whose_hints_are_not_plain_data_gets_its_kwargs_as_given():
    cfg = load_config(None, ["model.name=user_model:build_with_module", "model.flavor=", "model.kwargs.width=x"])
    assert cfg.model.kwargs == {"width": "x"}  # its hint names what its module cannot resolve
    cfg = load_config(None, ["model.name=user_model:build_with_module", "model.flavor=", "model.kwargs.depth=3"])
    assert cfg.model.kwargs == {"depth": 3}  # the other hints still apply
    from torch import nn

    from rayjobs.typed_kwargs import typed_kwargs

    class Net(nn.Module):
        def __init__(self, act: nn.Module | None = None, hidden: int = 4) -> None: ...

    assert typed_kwargs(Net, {"act": "relu", "hidden": "8"}, {}) == ({"act": "relu", "hidden": 8}, [])


@dataclasses.dataclass
class _Block:
    width: int = 4


class _Shape(TypedDict):
    rows: int


def _build_from_structures(block: _Block, shape: _Shape, scale: float = 1.0) -> None:
    """A user's builder whose arguments are a dataclass and a TypedDict."""


def test_a_users_builder_with_a_dataclass_hint_gets_it_built_from_the_mapping():
    """pydantic refuses a config beside a dataclass or TypedDict hint (ours refuses inf and NaN): such a
    hint keeps its own, and the mapping from the YAML is typed into it as before. A `typing.TypedDict`
    (pydantic wants typing_extensions' before Python 3.12) is passed as given: it was a traceback."""
    from rayjobs.typed_kwargs import typed_kwargs

    given = {"block": {"width": "8"}, "shape": {"rows": 2}, "scale": "0.5"}
    clean, wrong = typed_kwargs(_build_from_structures, given, {})
    assert (clean, wrong) == ({"block": _Block(width=8), "shape": {"rows": 2}, "scale": 0.5}, [])
    assert typed_kwargs(_build_from_structures, {"scale": "inf"}, {})[1] == [("scale", "must be a number, got 'inf'")]


def test_user_model_by_import_path():
    cfg = load_config(None, ["model.name=user_model:build_tiny", "model.flavor=", "model.kwargs.hidden=4"])
    assert cfg.model.name == "user_model:build_tiny"
    lines = problems("model.name=user_model:build_tiny", "model.flavor=", "model.kwargs.depth=2")
    assert lines[0].startswith("model.kwargs.depth: user_model:build_tiny takes no argument 'depth'")


def test_apply_override_creates_nested_dicts():
    raw: dict = {}
    apply_override(raw, "data.kwargs.shape=[1, 4, 4]")
    assert raw == {"data": {"kwargs": {"shape": [1, 4, 4]}}}


def test_config_changes_name_each_trained_under_field_that_differs():
    from rayjobs.preflight import config_changes

    saved = load_config(None, []).model_dump(mode="json")
    current = load_config(
        None, ["optim.lr=0.01", "model.kwargs.width=8", "run.name=other", "tracking.enabled=false"]
    ).model_dump(mode="json")
    assert config_changes(saved, current) == ["model.kwargs.width (unset) -> 8", "optim.lr 0.003 -> 0.01"]
    assert config_changes(saved, saved) == [] and config_changes({}, current) == []
