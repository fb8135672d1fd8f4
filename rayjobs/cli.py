"""The ``rayjobs`` command.

    rayjobs train [--config FILE] [--set key=value ...] [--summary PATH] [--print-config]

Exit status: 0 done; 1 the training failed; 2 bad input (one line per problem, no traceback,
before any Ray process starts).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from rayjobs import log, preflight
from rayjobs.config import RunSection
from rayjobs.errors import ConfigError, Interrupted, TrainingFailed
from rayjobs.storage.bucket import StoreError

DEFAULT_RUNS = RunSection.model_fields["storage_path"].default  # where a run name given alone is looked up


def version_line() -> str:
    """``rayjobs X (ray Y, torch Z, mlflow W, python V)``: what a bug report needs, read without importing them."""
    from importlib import metadata

    from rayjobs import __version__

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    stack = ", ".join(f"{p} {installed(p)}" for p in ("ray", "torch", "mlflow"))
    return f"rayjobs {__version__} ({stack}, python {sys.version.split()[0]})"


class _PrintVersion(argparse.Action):
    """``--version``: the versions are looked up only when asked for (the lookup took 55 ms of every start)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rayjobs", description="Ray-orchestrated scalable PyTorch trainer.")
    parser.add_argument("--version", action=_PrintVersion, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train one run with Ray Train (TorchTrainer)")
    _add_config_args(train, "YAML config (default: the shipped digits job)", "the run summary")
    train.add_argument("--resume-from", metavar="CHECKPOINT", help="resume from this checkpoint directory")
    train.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)  # tune's: said so, in _train
    train.add_argument("--list-configs", action="store_true", help="list the shipped configs (usable by name) and exit")
    sub.add_parser("configs", help="list the shipped configs: --config NAME finds them from any directory")

    tune = sub.add_parser("tune", help="hyperparameter search with Ray Tune around the same training run")
    _add_config_args(tune, "YAML config with a tune: section", "the search summary")
    tune.add_argument("--resume", action="store_true", help="resume the search after its driver died")

    _add_checkpoint_commands(sub)

    ui = sub.add_parser("ui", help="serve the MLflow UI on 127.0.0.1 over this project's tracking store")
    ui.add_argument("--storage-path", default=DEFAULT_RUNS, help="the run.storage_path whose mlflow.db to serve")
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument(
        "--auth", action="store_true", help="basic auth; admin from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD"
    )

    shot = sub.add_parser("screenshot", help="PNG of the MLflow UI's metric chart for a run (headless Chromium)")
    shot.add_argument("--storage-path", default=DEFAULT_RUNS, help="the run.storage_path whose mlflow.db to show")
    shot.add_argument("--run", help="MLflow run name (default: the newest run)")
    shot.add_argument("--experiment", default="rayjobs")
    shot.add_argument("--out", required=True, metavar="PNG")

    data = sub.add_parser("data", help="datasets for Ray Data: write Parquet shards to train on")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="write digits, or a folder of CSV or text files, as Parquet shards")
    prepare.add_argument("source", choices=["digits", "csv", "text"], help="what to write")
    prepare.add_argument("src", nargs="?", help="the CSV or text file or folder (csv, text)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="where the Parquet shards go")
    prepare.add_argument("--label", default="label", help="csv: the integer label column")
    prepare.add_argument("--seq-len", type=int, default=128, help="text: tokens per training sequence")
    prepare.add_argument("--shards", type=int, default=4, help="Parquet files for the train split")

    doctor = sub.add_parser("doctor", help="check the Ray cluster in RAY_ADDRESS before a run (table; 1 if blocked)")
    _add_config_args(doctor, "the run config whose storage_path and tracking.uri to check", "the checks")
    doctor.add_argument("--working-dir", default=".", help="the directory `ray job submit --working-dir` would upload")

    cluster = sub.add_parser(
        "cluster", help="start or stop the local autoscaling cluster (cluster/local-autoscale.yaml)"
    )
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_up = cluster_sub.add_parser("up", help="RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...")
    cluster_up.add_argument("--config", default=None, help="a fake_multinode cluster YAML (default: the shipped one)")
    cluster_up.add_argument("--port", type=int, default=6379, help="the head's GCS port")
    cluster_up.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and Jobs API (127.0.0.1)")
    cluster_down = cluster_sub.add_parser(
        "down", help="stop the cluster `cluster up` started: its head, autoscaler and nodes (no other Ray)"
    )
    cluster_down.add_argument("--port", type=int, default=6379, help="the head's GCS port given to `cluster up`")

    bench = sub.add_parser("bench", help="run the side-by-side benchmarks (ratios, with goals)")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="short runs (about 5 minutes on 2 cores)")
    bench.add_argument("--smoke", action="store_true", help="each benchmark's code path at its smallest (tests)")
    bench.add_argument("--json", metavar="PATH", default="results/bench.json", help="where to write the figures")
    bench.add_argument("--chart", metavar="PATH", help="PNG chart (default: beside --json)")
    return parser


