#!/usr/bin/env bash
# Every issue-7 ablation (the 15 variants of parameters/ablations.yaml) x 2 seeds, sequentially on one GPU,
# then the table (variant, seed, final val loss/ppl, trainable/frozen params) and a figure.
#
#   [OELM_DATA=/path/to/tinystories] scripts/run_ablations.sh [RESULTS_DIR] [--set key=value ...]
#   (quick check: ONLY="gpt_base oelm_poet" SEEDS=0 scripts/run_ablations.sh /tmp/abl --set train.steps=50)
#
# RESULTS_DIR (default runs/ablations, git-ignored) gets <ablation>/seed<S>/ run folders, ablations.md,
# ablations.json and ablations.png. results/ablations holds the committed results (their run
# folders without best.pt, and errata in ablations.md): pointing RESULTS_DIR there would train
# nothing and rewrite ablations.md. Runs go in one Python process (no per-run start-up, no
# torch.compile) at preset mini with a 128-token context, 800 steps x 32 sequences (3.3M tokens)
# each: ~5-10 s per run on an H100, ~3-5 min for all 30. BUDGET_S (default 450) stops starting
# new runs after that many seconds so the whole script stays under 8 minutes; running it again
# skips completed runs and continues. SEEDS (default "0 1") and ONLY ("oelm_poet synth_random")
# narrow it down. Without OELM_DATA the stories come from shared/data/tinystories beside or inside
# the checkout when there is one, else from the Hugging Face hub (the parameter files' source).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
RESULTS="${1:-runs/ablations}"
shift || true
# Offline stories and tokenizer files (tiktoken's GPT-2 BPE), if the checkout has them beside or inside it.
if [ -z "${OELM_DATA:-}" ]; then
  for d in "$REPO/shared/data/tinystories" "$REPO/../shared/data/tinystories"; do
    if [ -d "$d" ]; then export OELM_DATA="$d"; break; fi
  done
fi
if [ -z "${TIKTOKEN_CACHE_DIR:-}" ]; then
  for d in "$REPO/shared/data/tokenizer/tiktoken_cache" "$REPO/../shared/data/tokenizer/tiktoken_cache"; do
    if [ -d "$d" ]; then export TIKTOKEN_CACHE_DIR="$d"; break; fi
  done
fi
PYTHON="${PYTHON:-python}"
SEEDS="${SEEDS:-0 1}"
BUDGET_S="${BUDGET_S:-450}"
start=$(date +%s)
status=0
"$PYTHON" -c "import torch; print('torch', torch.__version__, '| device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
# shellcheck disable=SC2086
"$PYTHON" -m oelm_core.sweep ablations --out "$RESULTS" --seeds $SEEDS --budget-s "$BUDGET_S" \
  ${ONLY:+--only $ONLY} "$@" || status=$?
echo "total wall time: $(( $(date +%s) - start ))s; results in $RESULTS (ablations.md, ablations.json, ablations.png)"
exit $status
