"""Shared test set-up: the offline GPT-2 BPE files, and tiny corpora the tests write themselves."""

import functools
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_SHARED_TOKENIZER = REPO.parent / "shared" / "data" / "tokenizer" / "tiktoken_cache"

# tiktoken reads TIKTOKEN_CACHE_DIR when it first loads an encoding; CI sets it, and a developer
# checkout beside ../shared gets it here so `pytest` alone works too.
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TOKENIZER.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TOKENIZER)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip where torch sees no CUDA device, except those also marked
    ``interpreter``: their Triton kernels then run under Triton's CPU interpreter."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and "interpreter" not in item.keywords:
            item.add_marker(no_gpu)


# Triton's CPU interpreter runs every kernel here with Triton 3.7 and 3.8 (pyproject.toml's
# `interpreter` extra, which `make` installs beside a CPU torch). Known not to, by version:
# 3.5 and 3.6 with numpy >= 2.4 (they turn one-element arrays into Python scalars, which numpy 2.4
# refuses: "only 0-dimensional arrays can be converted"), and 3.9 for kernels that combine a
# boolean tensor and a boolean scalar into a mask (it makes an int32 mask that its own load
# refuses: "mask has unsupported dtype"). Any other failure fails the test.
INTERPRETER_NUMPY_FIXED = "3.7"  # first Triton whose interpreter runs with numpy >= 2.4
INTERPRETER_BOOL_MASKS_BROKEN = "3.9"  # first Triton whose interpreter refuses the boolean masks


def triton_interpreter_unusable(bool_scalar_masks: bool) -> str | None:
    """Why this Triton and numpy cannot run the kernels under the interpreter, or None."""
    from importlib.metadata import version

    from packaging.version import Version

    triton, numpy = Version(version("triton")), Version(version("numpy"))
    fix = "install a Triton the interpreter runs with: pip install -e '.[interpreter]'"
    if triton < Version(INTERPRETER_NUMPY_FIXED) and numpy >= Version("2.4"):
        return f"Triton {triton}'s CPU interpreter does not run with numpy {numpy} (>= 2.4); {fix}"
    if bool_scalar_masks and triton >= Version(INTERPRETER_BOOL_MASKS_BROKEN):
        return f"Triton {triton}'s CPU interpreter refuses these kernels' boolean masks; {fix}"
    return None


def run_in_triton_interpreter(script: Path, check: str, *args: str, bool_scalar_masks: bool = False) -> None:
    """``check(*args, "cpu")`` of the test module ``script`` under Triton's CPU interpreter
    (TRITON_INTERPRET=1 must be set before any kernel is defined, hence a subprocess); it must
    pass. Skipped, by version, where this Triton's interpreter is known not to run kernels like
    these (``bool_scalar_masks``: a mask made of a boolean tensor and a boolean scalar, as the
    sampler and the decode step have).

    The first call runs every check the module lists in ``INTERPRETER_CHECKS``, in one process
    (``_interpreter_results``); the others read their results. A process a check costs ~2.5 s
    of CPU for its imports alone, a third of these tests' time in CI."""
    reason = triton_interpreter_unusable(bool_scalar_masks)
    if reason:
        pytest.skip(reason)
    results, output = _interpreter_results(Path(script))
    key = " ".join((check, *args))
    assert key in results, f"{key!r} did not run (not in {Path(script).name}'s INTERPRETER_CHECKS?):\n{output}"
    if results[key] is not None:
        pytest.fail(f"{key} failed under Triton's CPU interpreter:\n{results[key]}", pytrace=False)


