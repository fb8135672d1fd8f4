"""Throughput and MFU: model FLOPs/s against the right peak for the device and dtype."""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak FLOP/s by GPU name fragment, most specific first, from the vendors'
# data sheets. bf16/fp16 are tensor-core peaks; fp32 is the non-tensor-core peak.
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "fp32": 80e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "fp32": 82.6e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("T4", {"fp16": 65e12, "fp32": 8.1e12}),
]


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of a known GPU for ``dtype`` (bf16 | fp16 | fp32); None if unknown."""
    for fragment, peaks in GPU_PEAKS:
        if fragment.lower() in device_name.lower():
            return peaks.get(dtype)
    return None


def mfu(model_flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: achieved model FLOPs/s over the peak (None when the peak is unknown)."""
    return model_flops_per_s / peak if peak else None


def measured_matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5
) -> float:
    """FLOP/s of an n x n matmul on ``device`` in this process and thread setup (best of ``repeats``)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one worker's device at this precision, where the number comes from).

    A known GPU: its data-sheet dense peak for the dtype. Otherwise (CPU, unknown GPU) a matmul
    measured in this process: on CPU that is the peak this worker's threads can reach.
    """
    dtype = precision if precision in ("bf16", "fp16") else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, dtype)
        if peak:
            return peak, f"{name} {dtype} data sheet"
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        return measured_matmul_peak(device, torch_dtype, n=4096), f"{name} {dtype} matmul measured"
    return measured_matmul_peak(device), f"CPU fp32 matmul measured ({torch.get_num_threads()} threads)"


class Meter:
    """Time, samples and MFU of one attempt: what the loop reports per step and prints.

    ``train_s`` counts each step from the wait for its batch to the end of its logging (logging
    counts against throughput); MFU is model FLOPs per sample x samples/s over the job's peak.
    """

    def __init__(
        self,
        flops_per_sample: float,
        job_peak: float,
        batch_size: int,
        tokens_per_sample: int,
        log_every: int,
        first_step: int,
    ) -> None:
        self.flops_per_sample = flops_per_sample
        self.job_peak = job_peak
        self.batch_size = batch_size
        self.tokens_per_sample = tokens_per_sample
        self.log_every = log_every
        self.first_step = first_step
        self.train_s = 0.0
        self.samples = 0  # trained in this attempt (a resumed run's earlier samples are not in train_s)
        self.started = time.perf_counter()
        self._t0 = self.started

    def step_started(self) -> None:
        """Mark the start of a step (before waiting for its batch)."""
        self._t0 = time.perf_counter()

    def since_step_start(self) -> float:
        """Seconds since the step started (the data wait, when asked right after the batch came)."""
        return time.perf_counter() - self._t0

    def step_done(self) -> None:
        """Count the step (and its logging) into the training time, and its samples."""
        self.train_s += time.perf_counter() - self._t0
        self.samples += self.batch_size

    def samples_per_s(self) -> float:
        """This attempt's throughput; 0.0 before its first step (a run resumed at its last step trains none)."""
        return self.samples / self.train_s if self.samples else 0.0

    def mfu(self, samples_per_s: float) -> float:
        """Model FLOPs utilization of the job at this throughput."""
        return self.flops_per_sample * samples_per_s / self.job_peak

    def step_metrics(self, step: int, loss: float, lr: float, grad_norm: float, data_wait_s: float) -> dict[str, float]:
        """What MLflow gets every ``tracking.log_every`` steps (nothing on the other steps)."""
        if step % self.log_every:
            return {}
        step_s = self.since_step_start()
        out = {
            "train/step_loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "perf/step_time_s": step_s,
            "perf/samples_per_s": self.batch_size / step_s,
        }
        if self.flops_per_sample:
            out["perf/mfu"] = self.mfu(self.batch_size / step_s)
        if self.tokens_per_sample:
            out["perf/tokens_per_s"] = self.batch_size * self.tokens_per_sample / step_s
        out["perf/data_wait_fraction"] = data_wait_s / step_s
        return out

    def progress(self, step: int, total_steps: int, stop_at: int, epoch: int, loss: float, lr: float) -> str:
        """The console's step line: loss, lr, throughput, MFU, elapsed and ETA."""
        rate = self.samples_per_s()
        elapsed = time.perf_counter() - self.started
        return (
            f"step {step}/{total_steps} epoch {epoch + 1} loss {loss:.4f} lr {lr:.2e} {rate:.0f} samples/s "
            f"MFU {100 * self.mfu(rate):.1f}% {progress_times(elapsed, step - self.first_step + 1, stop_at - step)}"
        )


def progress_times(elapsed_s: float, steps_done: int, steps_left: int) -> str:
    """``elapsed 1m05s eta 40s``: this attempt's time so far and the rest at its mean pace (evals included)."""
    eta = elapsed_s / max(steps_done, 1) * steps_left
    return f"elapsed {format_duration(elapsed_s)} eta {format_duration(eta)}"


def format_duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