def _add_config_args(parser: argparse.ArgumentParser, config_help: str, summary_what: str) -> None:
    """--config, --set, --summary and --print-config: the same for every command that reads a run config."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field by dotted path, e.g. --set optim.lr=1e-3 (repeatable)",
    )
    parser.add_argument("--summary", metavar="PATH", help=f"write {summary_what} as JSON here")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _trust_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-model",
        default="",
        metavar="MODULE:CALLABLE",
        help="build a checkpoint whose model is this module:callable (it runs that code); registry models need nothing",
    )


def _checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint directory, a run directory or a run's name under ./results (its newest complete "
        "checkpoint), runs:/RUN_ID or models:/NAME/VERSION|latest|@ALIAS",
    )
    parser.add_argument(
        "--tracking-uri",
        default="",
        help="the MLflow store of runs:/ and models:/ (default: $MLFLOW_TRACKING_URI, else results/mlflow.db here)",
    )


def checkpoint_directory(args: argparse.Namespace) -> str:
    """The command's CHECKPOINT as a directory: a path, or the checkpoint an MLflow run or model came from."""
    from rayjobs.preflight import MLFLOW_SOURCES, mlflow_checkpoint

    source = args.checkpoint
    if source.startswith(MLFLOW_SOURCES):
        uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            store = os.path.abspath(os.path.join(DEFAULT_RUNS, "mlflow.db"))
            if not os.path.isfile(store):
                raise ConfigError(
                    f"{args.command}: {source} needs an MLflow store: none at {store}; pass --tracking-uri"
                )
            uri = f"sqlite:///{store}"
        source = mlflow_checkpoint(uri, source, args.command)
    if not os.path.isdir(source):
        named = os.path.join(DEFAULT_RUNS, source)  # a run's name, as `rayjobs checkpoints RUN` takes it
        if os.sep in source or not os.path.isdir(named):
            raise ConfigError(
                f"{args.command}: no checkpoint directory at {source}"
                + _runs_under(DEFAULT_RUNS, f"in {DEFAULT_RUNS}/")
            )
        source = named
    return _checkpoint_of(source, args.command)


def _checkpoint_of(directory: str, command: str) -> str:
    """A checkpoint directory as it is; a run directory's newest complete checkpoint, said aloud."""
    from rayjobs.checkpoint import MANIFEST, STATE, latest_complete, list_checkpoints

    if os.path.isfile(os.path.join(directory, MANIFEST)) or os.path.isfile(os.path.join(directory, STATE)):
        return directory  # a checkpoint (complete or not: loading it says what is missing)
    if not list_checkpoints(directory, check=False):
        raise ConfigError(
            f"{command}: {directory} is neither a checkpoint (no {MANIFEST}) nor a run directory (no checkpoint_* "
            "in it); give a checkpoint directory: `rayjobs checkpoints RUN` lists a run's"
        )
    newest = latest_complete(directory, warn=False)
    if newest is None:
        raise ConfigError(
            f"{command}: run directory {directory} has no complete checkpoint; `rayjobs checkpoints {directory}` "
            "says what each one lacks"
        )
    log.note(f"{command}: {directory} is a run directory: using its newest complete checkpoint, {newest.path}")
    return str(newest.path)


