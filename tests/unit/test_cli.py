"""The command line: bad input exits 2 fast with one line per problem, no traceback, no Ray."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
import yaml
from conftest import REPO, run_cli, subprocess_env


def _ray_processes() -> set[int]:
    names = {"raylet", "gcs_server"}
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in names}


def test_bad_lr_exits_2_within_5s_naming_the_field_without_ray():
    before = _ray_processes()
    started = time.monotonic()
    proc = run_cli("train", "--set", "optim.lr=-1")
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert elapsed < 5, f"took {elapsed:.1f}s"
    lines = proc.stderr.strip().splitlines()
    assert lines == ["rayjobs: error: optim.lr: must be > 0, got -1"]
    assert "RAY_IMPORTED=False" in proc.stdout
    assert _ray_processes() <= before


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config", "no/such.yaml"], "--config: no file no/such.yaml and no shipped config"),
        (["--set", "model.name=resnet"], "model.name: unknown model 'resnet'"),
        (["--set", "data.name=imagenet"], "data.name: unknown dataset 'imagenet'"),
        (["--set", "model.name=os:getcwd"], "model.name: os:getcwd returned str, not a torch.nn.Module"),
        (
            ["--set", "training.batch_size=63"],
            "training.batch_size: must be a multiple of workers (2) x grad_accum (1) = 2, got 63",
        ),
        (
            ["--set", "training.precision=fp16", "--set", "scaling.use_gpu=false"],
            "training.precision: fp16 needs a GPU",
        ),
        (["--set", "scaling.use_gpu=true"], "scaling.use_gpu: true, but this machine has no GPU"),
        (  # every worker failed at its start before
            ["--set", "optim.kwargs={betas: [0.9, 1.5]}"],
            "optim.kwargs: adamw cannot be built with them: ValueError: Invalid beta parameter at index 1: 1.5",
        ),
        (  # every worker failed at its start before, with the model's own error after a traceback
            ["--config", "gpt-synthetic", "--set", "model.flavor=debug", "--set", "model.kwargs.n_heads=3"],
            "model.kwargs: gpt (flavor debug, {'n_heads': 3}) cannot be built for inputs (128,) of "
            "data.name=synthetic: ValueError: dim (32) must be divisible by n_heads (3)",
        ),
        (  # every worker failed after training before (KeyError: 'count')
            ["--set", "data.kwargs.val_fraction=0"],
            "data.kwargs.val_fraction: the validation split of digits is empty",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    if "use_gpu=true" in " ".join(args) or "batch_size=63" in " ".join(args):
        import torch

        if torch.cuda.is_available():
            pytest.skip("the message differs on a GPU machine")
    proc = run_cli("train", *args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert "RAY_IMPORTED=False" in proc.stdout


def test_train_on_a_search_config_says_the_search_is_for_tune():
    """`rayjobs train --config tune-digits` trains the config once; it said nothing of the search it left."""
    proc = run_cli("train", "--config", "tune-digits", "--set", "training.precision=fp16")
    assert proc.stdout.splitlines()[0] == (
        "rayjobs: train runs this config once, as it stands; its search over optim.lr, model.kwargs.width, "
        "optim.weight_decay runs with `rayjobs tune --config tune-digits`"
    ), proc.stdout
    assert proc.returncode == 2 and proc.stderr.strip().startswith("rayjobs: error: training.precision: fp16")
    plain = run_cli("train", "--set", "training.precision=fp16")
    assert "search" not in plain.stdout and plain.returncode == 2


def test_train_with_tunes_resume_flag_says_how_a_run_resumes():
    """`rayjobs train --resume` read as an abbreviation of --resume-from: "expected one argument"."""
    proc = run_cli("train", "--resume")
    assert proc.returncode == 2 and "RAY_IMPORTED=False" in proc.stdout
    assert proc.stderr.strip() == (
        "rayjobs: error: train: --resume is tune's; a run resumes by itself: the same command (the same "
        "run.name) goes on from its newest checkpoint, and --resume-from CHECKPOINT starts from another run's"
    )


def test_resuming_a_search_that_never_started_says_how_to_start_it(tmp_path):
    proc = run_cli("tune", "--config", "tune-digits", "--resume", "--set", f"run.storage_path={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"rayjobs: error: --resume: no search to resume at {tmp_path}/tune-digits; "
        "the same command without --resume starts it"
    )
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize("command", [["train"], ["tune", "--config", "tune-digits"]])
def test_a_storage_path_that_cannot_be_created_is_one_line_before_ray(command, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for storage, reason in ((a_file, "Not a directory"), ("/proc/no-such-dir", "No such file or directory")):
        proc = run_cli(*command, "--set", f"run.storage_path={storage}")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"rayjobs: error: run.storage_path: cannot create {storage}/"), (
            lines
        )
        assert reason in lines[0] and "RAY_IMPORTED=False" in proc.stdout
    assert a_file.read_text() == "not a directory"


def test_version_names_rayjobs_and_the_stack_it_runs_on():
    """`rayjobs --version`: one line for a bug report, read from the installed packages without importing Ray."""
    import importlib.metadata as metadata

    import rayjobs

    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[0]
    assert line == (
        f"rayjobs {rayjobs.__version__} (ray {metadata.version('ray')}, torch {metadata.version('torch')}, "
        f"mlflow {metadata.version('mlflow')}, python {sys.version.split()[0]})"
    )
    assert metadata.version("rayjobs") == rayjobs.__version__  # pyproject.toml and the package agree
    assert "RAY_IMPORTED=False" in proc.stdout


def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  epochs: 3\n   batch_size: 2\n")
    proc = run_cli("train", "--config", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"config: invalid YAML in {bad} at line 3" in proc.stderr


def test_print_config_prints_the_resolved_yaml():
    proc = run_cli("train", "--print-config", "--set", "optim.lr=0.02")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout.split("TORCH_IMPORTED=")[0])  # the probe's lines follow the YAML
    assert printed["optim"]["lr"] == 0.02 and printed["run"]["storage_path"] == "results"


def test_python_dash_m_rayjobs_train_is_the_same_entry():
    proc = subprocess.run(
        [sys.executable, "-m", "rayjobs.train", "--set", "optim.lrr=1"],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "rayjobs: error: optim.lrr: unknown key (did you mean 'lr'?); "
        "allowed: name, kwargs, decay_norms_and_biases, lr, weight_decay, momentum, schedule, warmup_steps, grad_clip"
    )


@pytest.mark.slow
def test_a_failed_training_exits_1_with_the_error(tmp_path):
    proc = run_cli(
        "train",
        "--set",
        "scaling.num_workers=0",
        "--set",
        "model.name=user_model:build_broken",
        "--set",
        "model.flavor=",
        "--set",
        f"run.storage_path={tmp_path}",
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "rayjobs: training failed: RuntimeError: boom: this model always fails"
    assert 'user_model.py", line' in proc.stderr  # the model's own traceback, to debug it


GPT_DEBUG = ["--set", "model.name=gpt", "--set", "model.flavor=debug", "--set", "data.name=synthetic"]
GPT_DEBUG += ["--set", "data.kwargs={kind: tokens, seq_len: 16}", "--set", "scaling.use_gpu=false"]


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["parallel.strategy=tp", "parallel.tp=3", "scaling.num_workers=3", "training.batch_size=63"],
            "parallel.tp=3 must divide the model's 4 attention heads",
        ),
        (
            ["parallel.strategy=fsdp+tp", "parallel.tp=2", "parallel.dp_shard=2", "scaling.num_workers=2"],
            "parallel: pp x dp_replicate x dp_shard x tp = 4, but the world size is 2 (scaling.num_workers); "
            "make them multiply to 2",
        ),
        (
            ["parallel.strategy=pp", "parallel.pp=3", "scaling.num_workers=3", "training.batch_size=60"],
            "parallel.pp=3 stages, but gpt/debug has 2 layers; use at most 2",
        ),
        (
            ["parallel.strategy=dataparallel", "scaling.num_workers=2"],
            "parallel.strategy=dataparallel: one worker drives all GPUs of its node, but the run has 2 workers; "
            "set scaling.num_workers=1, or use strategy ddp",
        ),
        (["parallel.strategy=ddp", "parallel.tp=2"], "parallel.tp=2 does not apply to strategy ddp; use tp or fsdp+tp"),
        (
            ["scaling.accelerator_type=H100"],
            "scaling.accelerator_type=H100 pins GPU workers, but this run uses no GPU; set scaling.use_gpu=true, "
            "or leave accelerator_type empty",
        ),
        (
            ["scaling.num_workers=[1, 3]", "failure.max_failures=2", "training.batch_size=64"],
            "training.batch_size: an elastic run keeps the global batch at every size from 1 to 3 workers, "
            "but 64 does not divide over 3 x grad_accum 1; pick a multiple of each",
        ),
        (
            ["scaling.num_workers=[1, 2]", "training.batch_size=64"],
            "failure.max_failures: an elastic run restarts its worker group when a node leaves; set it above 0 (or -1)",
        ),
        (
            ["scaling.num_workers=[2, 1]"],
            "scaling.num_workers: elastic workers are [min, max] with 1 <= min < max, got [2, 1]",
        ),
        (  # Ray waited for a resource named 'cpu' for ever (its autoscaler said so every 30 s)
            ["scaling.resources_per_worker={cpu: 1}"],
            "scaling.resources_per_worker.cpu: Ray's resource is 'CPU'; write CPU",
        ),
        (
            ["run.storage_path=s3://AKIAEXAMPLE:hunter2@bucket/runs"],
            "run.storage_path: must not carry credentials (user:secret@): set them in the environment "
            "(AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, ...) so they are never logged, got 's3://***@bucket/runs'",
        ),
    ],
)
def test_bad_parallel_config_is_one_line_before_ray(args, line):
    proc = run_cli("train", *GPT_DEBUG, *[a for s in args for a in ("--set", s)])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"rayjobs: error: {line}"]
    assert "RAY_IMPORTED=False" in proc.stdout


def test_resources_ray_would_wait_on_for_ever_are_named_before_ray():
    from rayjobs.launch import resource_problems
    from rayjobs.plan import ScalingPlan

    def problems(workers: int, use_gpu: bool, resources: dict, gpus: int = 0, local: bool = True) -> list[str]:
        return resource_problems(ScalingPlan(workers, use_gpu, resources), gpus, local)

    assert problems(2, False, {"CPU": 1.0}) == []
    assert problems(2, True, {"CPU": 1.0}, gpus=2) == []  # GPU: 1 per worker is implied
    assert problems(1, False, {"Memory": 1e9}) == [
        "scaling.resources_per_worker.Memory: Ray's resource is 'memory'; write memory"
    ]
    assert "a local Ray has no resource 'TPU'" in problems(1, False, {"TPU": 1})[0]
    assert problems(1, False, {"TPU": 1}, local=False) == []  # a cluster's nodes may declare it
    assert problems(1, False, {"GPU": 1})[0].endswith("this run uses no GPU; set scaling.use_gpu=true, or remove GPU")
    assert "0 with GPU workers" in problems(1, True, {"GPU": 0}, gpus=1)[0]
    assert problems(2, True, {"GPU": 1}, gpus=1) == [
        "scaling.resources_per_worker.GPU: 2 worker(s) x 1 GPU need 2 GPU(s), and this machine has 1; "
        "lower scaling.num_workers or the GPUs per worker"
    ]
    assert problems(2, True, {"GPU": 1}, gpus=1, local=False) == []  # an autoscaler may add GPU nodes


def test_a_local_run_that_reserves_over_twice_the_cpus_is_warned():
    from rayjobs.launch import oversubscription

    assert oversubscription(4, 2) == "" and oversubscription(3, 2) == ""  # 2 workers + Ray Data's CPU: usual
    assert oversubscription(64, 2) == (
        "this run reserves 64 CPUs and this machine has 2: its workers share them (about 0.031 CPU each) and "
        "start slowly; lower scaling.num_workers, or run on a cluster (RAY_ADDRESS)"
    )


def _parquet_splits(root, val_columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, cols in (("train", {"x": [0.5, 1.5], "label": [0, 1]}), ("val", val_columns)):
        (root / split).mkdir(parents=True)
        pq.write_table(pa.table(cols), root / split / "part-0.parquet")


def test_bad_data_is_one_line_before_ray(tmp_path):
    _parquet_splits(tmp_path / "ds", {"x": [0.5], "digit": [1]})
    base = ["--set", "data.name=parquet", "--set", "model.name=mlp", "--set", "model.flavor=debug"]
    cases = [
        (
            ["--set", f"data.kwargs.path={tmp_path / 'none'}"],
            f"data.kwargs.path: no such file or directory: {tmp_path / 'none'}",
        ),
        (
            ["--set", f"data.kwargs={{path: {tmp_path / 'ds'}, features: [x, y], label: label, num_classes: 2}}"],
            f"data.kwargs: column 'y' is not in {tmp_path / 'ds' / 'train' / 'part-0.parquet'} (columns: x, label); "
            "set data.kwargs.features / data.kwargs.label to columns it has",
        ),
        (  # one file and no val_path: there is no train/ folder to put a val/ beside
            [
                "--set",
                f"data.kwargs={{path: {tmp_path / 'ds' / 'train' / 'part-0.parquet'}, label: label, num_classes: 2}}",
            ],
            f"data.kwargs.val_path: parquet data at {tmp_path / 'ds' / 'train' / 'part-0.parquet'} has no validation "
            "split; give val_path, a file or folder of validation rows",
        ),
        (  # the val split's schema does not match train's
            ["--set", f"data.kwargs={{path: {tmp_path / 'ds'}, label: label, num_classes: 2}}"],
            f"data.kwargs: column 'label' is not in {tmp_path / 'ds' / 'val' / 'part-0.parquet'} (columns: x, digit); "
            "set data.kwargs.features / data.kwargs.label to columns it has",
        ),
    ]
    for args, line in cases:
        proc = run_cli("train", *base, *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [f"rayjobs: error: {line}"]
        assert "RAY_IMPORTED=False" in proc.stdout


def test_a_users_model_that_cannot_build_or_take_its_data_is_one_line_before_ray():
    """A user's model that fails on the meta device is tried on the CPU with one sample: bad arguments
    or inputs of the wrong shape were a traceback from every worker, now one line before Ray."""
    user = ["--set", "model.name=user_model:build_tiny", "--set", "model.flavor="]
    cases = [
        (
            ["--set", "model.kwargs.hidden=-3"],
            "model.kwargs: user_model:build_tiny(hidden=-3) fails: RuntimeError: Trying to create tensor with "
            "negative dimension -3: [-3, 64]",
        ),
        (
            ["--set", "data.name=synthetic", "--set", "data.kwargs.shape=[3, 4, 4]"],
            "model.name: user_model:build_tiny() fails on one sample of data.name=synthetic (inputs (3, 4, 4)): "
            "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x48 and 64x8)",
        ),
    ]
    for args, line in cases:
        proc = run_cli("train", *user, *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [f"rayjobs: error: {line}"]
        assert "RAY_IMPORTED=False" in proc.stdout


def test_cluster_up_with_a_cloud_yaml_is_one_line():
    proc = run_cli("cluster", "up", "--config", "cluster/aws.yaml", cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "rayjobs: error: cluster config: cluster/aws.yaml is not a fake_multinode cluster; "
        "use `ray up cluster/aws.yaml` for clouds"
    ]


@pytest.mark.parametrize("args, rc", [(["configs"], 0), (["train", "--set", "optim.lr=-1"], 2)])
def test_the_command_leaves_its_objects_to_the_os_at_exit(args, rc):
    """Python's shutdown collected a run's objects for about 2 s after the summary was printed (0.3 s
    after a one-line error); the CLI freezes them at exit instead, on success and on error alike, and
    the exit handlers registered before it (here the probe's) still run."""
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('FROZEN_AT_EXIT=' + str(gc.get_freeze_count() > 0)))\n"
        "from rayjobs.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == rc, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "FROZEN_AT_EXIT=True", proc.stdout[-500:]


