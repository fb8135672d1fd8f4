#!/usr/bin/env bash
# Every GPU check in one short run (about 5 minutes on one H200), for a lent GPU machine:
#
#   bash benchmarks/gpu_check.sh            # writes $OUT (default results/gpu): gpu.json + gpu.png, gpu.log
#   bash benchmarks/gpu_check.sh --cpu      # the same steps on the CPU (the suite runs this rehearsal)
#
# 1. the device: nvidia-smi, torch's view of it (name, memory, capability, bf16 support, NCCL);
# 2. NCCL DDP: rayjobs train of the default job on every GPU here (one Ray worker per GPU), bf16;
# 3. `rayjobs bench gpu`: bf16 MFU of gpt (medium in quick form, then 1b) under FSDP2 against the
#    GPU's dense bf16 peak, tokens/s, peak memory against rayjobs' estimate, DataParallel vs DDP.
# --cpu: gloo instead of NCCL, fp32, gpt debug and a 10-step train (RAYJOBS_GPU_CHECK=cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=0
case "${1:-}" in
  --cpu) CPU=1 ;;
  "") ;;
  *) echo "gpu_check.sh: unknown argument $1; use --cpu or nothing" >&2; exit 2 ;;
esac
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu.log") 2>&1
make setup
if [ "$CPU" = 1 ]; then
  export RAYJOBS_GPU_CHECK=cpu
  TRAIN=(--set scaling.use_gpu=false --set training.max_steps=10 --set training.epochs=1)
  SIZES=(--smoke)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  TRAIN=(--set training.precision=bf16 --set training.epochs=3)
  SIZES=(--quick "")
fi
.venv/bin/python - <<'PY'
import os, torch
if os.environ.get("RAYJOBS_GPU_CHECK") == "cpu":
    print(f"torch {torch.__version__}: CPU rehearsal, {torch.get_num_threads()} threads, gloo {torch.distributed.is_gloo_available()}")
else:
    p = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}: {torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, "
          f"capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}, nccl {torch.cuda.nccl.version()}")
PY
.venv/bin/rayjobs train "${TRAIN[@]}" --set run.storage_path="$OUT/results" --summary "$OUT/train-summary.json"
for size in "${SIZES[@]}"; do
  name=gpu${size:+-${size#--}}
  .venv/bin/rayjobs bench gpu ${size:+$size} --json "$OUT/$name.json"
done
echo "gpu_check: done; figures in $OUT"
