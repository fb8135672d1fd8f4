"""Throughput and MFU: model FLOPs/s against the right peak for the device and dtype."""

from __future__ import annotations

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
