"""The user's path without Ray: paths resolved once on the driver, shipped configs by name, a user's
model with one --set, optional packages checked before Ray, progress a person can read, and the
README's config table naming every field."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from rayjobs import paths, preflight
from rayjobs.config import CONFIG_DIR, describe_fields, load_config, shipped_configs
from rayjobs.errors import ConfigError


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The working directory is a fresh one outside the repo."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_path_is_made_absolute_against_the_drivers_directory(elsewhere):
    cfg = load_config(
        None,
        [
            "model.name=gpt",
            "model.flavor=debug",
            "data.name=text",
            "data.kwargs={path: data/d, val_path: ~/held, seq_len: 3}",
            "checkpoint.resume_from=results/x/ckpt",
            "tracking.uri=sqlite:///m.db",
        ],
    )
    assert paths.relative_paths(cfg)  # as loaded: relative, as the user wrote them
    notes = paths.resolve(cfg)
    assert notes == []
    assert cfg.run.storage_path == str(elsewhere / "results")
    assert cfg.run_dir == str(elsewhere / "results" / "gpt-text")  # another job than the file's: the derived name
    assert cfg.data.kwargs == {
        "path": str(elsewhere / "data/d"),
        "val_path": os.path.expanduser("~/held"),
        "seq_len": 3,
    }
    assert cfg.checkpoint.resume_from == str(elsewhere / "results/x/ckpt")
    assert cfg.tracking.uri == f"sqlite:///{elsewhere / 'm.db'}"
    assert paths.relative_paths(cfg) == []
    assert paths.resolve(cfg) == [] and cfg.run.storage_path == str(elsewhere / "results")  # idempotent


def test_a_worker_refuses_a_relative_path():
    cfg = load_config(None, [])
    with pytest.raises(paths.RelativePath, match=r"run.storage_path='results'"):
        paths.require_absolute(cfg)


def test_under_a_ray_job_a_relative_storage_path_goes_to_ray_results(elsewhere, monkeypatch):
    monkeypatch.setenv("HOME", str(elsewhere / "home"))
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")  # what Ray's job supervisor sets for the entrypoint
    cfg = load_config(None, ["data.kwargs={}"])
    notes = paths.resolve(cfg)
    target = elsewhere / "home" / "ray_results" / "results"
    assert cfg.run.storage_path == str(target)
    assert len(notes) == 1 and f"it goes to {target} on this node" in notes[0] and "working-dir copy" in notes[0]
    assert paths.summary_path("results/s.json")[0] == str(target / "s.json")
    absolute = load_config(None, [f"run.storage_path={elsewhere / 'abs'}"])
    assert paths.resolve(absolute) == [] and absolute.run.storage_path == str(elsewhere / "abs")


def test_shipped_configs_by_name_from_any_directory(elsewhere):
    for name in ("gpt-fsdp", "gpt-fsdp.yaml", "rayjobs/configs/gpt-fsdp.yaml"):
        assert load_config(name).parallel.strategy == "fsdp", name
    mine = elsewhere / "gpt-fsdp.yaml"  # a file that exists wins over the shipped one
    mine.write_text("run: {name: mine}\n")
    assert load_config("gpt-fsdp.yaml").run.name == "mine"
    with pytest.raises(ConfigError, match="no shipped config of that name; shipped: digits, gpt-fsdp-tp"):
        load_config("gpt-fsdb")
    assert set(shipped_configs()) == {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert all(shipped_configs().values())


def test_rayjobs_configs_lists_them_with_their_first_line():
    for args in (("configs",), ("train", "--list-configs")):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"^digits\s+The default job", proc.stdout, re.M), proc.stdout
        assert "RAY_IMPORTED=False" in proc.stdout


def test_a_users_model_takes_one_set_and_only_an_explicit_flavor_is_an_error():
    cfg = load_config(None, ["model.name=user_model:build_tiny"])  # digits.yaml says flavor: default
    assert (cfg.model.name, cfg.model.flavor, cfg.model.kwargs) == ("user_model:build_tiny", "", {})
    with pytest.raises(ConfigError, match="model.flavor: flavors apply to registry models only"):
        load_config(None, ["model.name=user_model:build_tiny", "model.flavor=default"])
    kept = load_config(None, ["model.name=user_model:build_tiny", "model.kwargs.hidden=4"])
    assert kept.model.kwargs == {"hidden": 4}
    from models import get_spec

    other = load_config("gpt-fsdp", ["model.name=mlp", "data.name=digits", "data.kwargs={}"])
    assert other.model.flavor == get_spec("mlp").default_flavor  # not gpt's 'small' from the file


def test_a_missing_optional_package_is_one_line_before_ray(monkeypatch):
    cfg = load_config(None, ["tune.search=optuna"])
    assert preflight.missing_packages(cfg) == []  # optuna is a declared dependency
    monkeypatch.setitem(preflight.OPTIONAL_PACKAGES, ("tune.search", "optuna"), ("no_such_pkg_rj", "no-such-pkg"))
    assert preflight.missing_packages(cfg) == [
        "tune.search: optuna needs the package 'no-such-pkg', which is not installed; pip install no-such-pkg"
    ]


def test_progress_shows_elapsed_and_eta():
    from rayjobs.telemetry import format_duration, progress_times

    assert [format_duration(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]
    assert progress_times(30.0, 10, 20) == "elapsed 30s eta 1m00s"


def test_the_tune_table_has_a_row_per_trial_with_its_parameters():
    from types import SimpleNamespace

    from rayjobs.tune_progress import format_table

    trials = [
        SimpleNamespace(trial_id="a_00000", status="RUNNING", config={"optim.lr": 0.00123456}),
        SimpleNamespace(trial_id="a_00001", status="PENDING", config={"optim.lr": 0.01}),
    ]
    last = {"a_00000": {"training_iteration": 3, "val/accuracy": 0.91234}}
    text = format_table(trials, last, ["optim.lr"], "val/accuracy", (0.91234, "a_00000"))
    lines = text.splitlines()
    assert lines[0] == "[tune] 1 pending, 1 running; best val/accuracy 0.9123 (trial a_00000)"
    assert lines[1].split() == ["trial", "optim.lr", "state", "iter", "val/accuracy"]
    assert lines[2].split() == ["a_00000", "0.001235", "RUNNING", "3", "0.9123"]
    assert lines[3].split() == ["a_00001", "0.01", "PENDING", "0", "-"]


def test_the_strategy_tag_names_the_strategy():
    from rayjobs.tracking import run_tags

    assert run_tags(load_config("gpt-fsdp"), 2, "cpu", 1)["strategy"] == "fsdp"
    assert run_tags(load_config(None), 1, "cpu", 1)["strategy"] == "single"


def test_the_readme_config_table_names_every_field():
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    missing = []
    for path, _, _ in describe_fields():
        section, name = path.split(".", 1)
        name = {"async_save": "async"}.get(name, name)  # the YAML key (alias)
        path = f"{section}.{name}"
        wildcard = next((r for r in rows if r.startswith(f"| `{section}.*`")), "")
        if f"`{path}`" not in readme and f"`{name}`" not in wildcard:
            missing.append(path)
    assert not missing, f"README's config table lacks {missing}"


def test_checkpoints_of_an_unknown_run_say_where_they_looked(tmp_path):
    proc = run_cli("checkpoints", "nosuchrun", "--storage-path", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"rayjobs: error: checkpoints: 'nosuchrun' is neither a run directory nor a run under --storage-path "
        f"{tmp_path}; give a run directory or a run name"
    )


def test_checkpoints_of_a_mistyped_run_name_the_runs_there(tmp_path):
    for run in ("diabetes-mlp", "digits-ddp"):
        (tmp_path / run / "checkpoint_00000018").mkdir(parents=True)
    (tmp_path / "mlartifacts").mkdir()  # no checkpoints: not a run
    proc = run_cli("checkpoints", "diabetes", "--storage-path", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("give a run directory or a run name; runs there: diabetes-mlp, digits-ddp")


def test_checkpoints_show_the_tasks_validation_metrics():
    """A regression's checkpoints listed val/acc as '-': the columns are the metrics the checkpoints saved."""
    from rayjobs.cli import _validation_columns

    regression = {"val/loss": 0.5, "val/mae": 0.6, "val/mse": 0.5, "val/r2": 0.28, "epoch": 2}
    assert _validation_columns([regression]) == ["val/loss", "val/mae", "val/mse", "val/r2"]
    assert _validation_columns([{"val/loss": 0.1, "val/accuracy": 0.9}, {}]) == ["val/loss", "val/accuracy"]
    assert _validation_columns([{}]) == ["val/loss"]


