"""The identical training loop that the benchmarks run under torchrun, under Ray Train, and alone.

    torchrun --nproc-per-node 2 -m benchmarks.workload --spec '{"steps": 20}' --out /tmp/torchrun.json
    python -m benchmarks.workload --ray 2 --spec '{"steps": 20}' --out /tmp/ray.json

The loop is rayjobs' own ``train_step`` on a DDP-wrapped model with in-memory synthetic data, so
the only difference between the two launchers is the launcher. Rank 0 writes a JSON record with
the wall-clock time of the first optimizer step (``first_step_at``) and every step's duration.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch

from rayjobs import timeline

# A transformer small enough for 1 CPU thread (~0.1 s a step), big enough that a step is mostly compute.
DEFAULT_SPEC: dict[str, Any] = {
    "model": "gpt",
    "flavor": "debug",
    "model_kwargs": {"dim": 128, "n_layers": 4, "n_heads": 4},
    "seq_len": 64,
    "vocab_size": 256,
    "per_rank_batch": 8,
    "warmup": 3,
    "steps": 20,
    "threads": 1,
}


def run_loop(spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Build the model, wrap it in DDP, run warmup + measured steps; return this rank's timings."""
    from models import DataInfo, build_model
    from rayjobs.config import from_dict
    from rayjobs.parallel import wrap_ddp
    from rayjobs.stepping import build_optimizer, train_step

    marks = {"worker_start": timeline.process_start(), "worker_entered": time.time()}
    spec = {**DEFAULT_SPEC, **spec}
    torch.set_num_threads(spec["threads"])
    info = DataInfo("tokens", (spec["seq_len"],), spec["vocab_size"])
    g = torch.Generator().manual_seed(ctx.rank)
    batch = spec["per_rank_batch"]
    x = torch.randint(0, spec["vocab_size"], (batch, spec["seq_len"]), generator=g)
    y = torch.roll(x, -1, dims=1)
    marks["data_ready"] = time.time()
    cfg = from_dict({"optim": {"name": "adamw", "lr": 1e-3}})
    torch.manual_seed(0)
    model = wrap_ddp(build_model(spec["model"], spec["flavor"], spec["model_kwargs"], info), ctx)
    opt = build_optimizer(model, cfg)
    marks["model_ready"] = time.time()
    times: list[float] = []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        train_step(model, [(x, y)], opt, cfg, ctx, lean=True)  # as rayjobs trains (nan_policy=stop)
        marks.setdefault("first_step", time.time())
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times) if times else float("nan")
    return {
        "marks": marks,
        "first_step_at": marks["first_step"],
        "step_times": times,
        "median_step_s": median,
        "world_size": ctx.world_size,
        "samples_per_s": batch * ctx.world_size / median,
    }


def _ray_worker(config: dict[str, Any]) -> dict[str, Any]:
    from rayjobs.context import current_context

    return run_loop(config["spec"], current_context(use_gpu=False))


def run_under_ray(spec: dict[str, Any], workers: int, fits: int = 1) -> dict[str, Any]:
    """rayjobs' launcher: a local Ray and a TorchTrainer with ``workers`` CPU workers, ``fits`` times
    in a row (the second on the running Ray: ``warm``). The record carries the timeline's marks."""
    from ray.train import RunConfig, ScalingConfig

    from rayjobs.launch import owns_local_ray, poll_reports_often, start_local_ray
    from rayjobs.trainer import Trainer

    poll_reports_often()  # as `rayjobs train` does
    marks = {"driver_start": timeline.process_start(), "ray_start": time.time()}
    start_local_ray(num_cpus=max(os.cpu_count() or 1, workers), log_to_driver=False)
    marks["ray_ready"] = marks["tracking_ready"] = time.time()  # no MLflow run here
    records = []
    for i in range(fits):
        trainer = Trainer(  # as `rayjobs train` builds it
            _ray_worker,
            own_local_ray=owns_local_ray(),
            train_loop_config={"spec": spec},
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"bench-{os.getpid()}-{i}", storage_path=os.path.abspath(".bench/ray")),
        )
        marks["fit"] = time.time()
        record = trainer.fit().return_value
        record["fit_to_first_step_s"] = record["first_step_at"] - marks["fit"]
        record["marks"] = {**marks, **record["marks"]}
        records.append(record)
        marks = dict.fromkeys(timeline.DRIVER_MARKS, time.time())  # the next fit finds Ray up
    return {**records[0], "warm": records[1]} if fits > 1 else records[0]


def main() -> None:
    """Entry for torchrun (``--ray 0``) or for a Ray launch (``--ray N``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", default="{}")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ray", type=int, default=0, help="launch N Ray Train workers instead of torchrun's")
    parser.add_argument("--fits", type=int, default=1, help="with --ray: fits in a row (the second is warm)")
    args = parser.parse_args()
    spec = json.loads(args.spec)
    if args.ray:
        record = run_under_ray(spec, args.ray, args.fits)
    else:
        import torch.distributed as dist

        from rayjobs.context import WorkerContext

        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        record = run_loop(spec, WorkerContext.from_process_group())
        if dist.is_initialized():
            # The DDP model's reference cycles keep its reducer (and the gloo group) alive; collected at
            # interpreter exit, gloo's threads abort the process (SIGABRT). Free both before exit.
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) != 0:
            return
    with open(args.out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
