"""oelm_core.fast: what ``fast.apply`` installs for each training switch and device, and that the
reference modules import no fast path that loads Triton or the cuBLASLt binding."""

import json
import subprocess
import sys

import pytest
import torch

from oelm_core import build_model, fast
from oelm_core.config import TrainConfig
from oelm_core.fast import linear
from oelm_core.fast.loss import ChunkedOutputLoss
from oelm_core.model import MLP, CausalSelfAttention, OutputLoss

REFERENCE_MODULES = ["oelm_core", "oelm_core.model", "oelm_core.config", "oelm_core.generate", "oelm_core.data",
                     "oelm_core.accounting", "oelm_core.checkpoint"]
# What loads Triton or the ctypes binding of cuBLASLt (or is Triton).
LOADERS = ["triton", "oelm_core.fast.cublaslt", "oelm_core.fast.ce_kernels", "oelm_core.fast.logits_gemm",
           "oelm_core.fast.linear"]
IMPORTS = "\n".join(f"import {m}" for m in REFERENCE_MODULES + ["oelm_core.fast", "oelm_core.fast.loss"])
# A fresh interpreter: which LOADERS it holds after importing the reference modules and the fast
# package, after a CPU training step with the fast paths installed, and after installing them for CUDA.
PROBE = f"""
import json, sys
def loaded():
    print(json.dumps(sorted(name for name in {LOADERS!r} if name in sys.modules)))
{IMPORTS}
loaded()
import torch
from oelm_core import build_model, fast
from oelm_core.config import TrainConfig
model = fast.apply(build_model("tiny"), TrainConfig(), torch.device("cpu"))
x = torch.zeros(1, 8, dtype=torch.long)
model(x, x).backward()
loaded()
fast.apply(model, TrainConfig(), torch.device("cuda"))
loaded()
"""


@pytest.fixture(scope="module")
def loaded() -> list[list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()[-3:]]


def test_importing_the_reference_modules_loads_no_triton_nor_the_binding(loaded):
    assert loaded[0] == []


def test_a_cpu_training_step_with_the_fast_paths_loads_none_of_them(loaded):
    # (Triton itself may come with torch._dynamo, which the fused loss imports when it is
    # installed, to stay out of compiled graphs: torch imports Triton wherever it is installed.)
    ours = [[name for name in names if name != "triton"] for names in loaded]
    assert ours[1] == []
    # The probe sees what a fast path imports where it is installed: the module swaps on CUDA.
    assert ours[2] == ["oelm_core.fast.cublaslt", "oelm_core.fast.linear"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("cublaslt", [True, False])
def test_apply_installs_what_the_switches_ask_where_it_runs(device, fused_loss, cublaslt):
    """The fused loss on any device (its settings from TrainConfig), the cuBLASLt module swaps on
    CUDA only; switched off, the reference modules stay. (Class swaps: no GPU needed to check.)"""
    tc = TrainConfig(fused_loss=fused_loss, cublaslt=cublaslt, fused_logits=False, loss_chunk_tokens=77)
    model = build_model("tiny", "oelm_freeze")
    assert fast.apply(model, tc, torch.device(device)) is model
    if fused_loss:
        loss = model.output_loss
        assert type(loss) is ChunkedOutputLoss
        assert (loss.chunk, loss.fused_logits, loss.cublaslt, loss.vocab_size) == (77, False, cublaslt, 128)
    else:
        assert type(model.output_loss) is OutputLoss
    swapped = cublaslt and device == "cuda"
    for block in model.blocks:
        assert type(block.attn) is (linear.LtAttention if swapped else CausalSelfAttention)
        assert type(block.mlp) is (linear.LtMLP if swapped else MLP)


def test_every_switch_off_leaves_the_reference_model():
    model = build_model("tiny", "gpt_base")
    before = {name: type(m) for name, m in model.named_modules()}
    tc = TrainConfig(fused_loss=False, fused_logits=False, cublaslt=False)
    fast.apply(model, tc, torch.device("cuda"))
    assert {name: type(m) for name, m in model.named_modules()} == before