def test_a_max_steps_past_the_epochs_end_is_said_not_ignored(capsys):
    """`--set training.epochs=1 --set training.max_steps=1000` trained 19 steps and said nothing of the 1000."""

    def note(*overrides):
        cfg = load_config(None, list(overrides))
        preflight.note_max_steps_past_the_end(cfg, preflight.check_train_rows(cfg, None, 2))
        return capsys.readouterr().out.strip()

    assert note("training.epochs=1", "training.max_steps=1000") == (
        "rayjobs: training.max_steps=1000 is past the run's end: training.epochs=1 makes 19 steps, "
        "and the run stops there (raise training.epochs to train longer)"
    )
    assert note("training.epochs=1", "training.max_steps=19") == ""
    assert note("training.max_steps=10") == note() == ""


def test_doctor_checks_the_runs_workers_as_a_local_run_would_before_ray():
    """`rayjobs doctor` said "all checks passed" for 64 workers on 2 CPUs and for a layout the run refuses."""
    import os

    from rayjobs import doctor
    from rayjobs.config import load_config

    def check(*overrides):
        return doctor.scaling_check(load_config(None, list(overrides)), local=True)

    cpus = os.cpu_count() or 1
    fine = check("scaling.num_workers=1")
    assert (fine.status, fine.detail) == (doctor.OK, f"1 worker(s) x CPU 1 on a local Ray of {cpus} CPU(s)")
    crowded = check(f"scaling.num_workers={4 * cpus}")
    assert crowded.status == doctor.WARN
    assert crowded.detail.startswith(f"this run reserves {4 * cpus} CPUs and this machine has {cpus}: "), crowded
    refused = check("parallel.strategy=tp", "parallel.tp=3", "scaling.num_workers=2")
    assert (refused.status, refused.detail) == (
        doctor.FAIL,
        "parallel: pp x dp_replicate x dp_shard x tp = 3, but the world size is 2 (scaling.num_workers); make them "
        "multiply to 2",
    )
    assert check("scaling.num_workers=0").detail.startswith("local mode (scaling.num_workers=0)")


