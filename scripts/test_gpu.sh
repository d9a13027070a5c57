#!/usr/bin/env bash
# The GPU tests (pytest marker `gpu`: the Triton loss, logits-GEMM, decode and sampling
# kernels on CUDA, CUDA-graph capture, the two-GPU exchange), which CI cannot run, on this
# machine's GPUs; then one summary: card(s), torch and Triton, date, commit, passed / failed /
# skipped. Run it at the end of every change that touches a fast path:
#
#   make test-gpu                      # in the project's venv (made if missing)
#   make test-gpu PYTHON_BIN=python3   # a Python that already has torch, Triton and pytest (no venv,
#                                      # no pip: e.g. a GPU machine without network)
#   scripts/test_gpu.sh -x -k decode   # further arguments go to pytest
#
# The two-GPU tests need two GPUs (skipped with one). The training tests among them tokenize a
# small corpus with GPT-2's BPE: offline, set TIKTOKEN_CACHE_DIR (or keep ../shared/data beside
# the checkout, as `make` and tests/conftest.py find it). The commit is OELM_COMMIT if set (a copy
# of the tree without .git), else git's. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_BIN:-python3}
if ! "$PY" -c "import torch, pytest" 2>/dev/null; then
    echo "test_gpu.sh: $PY cannot import torch and pytest; set PYTHON_BIN to a Python that has them" >&2
    exit 2
fi
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT

"$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$report/gpu.xml" "$@"
status=$?

commit=${OELM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -z "${OELM_COMMIT:-}" ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    commit="$commit + uncommitted changes"
fi
"$PY" - "$report/gpu.xml" "$status" "$commit" <<'EOF'
import datetime
import sys
import xml.etree.ElementTree as ET

import torch

path, status, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    counts = (f"{passed} passed, {count['failures']} failed, {count['errors']} errors, "
              f"{count['skipped']} skipped")
except (OSError, ET.ParseError):
    counts = "no results (pytest did not get to write them)"
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
cards = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print()
print("== GPU tests (pytest -m gpu) ==")
print(f"cards:   {', '.join(cards) if cards else 'none visible: every CUDA-only test was skipped'}")
print(f"torch:   {torch.__version__} (CUDA {torch.version.cuda}), Triton {triton_version}")
print(f"date:    {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
print(f"commit:  {commit}")
print(f"result:  {counts} (pytest exit status {status})")
EOF
exit "$status"
