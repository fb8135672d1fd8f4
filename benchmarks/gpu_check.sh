#!/usr/bin/env bash
# Every GPU check in one short run (about 5 minutes on one H200), for a lent GPU machine:
#
#   bash benchmarks/gpu_check.sh            # writes $OUT (default results/gpu) / gpu.json, gpu.log
#
# 1. the device: nvidia-smi, torch's view of it (name, memory, capability, bf16 support);
# 2. NCCL: a 1-worker rayjobs train on GPU (NCCL backend through Ray Train), bf16, digits;
# 3. bf16 MFU, tokens/s and peak memory of gpt (medium, then 1b) on one GPU: `rayjobs bench gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
make setup
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
.venv/bin/python - <<'PY'
import torch
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}: {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, "
      f"bf16 {torch.cuda.is_bf16_supported()}, nccl {torch.cuda.nccl.version()}")
PY
.venv/bin/rayjobs train --set training.precision=bf16 --set training.epochs=3 \
    --set run.storage_path="$PWD/$OUT/results" --summary "$OUT/train-summary.json"
.venv/bin/rayjobs bench gpu --quick --json "$OUT/gpu-quick.json"
.venv/bin/rayjobs bench gpu --json "$OUT/gpu.json"
