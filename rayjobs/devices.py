"""Device checks before training: every worker reports its device, and unlike devices are refused.

One slow or smaller GPU sets the pace of a synchronous job (and its memory limits every rank's
batch), so a run on unlike devices fails before the first step unless the config allows it.
"""

from __future__ import annotations

import platform
from typing import Any

import torch
import torch.distributed as dist

from rayjobs.context import WorkerContext
from rayjobs.errors import ExplainedFailure
from rayjobs.log import log

GIB = 2**30


class UnlikeDevices(ExplainedFailure):
    """The workers of one run are on different kinds of device."""


def describe(device: torch.device) -> dict[str, Any]:
    """This worker's device: name, memory (GiB) and compute capability (CPU: model name and RAM)."""
    host = platform.node()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "host": host,
            "name": props.name,
            "memory_gib": round(props.total_memory / GIB, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    import psutil

    return {
        "host": host,
        "name": _cpu_name(),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "capability": "cpu",
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gather(ctx: WorkerContext) -> list[dict[str, Any]]:
    """Every worker's ``describe``, in rank order, known to every rank."""
    mine = describe(ctx.device)
    if ctx.world_size == 1 or not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def differences(devices: list[dict[str, Any]]) -> list[str]:
    """Lines naming the ranks whose device differs from rank 0's (name, capability or memory)."""
    ref = devices[0]
    lines = []
    for rank, d in enumerate(devices[1:], start=1):
        keys = ("name", "capability") if d["capability"] == "cpu" else ("name", "capability", "memory_gib")
        unlike = [k for k in keys if d[k] != ref[k]]
        if unlike:
            lines.append(
                f"rank {rank} on {d['host']} has {d['name']} ({d['memory_gib']} GiB, {d['capability']}), "
                f"rank 0 on {ref['host']} has {ref['name']} ({ref['memory_gib']} GiB, {ref['capability']})"
            )
    return lines


def check_alike(ctx: WorkerContext, allow_mixed: bool) -> list[dict[str, Any]]:
    """Gather every worker's device; unlike devices raise (or, when allowed, rank 0 warns)."""
    devices = gather(ctx)
    unlike = differences(devices)
    if unlike and not allow_mixed:
        raise UnlikeDevices(
            f"unlike devices in one run: {unlike[0]}{f' (and {len(unlike) - 1} more)' if len(unlike) > 1 else ''}; "
            "pin one type with scaling.accelerator_type, or set parallel.allow_mixed_devices=true"
        )
    if ctx.is_main:
        if unlike:
            log(f"warning: unlike devices (parallel.allow_mixed_devices=true): {'; '.join(unlike)}")
        d = devices[0]
        log(
            f"devices: {len(devices)} x {d['name']} ({d['memory_gib']} GiB, {d['capability']})"
            + (" and others" if unlike else "")
        )
    return devices