VANISHING_WORKDIR = """
import os, shutil, sys
from rayjobs import cli, preflight

built = preflight.check_model_builds

def vanish_then_build(cfg):  # as a Ray node that joins on this host unpacks the job's working_dir over it
    shutil.rmtree(os.getcwd())
    built(cfg)

preflight.check_model_builds = vanish_then_build
cli.main(["train", "--set", "tracking.enabled=false", "--set", "run.storage_path=" + sys.argv[1]])
"""


def test_a_working_directory_deleted_under_the_command_is_one_line_not_the_models_fault(tmp_path):
    """CI saw `model.name: digits_cnn ... cannot be built: FileNotFoundError` when a joining node's unpack
    deleted the driver's directory: the model was blamed for the machine's error (torch's compiler asks
    for os.getcwd() when it is first imported, here by the model's build on the meta device)."""
    here = tmp_path / "job"
    here.mkdir()
    cmd = [sys.executable, "-c", VANISHING_WORKDIR, str(tmp_path / "results")]
    proc = subprocess.run(cmd, cwd=here, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"rayjobs: error: the working directory {here} was deleted while this command ran (under `ray job "
        "submit`, a node that joins with the head's temp dir on the same host unpacks the job's working_dir "
        "again over it); run from a directory that stays, or start each node of one host with its own "
        "`ray start --temp-dir`"
    ]
