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
