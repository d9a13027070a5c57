#!/usr/bin/env bash
# Every benchmark for one card; JSON and logs go to $OUT (default ./bench_out). From the repo root:
#   bash benchmarks/run_all.sh                 # one GPU: training (8x512, 64x512), agreement, generation
#   DDP=1 SKIP_TRAIN=1 SKIP_GEN=1 bash benchmarks/run_all.sh   # DDP scaling 1 -> all visible GPUs
#   python3 benchmarks/make_results.py $OUT [$DDP_OUT]          # the Markdown tables of RESULTS.md
# Env: BATCHES ("64 8"), GROUPS_ (variants timed at every batch), EXTRA_B8 (variants timed at batch 8
# only), SKIP_TRAIN=1, SKIP_GEN=1, DDP_IMPLS ("trainer tuned"), DDP_ARGS (extra bench_ddp.py arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (a program using it can take a shared host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OELM_COMMIT=${OELM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null > "$OUT/gpu.txt"
BATCHES=${BATCHES:-"64 8"}
GROUPS_=${GROUPS_:-"reference gpt_base oelm_nofreeze oelm_freeze"}
EXTRA_B8=${EXTRA_B8:-"gpt_base:cuda_graph=0 reference:cuda_graph=1"}
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  python3 benchmarks/bench_train.py --batch $BATCHES --groups $GROUPS_ --check \
      --json "$OUT/train.json" 2>&1 | grep -v '^{' | tee "$OUT/train.log"
  [ -n "$EXTRA_B8" ] && python3 benchmarks/bench_train.py --batch 8 --groups $EXTRA_B8 \
      --json "$OUT/train_extra.json" 2>&1 | grep -v '^{' | tee -a "$OUT/train.log"
  # Where the time goes at 64 x 512: kernel families of the reference and the trainer's step.
  python3 benchmarks/bench_train.py --batch 64 --groups reference gpt_base:cuda_graph=0 --steps 5 --blocks 3 \
      --warmup 3 --profile reference gpt_base:cuda_graph=0 --out-dir "$OUT" --json "$OUT/train_profile.json" 2>&1 \
      | grep -v '^{' | tee -a "$OUT/train.log"
fi
if [ "${SKIP_GEN:-0}" != 1 ]; then
  # smoke and medium512, greedy and temperature 0.8 top-k 50: the reference loop, the fast decoder,
  # and the fast decoder with each part off; then the sampler alone, torch ops against its kernels.
  python3 benchmarks/bench_generate.py --json "$OUT/generate.json" 2>&1 | grep -v '^{' | tee "$OUT/generate.log"
  python3 benchmarks/bench_sample.py --json "$OUT/sample.json" 2>&1 | grep -v '^{' | tee -a "$OUT/generate.log"
fi
if [ "${DDP:-0}" = 1 ]; then
  N=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for impl in ${DDP_IMPLS:-trainer tuned}; do
    for n in 1 "$N"; do
      torchrun --standalone --nproc_per_node "$n" benchmarks/bench_ddp.py --impl "$impl" --blocks 5 \
          --json "$OUT/ddp_${impl}_$n.json" ${DDP_ARGS:-} 2>&1 | grep -v '^{' | tee "$OUT/ddp_${impl}_$n.log"
    done
  done
  python3 benchmarks/ddp_efficiency.py "$OUT"/ddp_*.json | tee "$OUT/ddp.txt"
fi
