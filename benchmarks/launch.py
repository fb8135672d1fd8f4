"""Launch the shared workload under torchrun or under Ray Train in a fresh process, and time it.

In smoke mode (``sharing()``) a launch of the same workload is made once and its record shared by
the benchmarks that ask for it (launch, orchestration, scaling): their code paths, one launch each.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.base import REPO, subprocess_env
from rayjobs import timeline

SMOKE_SPEC = {"steps": 6, "warmup": 1}  # the one workload the smoke's launch benchmarks share
_shared: dict[str, dict[str, Any]] | None = None  # launches by workload, while sharing()


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Within this block a launch of a workload already launched returns the first one's record."""
    global _shared
    _shared = {}
    try:
        yield
    finally:
        _shared = None


def _once(key: list[Any], launch: Any) -> dict[str, Any]:
    if _shared is None:
        return launch()
    name = json.dumps(key, sort_keys=True)
    if name not in _shared:
        _shared[name] = launch()
    return _shared[name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(cmd: list[str], out: Path, timeout: float) -> dict[str, Any]:
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"workload failed ({' '.join(cmd[:4])} ...):\n{_failure_lines(proc.stdout + proc.stderr)}")
    record = json.loads(out.read_text())
    record["launch_to_first_step_s"] = record["first_step_at"] - started
    if "driver_start" not in record["marks"]:  # torchrun: its launcher's start, with no Ray and no fit()
        record["marks"].update(dict.fromkeys(timeline.DRIVER_MARKS, started))
    return record


def _failure_lines(output: str) -> str:
    """The lines that say why a launch failed (a rank's C++ abort is far above torchrun's summary), then the tail."""
    causes = [line for line in output.splitlines() if any(k in line for k in _CAUSES)]
    return "\n".join(causes[-20:]) + "\n...\n" + output[-2000:]


_CAUSES = ("terminate called", "what():", "Error", "Signal", "Traceback")


def torchrun(spec: dict[str, Any], nproc: int, timeout: float = 600) -> dict[str, Any]:
    """The workload under ``torchrun --nproc-per-node nproc`` (gloo, one thread per process)."""
    return _once(["torchrun", spec, nproc], lambda: _torchrun(spec, nproc, timeout))


def _torchrun(spec: dict[str, Any], nproc: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            "-m",
            "benchmarks.workload",
            "--spec",
            json.dumps(spec),
            "--out",
            str(out),
        ]
        return _launch(cmd, out, timeout)


def ray_train(spec: dict[str, Any], workers: int, timeout: float = 600, fits: int = 1) -> dict[str, Any]:
    """The workload under rayjobs' launcher: a fresh local Ray and a TorchTrainer with ``workers``
    (``fits`` in a row: the record's ``warm`` is the second, on the running Ray). While sharing, every
    launch fits twice, so that one record serves a cold and a warm request alike."""
    if _shared is not None:
        return _once(["ray", spec, workers], lambda: _ray_train(spec, workers, timeout, max(fits, 2)))
    return _ray_train(spec, workers, timeout, fits)


def _ray_train(spec: dict[str, Any], workers: int, timeout: float, fits: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.workload",
            "--ray",
            str(workers),
            "--fits",
            str(fits),
            "--spec",
            json.dumps(spec),
            "--out",
            str(out),
        ]
        return _launch(cmd, out, timeout)