def test_doctor_prints_its_config(tmp_path):
    proc = run_cli("doctor", "--print-config", "--set", f"run.storage_path={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert f"storage_path: {tmp_path}" in proc.stdout and "RAY_IMPORTED=False" in proc.stdout


def test_the_readme_uses_paths_that_exist():
    """Files the README names for the user to open are in the repo."""
    readme = (REPO / "README.md").read_text()
    for name in ("rayjobs/configs/digits.yaml", "cluster/README.md", "benchmarks/gpu_check.sh"):
        if name in readme:
            assert Path(REPO, name).exists(), name


@pytest.mark.parametrize(
    "command, address, expected",
    [
        (
            ["train"],
            "127.0.0.1:1",
            "RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there (Connection refused); start it",
        ),
        (["tune", "--config", "tune-digits"], "127.0.0.1:1", "RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there"),
        (["doctor"], "127.0.0.1:1", "RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there"),
        (["train"], "http://127.0.0.1:8265", "RAY_ADDRESS=http://127.0.0.1:8265 is an HTTP address (the dashboard's"),
        (["train"], "headnode", "RAY_ADDRESS=headnode: expected HOST:PORT, e.g. 127.0.0.1:6379"),
    ],
)
def test_a_ray_address_where_no_cluster_answers_is_one_line_at_once(command, address, expected):
    """Ray retries a dead GCS address for minutes (a user's run hung with the cluster down) and
    raises a traceback for a dashboard URL: both are one line within seconds (the timeout fails it)."""
    proc = run_cli(*command, env={"RAY_ADDRESS": address}, timeout=30)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"rayjobs: error: {expected}"), lines


def test_a_batch_larger_than_an_in_memory_training_split_is_one_line_before_ray():
    """It failed in every worker after Ray started, with a worker's traceback."""
    proc = run_cli("train", "--set", "training.batch_size=4096", timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "rayjobs: error: training.batch_size: 4096 rows a step, but digits holds 1257 training row(s) for 2 "
        "worker(s), not one full batch; lower training.batch_size to at most 1256, or give more data"
    ), proc.stderr[-2000:]
    assert "RAY_IMPORTED=False" in proc.stdout
    # The largest batch it names fits; synthetic data is counted from its kwargs.
    preflight.check_train_rows(load_config(None, ["training.batch_size=1256"]), None, 2)
    synthetic = ["data.name=synthetic", "data.kwargs.num_samples=10", "training.batch_size=16", "model.name=mlp"]
    with pytest.raises(ConfigError, match=r"synthetic holds 10 training row\(s\) for 1 worker\(s\), .* at most 10,"):
        preflight.check_train_rows(load_config(None, synthetic), None, 1)


@pytest.mark.parametrize("command", [["train"], ["tune", "--config", "tune-digits"]])
def test_a_report_poll_interval_that_is_not_seconds_is_one_line_before_ray(command):
    """rayjobs sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S unless the user did; Ray's controller died on a
    bad value after Ray started, with its traceback."""
    proc = run_cli(*command, timeout=120, env={"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "abc"})
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "rayjobs: error: RAY_TRAIN_HEALTH_CHECK_INTERVAL_S='abc' is not a positive number of seconds; "
        "unset it (rayjobs polls every 0.25 s) or set e.g. 0.5"
    ), proc.stderr[-2000:]
    assert "RAY_IMPORTED=False" in proc.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train", "--summary", "/proc/rayjobs-summary.json"], "--summary: /proc is not writable ("),
        (["train", "--set", "run.storage_path=/proc/sys"], "run.storage_path: cannot create /proc/sys/digits-ddp: "),
        (["tune", "--config", "tune-digits", "--summary", "/proc/s.json"], "--summary: /proc is not writable ("),
        (["train", "--summary", "s" * 300 + ".json"], "--summary " + "s" * 300 + ".json: the file name is longer"),
        (["train", "--config", "c" * 300 + ".yaml"], "c" * 300 + ".yaml: File name too long; check the path"),
    ],
)
def test_a_place_that_cannot_be_written_is_one_line_before_ray(args, expected):
    """/proc refuses writes even to root, whom os.access lets through: the run trained, then its
    summary failed with a traceback."""
    proc = run_cli(*args, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"rayjobs: error: {expected}"), lines
    assert "RAY_IMPORTED=False" in proc.stdout
