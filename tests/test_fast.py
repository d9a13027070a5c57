"""oelm_core.fast: the one door to speed. The reference modules import nothing of it (read from
their source); what ``fast.apply`` installs for each
training switch; neither the reference modules nor a CPU training step or generation load a fast
path's Triton kernels."""

import json
import subprocess
import sys

import pytest
from import_graph import PACKAGE, imports

from oelm_core import build_model, fast
from oelm_core.config import TrainConfig
from oelm_core.fast.loss import ChunkedOutputLoss
from oelm_core.model import OutputLoss

REFERENCE_MODULES = [
    "oelm_core",
    "oelm_core.model",
    "oelm_core.config",
    "oelm_core.generate",
    "oelm_core.data",
    "oelm_core.accounting",
    "oelm_core.checkpoint",
]
# What loads Triton kernels (or is Triton).
LOADERS = [
    "triton",
    "oelm_core.fast.ce_kernels",
    "oelm_core.fast.logits_gemm",
    "oelm_core.fast.decode_kernels",
    "oelm_core.fast.sample_kernels",
]
IMPORTS = "\n".join(f"import {m}" for m in REFERENCE_MODULES + ["oelm_core.fast", "oelm_core.fast.loss"])
# A fresh interpreter: which LOADERS it holds after importing the reference modules and the fast
# package, after a CPU training step with the fast paths installed, and after the fast decoder's
# CPU generation.
PROBE = f"""
import json, sys
def loaded():
    print(json.dumps(sorted(name for name in {LOADERS!r} if name in sys.modules)))
{IMPORTS}
loaded()
import torch
from oelm_core import build_model, fast
from oelm_core.config import TrainConfig
from oelm_core.generate import SamplingConfig
model = fast.apply(build_model("tiny"), TrainConfig())
x = torch.zeros(1, 8, dtype=torch.long)
model(x, x).backward()
loaded()
tokens = list(fast.stream_tokens(model.eval(), [1, 2, 3], SamplingConfig(max_new_tokens=4, seed=0, stop_at_eot=False)))
assert len(tokens) == 4, tokens
loaded()
"""


@pytest.fixture(scope="module")
def loaded() -> list[list[str]]:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()[-3:]]


def test_importing_the_reference_modules_loads_no_triton(loaded):
    assert loaded[0] == []


def test_cpu_training_and_generation_with_the_fast_paths_load_no_kernels(loaded):
    # (Triton itself may come with torch._dynamo, which the fused loss imports when it is
    # installed, to stay out of compiled graphs: torch imports Triton wherever it is installed.)
    ours = [[name for name in names if name != "triton"] for names in loaded]
    assert ours[1:] == [[], []]


@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("fused_logits", [True, False])
def test_apply_installs_what_the_switches_ask(fused_loss, fused_logits):
    """The fused loss with its settings from TrainConfig; switched off, the reference's loss stays."""
    tc = TrainConfig(fused_loss=fused_loss, fused_logits=fused_logits, loss_chunk_tokens=77)
    model = build_model("tiny", "oelm_freeze")
    assert fast.apply(model, tc) is model
    if fused_loss:
        loss = model.output_loss
        assert type(loss) is ChunkedOutputLoss
        assert (loss.chunk, loss.fused_logits, loss.vocab_size) == (77, fused_logits, 128)
    else:
        assert type(model.output_loss) is OutputLoss


def test_every_switch_off_leaves_the_reference_model():
    model = build_model("tiny", "gpt_base")
    before = {name: type(m) for name, m in model.named_modules()}
    fast.apply(model, TrainConfig(fused_loss=False, fused_logits=False))
    assert {name: type(m) for name, m in model.named_modules()} == before


# --------------------------------------------------------------------------------------------
# The import graph (tests/import_graph.py): no cycle anywhere (tests/test_imports.py), and the
# reference path reaches no fast path
# --------------------------------------------------------------------------------------------

# The reference path: plain PyTorch, which the fast paths are tested against; it may not reach them.
REFERENCE = ("model", "step", "generate", "distributed")


def is_fast(module: str) -> bool:
    return module == "oelm_core.fast" or module.startswith("oelm_core.fast.")


def test_the_import_reader_sees_imports_at_any_depth(tmp_path):
    """The reader the rules below rely on: an import inside a function, a relative one and a
    string one are each found (a reader that missed them would pass any module)."""
    assert "oelm_core.fast.graph_step" in {m for _, m in imports(PACKAGE / "fast" / "__init__.py")}
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from . import decode\n    from .. import step\n"
        "    importlib.import_module('oelm_core.fast.heap')\n"
    )
    assert imports(probe, "oelm_core.fast.probe") == [
        (2, "oelm_core.fast.decode"),
        (3, "oelm_core.step"),
        (4, "oelm_core.fast.heap"),
    ]


@pytest.mark.parametrize("name", REFERENCE)
def test_the_reference_modules_import_nothing_of_fast(name):
    """model, step, generate and distributed reach no fast path, not even lazily: the trainer and
    the generator ask ``oelm_core.fast`` for a step, a gradient exchange and a decoder."""
    found = [(line, m) for line, m in imports(PACKAGE / f"{name}.py") if is_fast(m)]
    assert found == [], f"oelm_core/{name}.py imports {found}"


def test_the_trainer_reaches_fast_paths_through_the_door_alone():
    """oelm_core/train.py, the composition root of a training (its CLI is what
    ``python -m oelm_core.train`` runs), asks the package ``oelm_core.fast`` and no module inside
    it: which fast path runs is decided there, from the switches."""
    found = {m for _, m in imports(PACKAGE / "train.py") if is_fast(m)}
    assert found == {"oelm_core.fast"}