def _add_checkpoint_commands(sub: argparse._SubParsersAction) -> None:
    """checkpoints, export, eval: the commands that read a run's checkpoints."""
    listing = sub.add_parser("checkpoints", help="list a run's checkpoints: step, metrics, complete or not")
    listing.add_argument("run", metavar="RUN_OR_PATH", help="a run directory, or a run name under --storage-path")
    listing.add_argument(
        "--storage-path", default=DEFAULT_RUNS, help="where run names are looked up (a path, or the run's s3://... URI)"
    )

    export = sub.add_parser("export", help="write a checkpoint's weights as a plain state dict or safetensors")
    _checkpoint_argument(export)
    export.add_argument(
        "--out", required=True, metavar="FILE", help="FILE.pt (torch.load(weights_only=True)) or FILE.safetensors"
    )
    _trust_model_argument(export)

    ev = sub.add_parser("eval", help="a checkpoint's task metrics on a split of its data (or other data of its shape)")
    _checkpoint_argument(ev)
    ev.add_argument("--split", default="test", help="test (default), val or train")
    ev.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="other data or task: data.name=..., data.kwargs.X=..., task.name=... (repeatable)",
    )
    ev.add_argument("--summary", metavar="PATH", help="write the metrics as JSON here")
    _trust_model_argument(ev)

    pred = sub.add_parser("predict", help="batch inference: a prediction per row of Parquet/CSV (Ray Data actors)")
    _checkpoint_argument(pred)
    pred.add_argument("--data", required=True, metavar="PATH", help="a Parquet or CSV file, or a folder of them")
    pred.add_argument("--out", required=True, metavar="DIR", help="a new directory for the Parquet output")
    pred.add_argument("--features", default="", help="comma-separated input columns (default: the training data's)")
    pred.add_argument("--batch-size", type=int, default=256, help="rows per model call")
    _trust_model_argument(pred)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``rayjobs`` console script."""
    _exit_without_a_final_collection()
    args = build_parser().parse_args(argv)
    try:
        _STARTED_IN[:] = [os.getcwd()]
        if os.getcwd() not in sys.path:  # as `python -m` does: a module beside the user (my_net:build) imports
            sys.path.append(os.getcwd())
        if args.command == "configs" or (args.command == "train" and args.list_configs):
            _list_configs()
        elif args.command == "train":
            _train(args)
        elif args.command == "tune":
            _tune(args)
        elif args.command == "bench":
            _bench(args)
        elif args.command == "data":
            _prepare(args)
        elif args.command == "doctor":
            _doctor(args)
        elif args.command == "cluster":
            _cluster(args)
        elif args.command == "checkpoints":
            _checkpoints(args)
        elif args.command == "export":
            _export(args)
        elif args.command == "eval":
            _eval(args)
        elif args.command == "predict":
            _predict(args)
        elif args.command == "screenshot":
            from rayjobs.screenshot import take

            run_id = take(args.storage_path, args.out, args.run, args.experiment)
            print(f"screenshot of run {run_id}: {args.out}")
        elif args.command == "ui":
            from rayjobs.mlflow_server import serve

            _check_port("ui --port", args.port)
            preflight.check_writable_dir(args.storage_path, "ui --storage-path")
            serve(args.storage_path, args.port, args.auth)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"rayjobs: error: {problem}", file=sys.stderr)
        sys.exit(2)
    except StoreError as exc:  # an object store the command cannot reach: the user's to fix
        print(f"rayjobs: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        gone = _working_dir_gone() if exc.filename is None else ""
        if gone:
            print(f"rayjobs: error: {gone}", file=sys.stderr)
            sys.exit(2)
        if exc.filename is None:  # not about a path the user gave: keep the traceback
            raise
        # A path no check above foresaw (a name too long to stat, a file that vanished): one line.
        print(f"rayjobs: error: {exc.filename}: {exc.strerror or exc}; check the path", file=sys.stderr)
        sys.exit(2)
    except TrainingFailed as exc:
        _end_ray_log_streaming()
        if exc.__cause__ is not None:  # the training's own error, not a user's config mistake: keep its trace
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"rayjobs: training failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as exc:
        _end_ray_log_streaming()
        print(f"rayjobs: {exc}", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("rayjobs: interrupted", file=sys.stderr)
        sys.exit(130)


_STARTED_IN: list[str] = []  # the command's working directory, while os.getcwd() could still say it


def _working_dir_gone() -> str:
    """What to say when this process's working directory was deleted under it ("" while it is there):
    its os.getcwd() then fails, and so does every import that asks for it (torch's compiler does)."""
    try:
        os.getcwd()
        return ""
    except FileNotFoundError:
        where = _STARTED_IN[0] if _STARTED_IN else os.environ.get("PWD", "")
        return (
            f"the working directory {where} was deleted while this command ran (under `ray "
            "job submit`, a node that joins with the head's temp dir on the same host unpacks the job's "
            "working_dir again over it); run from a directory that stays, or start each node of one host with "
            "its own `ray start --temp-dir`"
        )


def _exit_without_a_final_collection() -> None:
    """Have the command exit without Python's last garbage collections (once per process).

    After a run the interpreter holds millions of objects (torch, Ray, MLflow, pydantic), and its
    shutdown collected them for about 2 s after the summary was printed (0.3 s after a one-line
    error). ``gc.freeze`` at exit leaves them to the OS, as ending the process does anyway. Every exit
    handler still runs (Ray's shutdown, logging's flush); only objects in reference cycles keep
    their memory to the end, and rayjobs closes its files in ``with`` blocks, not in a collection.
    """
    atexit.unregister(gc.freeze)  # once, however often main() runs in this process
    atexit.register(gc.freeze)


def _end_ray_log_streaming() -> None:
    """Shut Ray down (when this process started or joined it) so that the workers' streamed logs,
    which arrive late, are all printed before the one-line reason: that line stays the last."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _prepare(args: argparse.Namespace) -> None:
    from rayjobs import prepare

    out = Path(args.out).resolve()
    if args.shards < 1:
        raise ConfigError(f"data prepare: --shards must be >= 1, got {args.shards}")
    if args.source == "text" and args.seq_len < 1:
        raise ConfigError(f"data prepare: --seq-len must be >= 1, got {args.seq_len}")
    prepare.check_out(out)
    if args.source == "digits":
        rows = prepare.digits(out, args.shards)
    elif not args.src:
        raise ConfigError(
            f"data prepare {args.source}: name the source file or folder, e.g. rayjobs data prepare {args.source} DIR --out OUT"
        )
    elif args.source == "csv":
        rows = prepare.csv(Path(args.src), out, args.label, args.shards)
    else:
        rows = prepare.text(Path(args.src), out, args.seq_len, args.shards)
    print(f"wrote {', '.join(f'{s} {n} rows' for s, n in rows.items())} as Parquet to {out}")
    print(f"train on it: rayjobs train --set data.name=parquet --set data.kwargs.path={out} [--set model.name=...]")


def _list_configs() -> None:
    from rayjobs.config import CONFIG_DIR, shipped_configs

    configs = shipped_configs()
    width = max(map(len, configs))
    for name, first_line in configs.items():
        print(f"{name:<{width}}  {first_line}")
    print(f"(in {CONFIG_DIR}; use one with --config NAME from any directory)")


def _train(args: argparse.Namespace) -> None:
    from rayjobs.config import load_config, to_yaml

    if args.resume:  # argparse read it as an abbreviation of --resume-from, wanting a path
        raise ConfigError(
            "train: --resume is tune's; a run resumes by itself: the same command (the same run.name) goes on "
            "from its newest checkpoint, and --resume-from CHECKPOINT starts from another run's"
        )
    overrides = list(args.overrides)
    if args.resume_from:
        overrides.append(f"checkpoint.resume_from={args.resume_from}")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return
    from rayjobs import log, train

    if cfg.tune.space:  # a search's config: say what of it a train run uses
        log.note(
            f"train runs this config once, as it stands; its search over {', '.join(cfg.tune.space)} "
            f"runs with `rayjobs tune{f' --config {args.config}' if args.config else ''}`"
        )

    summary_path = _summary_path(args.summary)
    summary = train.run(cfg)
    print(train.format_summary(summary), flush=True)
    if summary_path:
        train.write_summary(summary, summary_path)
        print(f"  summary:    {summary_path}")


def _tune(args: argparse.Namespace) -> None:
    import json

    from rayjobs.config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return
    from rayjobs import tune

    problems = tune.space_problems(cfg)
    if problems:
        raise ConfigError(problems)
    summary_path = _summary_path(args.summary)
    summary = tune.run_search(cfg, resume=args.resume)
    print(tune.format_summary(summary, cfg.tune.metric), flush=True)
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
        print(f"  summary: {summary_path}")


def _summary_path(given: str | None) -> str | None:
    """``--summary PATH`` made absolute before the run starts (under a Ray job: a durable place)."""
    if not given:
        return None
    from rayjobs import paths

    path, note = paths.summary_path(given)
    if note:
        print(f"rayjobs: {note}", flush=True)
    if os.path.isdir(path):
        raise ConfigError(f"--summary {given}: is a directory; give a file path, e.g. results/summary.json")
    preflight.check_writable_dir(os.path.dirname(path), "--summary")  # before the run, not after it
    if len(os.path.basename(path).encode()) > os.pathconf(os.path.dirname(path), "PC_NAME_MAX"):
        raise ConfigError(f"--summary {given}: the file name is longer than this filesystem allows; give a shorter one")
    return path


def _check_port(what: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what}: must be a TCP port from 1 to 65535, got {port}")


def _doctor(args: argparse.Namespace) -> None:
    from rayjobs import doctor, paths
    from rayjobs.config import load_config, to_yaml
    from rayjobs.tracking import tracking_uri

    cfg = load_config(args.config, args.overrides)
    paths.resolve(cfg)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return
    summary = _summary_path(args.summary)
    sys.exit(doctor.main(cfg.storage_uri or cfg.storage_path, tracking_uri(cfg), args.working_dir, summary, cfg))


def _cluster(args: argparse.Namespace) -> None:
    from rayjobs import cluster

    if args.cluster_command == "down":
        started = cluster.recorded(args.port)
        if started is None:
            raise ConfigError(
                f"cluster down: no cluster that `rayjobs cluster up` started on port {args.port} is noted in "
                f"{cluster.RECORDS}; give its --port, or stop other Rays with `ray stop`"
            )
        cluster.down(started)
        cluster.forget(args.port)
        print(f"rayjobs: local cluster on {started.gcs_address} stopped")
        return
    _check_port("cluster up --port", args.port)
    _check_port("cluster up --dashboard-port", args.dashboard_port)
    started = cluster.up(Path(args.config) if args.config else cluster.LOCAL_YAML, args.port, args.dashboard_port)
    try:
        cluster.record(started)
    except OSError as exc:  # the cluster runs: say how to stop it rather than fail
        print(
            f"rayjobs: warning: cannot note the cluster in {cluster.RECORDS} ({exc.strerror or exc}): "
            f"`rayjobs cluster down` will not find it; `ray stop` stops it (and every other Ray here)",
            file=sys.stderr,
        )
    print(f"rayjobs: local autoscaling cluster up: GCS {started.gcs_address}, dashboard {started.dashboard_url}")
    print(f"  token auth on: clients here read the token from {cluster.TOKEN_FILE} (or RAY_AUTH_TOKEN)")
    print(f"  export RAY_ADDRESS={started.gcs_address}")
    print(f"  ray job submit --address {started.dashboard_url} --working-dir . -- python -m rayjobs.train ...")


def _checkpoints(args: argparse.Namespace) -> None:
    from rayjobs.checkpoint import list_bucket_checkpoints, list_checkpoints
    from rayjobs.storage.bucket import RunStore
    from rayjobs.storage.uri import check_uri, is_uri

    if is_uri(args.storage_path):  # a run whose checkpoints are in a bucket
        try:
            check_uri(args.storage_path)
        except ValueError as exc:
            raise ConfigError(f"checkpoints: --storage-path: {exc}") from None
        store = RunStore(args.storage_path, args.run)
        run_dir, infos = store.url(), list_bucket_checkpoints(store)
    else:
        named = os.path.join(args.storage_path, args.run)
        run_dir = named if os.path.isdir(named) else args.run
        if not os.path.isdir(run_dir):
            raise ConfigError(
                f"checkpoints: {args.run!r} is neither a run directory nor a run under "
                f"--storage-path {os.path.abspath(args.storage_path)}; give a run directory or a run name"
                + _runs_under(args.storage_path)
            )
        infos = list_checkpoints(run_dir)
    if not infos:
        print(f"{run_dir}: no checkpoints")
        return
    columns = _validation_columns([c.metrics for c in infos])
    widths = [max(9, len(k)) for k in columns]
    print(f"{'step':>8}  {'status':<10}  " + "  ".join(f"{k:>{w}}" for k, w in zip(columns, widths)) + "  path")
    for c in infos:
        status = "complete" if c.complete else "INCOMPLETE"
        values = [(c.metrics.get(k), w) for k, w in zip(columns, widths)]
        shown = "  ".join(f"{v:>{w}.4f}" if isinstance(v, (int, float)) else f"{'-':>{w}}" for v, w in values)
        print(f"{c.step:>8}  {status:<10}  {shown}  {c.path}" + (f"  ({c.problem})" if c.problem else ""))


def _validation_columns(metrics: list[dict[str, Any]]) -> list[str]:
    """The checkpoints' validation metrics to show: val/loss, then the task's others (at most three)."""
    found = sorted({k for m in metrics for k in m if k.startswith("val/") and k != "val/loss"})
    return ["val/loss", *found[:3]]


def _runs_under(storage_path: str, where: str = "there") -> str:
    """The run directories under ``storage_path`` (those holding a checkpoint), as "; runs there: a, b"."""
    from rayjobs.checkpoint import checkpoint_names
    from rayjobs.storage.local import LocalStore

    try:
        runs = sorted(e.name for e in os.scandir(storage_path) if e.is_dir() and checkpoint_names(LocalStore(e.path)))
    except OSError:
        return ""
    return f"; runs {where}: {', '.join(runs)}" if runs else ""


def _export(args: argparse.Namespace) -> None:
    from rayjobs.checkpoint import CheckpointError, export_weights

    if not args.out.endswith((".pt", ".pth", ".safetensors")):
        raise ConfigError(f"export: --out must end in .pt, .pth or .safetensors, got {args.out!r}")
    if os.path.isdir(args.out):  # False for a name too long to stat, which export then names
        raise ConfigError(f"export: --out {args.out} is a directory; give a file path (e.g. {args.out}/weights.pt)")
    checkpoint = checkpoint_directory(args)
    preflight.check_writable_dir(str(Path(args.out).resolve().parent), "export: --out")
    try:
        info = export_weights(checkpoint, args.out, args.trust_model)
    except CheckpointError as exc:
        raise ConfigError(f"export: {exc}") from None
    print(
        f"exported {info['tensors']} tensors ({info['parameters']:,} parameters) of "
        f"{info['model']}/{info['flavor']} to {args.out}"
    )


def _eval(args: argparse.Namespace) -> None:
    from rayjobs.evaluation import check_arguments, evaluate_checkpoint, format_eval

    check_arguments(args.split, args.overrides)
    summary_path = _summary_path(args.summary)
    result = evaluate_checkpoint(checkpoint_directory(args), args.split, args.overrides, args.trust_model)
    print(format_eval(result))
    if summary_path:
        from rayjobs.train import write_summary

        write_summary(result, summary_path)


def _predict(args: argparse.Namespace) -> None:
    from rayjobs.predict import predict

    if args.batch_size < 1:
        raise ConfigError(f"predict: --batch-size must be >= 1, got {args.batch_size}")
    checkpoint = checkpoint_directory(args)
    features = [f.strip() for f in args.features.split(",") if f.strip()]
    done = predict(checkpoint, args.data, args.out, features, args.trust_model, args.batch_size)
    print(f"predicted {done['rows']} rows ({', '.join(done['features'])}) on {done['actors']} actor(s): {done['out']}")


def _bench(args: argparse.Namespace) -> None:
    """Hand over to ``python -m benchmarks`` in this process's place (rayjobs never imports benchmarks)."""
    from rayjobs.config import REPO_ROOT

    if not (REPO_ROOT / "benchmarks" / "harness.py").exists():
        raise ConfigError("bench: the benchmarks/ folder is not here; run from a clone of the rayjobs repository")
    if args.quick and args.smoke:
        raise ConfigError("bench: --quick and --smoke are two sizes of a run; give one of them")
    argv = [
        *args.names,
        "--json",
        args.json,
        *(["--quick"] if args.quick else []),
        *(["--smoke"] if args.smoke else []),
        *(["--chart", args.chart] if args.chart else []),
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")] if p)
    )
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks", *argv], env)


if __name__ == "__main__":
    main()