@functools.cache
def _interpreter_results(script: Path) -> tuple[dict, str]:
    """``python script RESULTS`` under the interpreter: ({check and args: None where it passed,
    else its traceback}, the process's output)."""
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        proc = subprocess.run(
            [sys.executable, str(script), str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800
        )
        results = json.loads(out.read_text()) if out.is_file() else {}
    return results, f"exit status {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run_interpreter_checks(namespace: dict, out: str) -> None:
    """The interpreter process's work (a test module's ``__main__``): every check of
    ``namespace["INTERPRETER_CHECKS"]`` ((name, *args) each) on the CPU, each failure's
    traceback kept, the results written to ``out`` as JSON."""
    results = {}
    for name, *args in namespace["INTERPRETER_CHECKS"]:
        try:
            namespace[name](*args, "cpu")
            results[" ".join((name, *args))] = None
        except Exception:
            results[" ".join((name, *args))] = traceback.format_exc()
    Path(out).write_text(json.dumps(results))


STORIES = [
    "Once upon a time there was a little cat named Tom. Tom liked to play in the sun.",
    "Lily had a red ball. She threw it high and her dog ran to get it. They were happy.",
    "The big tree was very old. One day a bird made a nest in it and sang every morning.",
    "Ben wanted to fly a kite. The wind was strong, so the kite went up and up.",
    "Sue found a shiny stone by the river. She gave it to her mom, who smiled.",
    "A small boat sailed on the lake. A fish jumped out of the water and said hello.",
]


def write_corpus(root: Path) -> Path:
    """A corpus in the TinyStories text layout at ``root``: train/ and validation/ with
    <|endoftext|> separators."""
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    (root / "train" / "part.txt").write_text("\n<|endoftext|>\n".join(STORIES * 20) + "\n<|endoftext|>\n")
    (root / "validation" / "part.txt").write_text("<|endoftext|>".join(STORIES[:3] * 10))
    return root


@pytest.fixture
def story_folder(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "stories")


SMOKE_STUDY = REPO / "parameters" / "study_smoke.yaml"
SMOKE_STEPS = 24


@pytest.fixture(scope="session")
def smoke_study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`python -m oelm_core run parameters/study_smoke.yaml` on a tiny corpus, once per test
    session (test_study and test_notebooks check it): (its output folder, the process)."""
    base = tmp_path_factory.getbasetemp() / "smoke_study"
    write_corpus(base / "stories")
    out = base / "study"
    proc = run_smoke_study(base, out)
    (base / "study.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"study failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    return out, proc


def run_smoke_study(base: Path, out: Path, *sets: str) -> subprocess.CompletedProcess:
    """The smoke study of ``smoke_study`` (stories and token files in ``base``) into ``out``, with
    ``sets`` added as --set options."""
    env = dict(os.environ, OELM_DATA=str(base / "stories"), PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "oelm_core",
        "run",
        str(SMOKE_STUDY),
        "--out",
        str(out),
        "--set",
        f"train.steps={SMOKE_STEPS}",
        "--set",
        "train.eval_every=12",
        "--set",
        "train.log_every=4",
        "--set",
        "train.ckpt_every=24",
        "--set",
        "train.eval_batches=2",
        "--set",
        f"data.out_dir={base / 'data'}",
        "--set",
        "experiment.parameters.01_theory.d=64",
        "--set",
        "experiment.parameters.01_theory.jl_points=24",
    ]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture
def one_thread():
    """Small CPU tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The training tests fold the prepared tokens into a small vocabulary (id % FOLDED_VOCAB) except
# where the real GPT-2 vocabulary matters: the CPU time goes to the trainer, not to a 50,257-way
# output layer.
FOLDED_VOCAB = 256


@pytest.fixture
def folded(tmp_path: Path, story_folder: Path) -> Path:
    """story_folder prepared into tmp_path/data, its token ids folded to FOLDED_VOCAB. The token
    files keep their sizes and meta.json its content hash, so `prepare` in train() keeps them;
    its vocabulary becomes FOLDED_VOCAB, which the trainer checks the model against."""
    import json

    import numpy as np

    from oelm_core.config import DataConfig
    from oelm_core.data import prepare

    data = DataConfig(source=str(story_folder), out_dir=str(tmp_path / "data"), num_proc=1)
    meta = prepare(data, progress=False)
    for split in ("train", "val"):
        path = tmp_path / "data" / f"{split}.bin"
        (np.fromfile(path, dtype=np.uint16) % FOLDED_VOCAB).astype(np.uint16).tofile(path)
    (tmp_path / "data" / "meta.json").write_text(json.dumps({**meta, "vocab_size": FOLDED_VOCAB}))
    return story_folder


@pytest.fixture
def no_data_override(monkeypatch):
    """No OELM_DATA from the environment: the training tests name their own corpora; no
    OELM_PEAK_FLOPS: no MFU unless a test gives a peak."""
    monkeypatch.delenv("OELM_DATA", raising=False)
    monkeypatch.delenv("OELM_PEAK_FLOPS", raising=False)
