"""The one configuration schema of the toolkit.

The CLI (`python -m oelm_core.train`), the notebooks (through papermill parameters), the study
runner and the Gradio app all read these dataclasses; nothing else holds a default. A YAML
parameter file is a nested mapping with the sections ``model``, ``data`` and ``train`` and the
top-level keys ``name``, ``out_dir``, ``preset`` and ``variant``; the keys of ``model`` override
the values of the preset and the variant. ``SamplingConfig`` holds the generation's settings.

One builder (``_build``) checks every key and type, for parameter files (read by
``parameter_files``) and for settings given in Python alike. Errors are ConfigErrors that name
the setting, its value and the fix: an unknown key lists the keys that exist, a wrong type says
which type was expected.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import struct
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import torch

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A parameter file, override or preset that cannot be used as given."""


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Shape and variant of one GPT. Defaults are the original study's Medium-512 GPT-Base."""

    vocab_size: int = 50257  # GPT-2 BPE; the output layer is padded (below) only for speed
    n_layer: int = 6
    n_head: int = 8
    d_model: int = 512
    d_ff: int = 2048  # the MLP's hidden width (4 x d_model in the study)
    block_size: int = 512  # context length in tokens; also the learned position table
    dropout: float = 0.0  # the study trained without dropout
    bias: bool = True  # biases in the MLP and LayerNorms (the study's log counts them)
    attn_bias: bool = False  # biases in the V and output projections (Q/K never have one)
    tie_embeddings: bool = True  # the output layer reuses the token embedding
    # Rows added to the embedding/output matrix so the 50,257-way matmul tiles evenly on tensor
    # cores (50,304 = 786 x 64). The extra rows are zero, receive no gradient (their logits are
    # cut before the loss) and are excluded from every parameter count. 1: no padding.
    vocab_pad_multiple: int = 64

    # --- the OELM variants -------------------------------------------------------------------
    # How W_q and W_k start: "normal" (GPT-2's N(0, 0.02)), an orthogonal construction from
    # oelm_core.orthogonal ("qr" = Haar, "svd", "householder", "cayley") or "gaussian"
    # (N(0, gain^2 / d_model), the non-orthogonal control with the orthogonal logit scale).
    qk_init: str = "normal"
    qk_gain: float = 1.0  # scale of the orthogonal/Gaussian Q/K (1.0: an isometry)
    # Which layers keep W_q, W_k frozen (stored as buffers): "none", "all", a list of indices, or
    # "first_half" / "last_half" (layers 0..n//2-1 / the last n//2: shallow / deep, any n_layer).
    freeze_qk: Union[str, list] = "none"
    # How scores are formed: "dot" (softmax(QK^T)), or the Synthesizer baselines that replace
    # QK^T by a learned (or fixed) per-head T x T logit matrix: "synth_random", "synth_factorized".
    attention: str = "dot"
    synth_rank: int = 8  # k of the factorized Synthesizer's R1 R2^T
    synth_trainable: bool = True  # False: the Synthesizer logits stay at their random init
    # POET-style learnable orthogonal Q/K: W = R W0 P with R, P block-orthogonal (0 = off).
    poet_block_size: int = 0
    poet_neumann_terms: int = 5
    poet_merge_every: int = 0  # merge R, P into W0 and reset them to I every N steps (0: never)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def frozen_layers(self) -> list[int]:
        """Indices of the layers whose Q/K are frozen."""
        if self.freeze_qk == "none" or self.freeze_qk is False:
            return []
        if self.freeze_qk == "all" or self.freeze_qk is True:
            return list(range(self.n_layer))
        if self.freeze_qk == "first_half":
            return list(range(self.n_layer // 2))
        if self.freeze_qk == "last_half":
            return list(range(self.n_layer - self.n_layer // 2, self.n_layer))
        return sorted(set(int(i) for i in self.freeze_qk))

    def validate(self) -> "ModelConfig":
        from oelm_core.orthogonal import QK_INITS  # the constructions live with their checks

        for name in (
            "vocab_size",
            "n_layer",
            "n_head",
            "d_model",
            "d_ff",
            "block_size",
            "vocab_pad_multiple",
            "synth_rank",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"n_head={self.n_head} does not divide d_model={self.d_model}: choose a head count "
                f"that divides it (e.g. {', '.join(str(h) for h in _divisors(self.d_model)[:6])})"
            )
        if not (math.isfinite(self.qk_gain) and self.qk_gain > 0):
            raise ConfigError(f"model.qk_gain must be a finite positive scale (1.0: an isometry), got {self.qk_gain}")
        for name in ("poet_block_size", "poet_merge_every"):  # 0: off
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name} must be 0 (off) or positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.qk_init not in QK_INITS:
            raise ConfigError(f"unknown model.qk_init {self.qk_init!r}; choose one of {sorted(QK_INITS)}")
        if isinstance(self.freeze_qk, str) and self.freeze_qk not in FREEZE_QK_NAMES:
            raise ConfigError(
                f"model.freeze_qk must be one of {FREEZE_QK_NAMES} or a list of layer indices, got {self.freeze_qk!r}"
            )
        if isinstance(self.freeze_qk, list) and not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.freeze_qk
        ):
            raise ConfigError(
                f"model.freeze_qk must list layer indices as integers (e.g. [0, 1]), got {self.freeze_qk!r}"
            )
        bad = [i for i in self.frozen_layers() if not 0 <= i < self.n_layer]
        if bad:
            raise ConfigError(f"model.freeze_qk names layers {bad}, but the model has layers 0..{self.n_layer - 1}")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"unknown model.attention {self.attention!r}; choose one of {ATTENTIONS}")
        if self.attention != "dot" and self.frozen_layers():
            raise ConfigError("a Synthesizer attention has no Q/K to freeze: set model.freeze_qk: none")
        if self.poet_block_size:
            if self.d_model % self.poet_block_size:
                raise ConfigError(f"model.poet_block_size={self.poet_block_size} must divide d_model={self.d_model}")
            if self.poet_neumann_terms < 1:
                raise ConfigError("model.poet_neumann_terms must be at least 1")
            if self.attention != "dot" or self.frozen_layers():
                raise ConfigError(
                    "POET (model.poet_block_size > 0) learns Q/K through R and P: it needs "
                    "model.attention: dot and model.freeze_qk: none"
                )
        return self


ATTENTIONS = ("dot", "synth_random", "synth_factorized")
FREEZE_QK_NAMES = ("none", "all", "first_half", "last_half")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and d > 1]


# Named shapes. "medium512" is the original study's; small/base/large are the roadmap's
# Small/Base/Large (small has medium512's shape: the study named it twice). "smoke" exists for
# CPU tests and the smoke study: real GPT-2 vocabulary, a model small enough for CI. "tiny" is
# for model tests on random ids: its 128-token vocabulary cannot train on GPT-2 token files.
PRESETS: dict[str, dict[str, Any]] = {
    "medium512": dict(n_layer=6, n_head=8, d_model=512, d_ff=2048, block_size=512),
    "small": dict(n_layer=6, n_head=8, d_model=512, d_ff=2048, block_size=512),
    "base": dict(n_layer=12, n_head=12, d_model=768, d_ff=3072, block_size=512),
    "large": dict(n_layer=24, n_head=16, d_model=1024, d_ff=4096, block_size=512),
    "mini": dict(n_layer=4, n_head=4, d_model=256, d_ff=1024, block_size=256),
    "smoke": dict(n_layer=2, n_head=4, d_model=64, d_ff=256, block_size=64),
    "tiny": dict(n_layer=2, n_head=2, d_model=32, d_ff=64, block_size=32, vocab_size=128),
}

# Variant name -> (one-line description, overrides of ModelConfig). Later variants register
# themselves here through `register_variant` so the CLI, notebooks and app see one list.
_VARIANT_SPECS: dict[str, tuple[str, dict[str, Any]]] = {}


def register_variant(name: str, description: str, **overrides: Any) -> None:
    names = {f.name for f in fields(ModelConfig)}
    unknown = set(overrides) - names
    if unknown:
        raise ConfigError(f"variant {name!r} sets unknown model keys {sorted(unknown)}")
    _VARIANT_SPECS[name] = (description, overrides)


register_variant("gpt_base", "GPT-Base: standard Q/K, N(0, 0.02) initialisation, trainable")
register_variant("oelm_nofreeze", "OELM-NoFreeze: Q/K start Haar-orthogonal (QR), trainable", qk_init="qr")
register_variant(
    "oelm_freeze", "OELM-Freeze: Q/K Haar-orthogonal (QR) and frozen in every layer", qk_init="qr", freeze_qk="all"
)
# Ablations (parameters/ablations/). A1: the non-orthogonal control; A7: other orthogonal constructions.
register_variant(
    "oelm_freeze_gaussian",
    "A1: frozen Gaussian Q/K, N(0, 1/d), same logit scale as orthogonal",
    qk_init="gaussian",
    qk_gain=1.0,
    freeze_qk="all",
)
register_variant(
    "oelm_freeze_illcond",
    "frozen ill-conditioned Q/K: condition number 100 at the orthogonal's "
    "Frobenius norm (does orthogonality itself matter?)",
    qk_init="illcond",
    freeze_qk="all",
)
register_variant(
    "oelm_freeze_svd", "A7: frozen orthogonal Q/K from the SVD polar factor (Haar)", qk_init="svd", freeze_qk="all"
)
register_variant(
    "oelm_freeze_householder",
    "A7: frozen orthogonal Q/K from d random Householder reflections",
    qk_init="householder",
    freeze_qk="all",
)
register_variant(
    "oelm_freeze_cayley",
    "A7: frozen orthogonal Q/K from the Cayley transform of a random skew matrix",
    qk_init="cayley",
    freeze_qk="all",
)
# Synthesizer baselines (Tay et al. 2021): no Q/K, input-independent causal per-head T x T logits.
register_variant(
    "synth_random", "Synthesizer (random): learned per-head T x T attention logits, causal", attention="synth_random"
)
register_variant(
    "synth_random_fixed",
    "Synthesizer (random, fixed): per-head T x T logits frozen at init",
    attention="synth_random",
    synth_trainable=False,
)
register_variant(
    "synth_factorized",
    "Synthesizer (factorized): learned per-head logits R1 R2^T of rank 8",
    attention="synth_factorized",
    synth_rank=8,
)
# Layer-wise freezing: orthogonal Q/K everywhere, frozen in half of the layers.
register_variant(
    "oelm_freeze_shallow",
    "Layer-wise: orthogonal Q/K frozen in the first half of layers, deep trainable",
    qk_init="qr",
    freeze_qk="first_half",
)
register_variant(
    "oelm_freeze_deep",
    "Layer-wise: orthogonal Q/K frozen in the last half of layers, shallow trainable",
    qk_init="qr",
    freeze_qk="last_half",
)
# POET (arXiv 2506.08001): W = R W0 P, R and P learned block-orthogonal; singular values fixed.
register_variant(
    "oelm_poet",
    "POET: learnable orthogonal Q/K, W = R W0 P (32-blocks, Cayley-Neumann, merge/50)",
    qk_init="qr",
    poet_block_size=32,
    poet_neumann_terms=5,
    poet_merge_every=50,
)


def variants() -> dict[str, str]:
    """Variant name -> one-line description (what `oelm_core.VARIANTS` shows)."""
    return {name: desc for name, (desc, _) in _VARIANT_SPECS.items()}


def variant_overrides(name: str) -> dict[str, Any]:
    if name not in _VARIANT_SPECS:
        raise ConfigError(f"unknown variant {name!r}; choose one of {sorted(_VARIANT_SPECS)}")
    return dict(_VARIANT_SPECS[name][1])


def model_config(preset: str = "medium512", variant: str = "gpt_base", **overrides: Any) -> ModelConfig:
    """ModelConfig of a named preset and variant, with keyword overrides applied last."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    values = {**PRESETS[preset], **variant_overrides(variant), **overrides}
    return _build(ModelConfig, values, "model").validate()


# --------------------------------------------------------------------------------------------
# Data and training
# --------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where the stories come from and where their token files go."""

    # "roneneldan/TinyStories" (the hub, through `datasets`) or a local path: a folder with
    # train/ and validation/ files (.txt, .jsonl, .parquet) or a `save_to_disk` dataset.
    # The environment variable OELM_DATA overrides it (the offline CI points it at a folder).
    source: str = "roneneldan/TinyStories"
    out_dir: str = "data_cache/tinystories"  # train.bin, val.bin and meta.json go here
    max_train_stories: int = 0  # 0: all of them; >0 streams only that many from the hub
    max_val_stories: int = 0
    text_field: str = "text"  # the column of .jsonl/.parquet/hub rows that holds a story
    num_proc: int = 0  # tokenising processes (0: one per CPU core, at most 8)

    def validate(self) -> "DataConfig":
        for name in ("max_train_stories", "max_val_stories", "num_proc"):
            if getattr(self, name) < 0:
                raise ConfigError(f"data.{name} must be 0 or positive, got {getattr(self, name)}")
        return self


# train.compile "auto" compiles runs of at least this many steps: the first compile of a
# Medium-512 step costs what a few thousand of its steps save, fewer once torch's on-disk cache
# holds it (benchmarks/README.md: the compile time, cold and cached, and the gain), so the
# protocol's 3,000-step runs and the tests start at once and the presets' long runs compile.
COMPILE_AUTO_MIN_STEPS = 5000


@dataclass
class TrainConfig:
    """The optimiser and loop. Defaults are the original study's."""

    seed: int = 42
    steps: int = 100_000
    batch_size: int = 8  # sequences of block_size tokens per GPU per micro-step
    grad_accum: int = 1  # micro-steps per optimiser step (global batch = this x ranks x batch)
    lr: float = 3e-4
    min_lr: float = 3e-5  # cosine decay ends here
    warmup_steps: int = 2000
    # AdamW's decay of every trainable tensor of 2+ dims: Linear weights, embeddings, trainable
    # Q/K, POET's skew generators, the Synthesizer's logit tables; not biases or LayerNorm gains.
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    eval_every: int = 1000
    eval_batches: int = 20  # validation batches per evaluation
    # The validation tokens in two halves, so that no choice is reported on the data that made
    # it: every evaluation during training (early stopping, best.pt, and the sweeps that choose a
    # learning rate by it) reads the first half; the second is read only at each new best, for
    # the summary's report_val_* figures, which studies report. false: one set for both.
    report_holdout: bool = True
    ckpt_every: int = 5000
    keep_last: int = 3  # rolling checkpoints kept besides best.pt
    log_every: int = 50
    early_stop_patience: int = 0  # evaluations without a better val loss before stopping (0: off)
    # Progressive unfreezing: step -> layers whose frozen Q/K become trainable then ("all" or a list).
    unfreeze_schedule: dict = field(default_factory=dict)
    device: str = "auto"  # "auto": cuda when there is one, else cpu
    dtype: str = "auto"  # "auto": bf16 autocast on CUDA, float32 on CPU; or "float32"/"bf16"
    # torch.compile the model (falls back to eager if it fails): true, false, or "auto": on CUDA
    # for runs of at least COMPILE_AUTO_MIN_STEPS steps (see there); short runs and the CPU start
    # at once.
    compile: bool | str = "auto"
    # Capture the whole step (forward, backward, clip, AdamW; under DDP with NCCL the gradient
    # all-reduce too) in one CUDA graph after 2 warm-up steps (11 under DDP) and replay it: small
    # batches are launch-bound (oelm_core/fast/graph_step.py). Falls back to eager if capture fails.
    cuda_graph: bool = True
    backend: str = "auto"  # DDP backend: "auto" = nccl on CUDA, gloo on CPU
    # Seconds a rank waits in a collective for the others before the job stops naming the rank
    # that went silent (oelm_core.distributed); rank 0 preparing the data counts.
    ddp_timeout_s: float = 600.0
    # A step the pre-flight estimate puts above this many seconds on this device is refused
    # (oelm_core.preflight; 0: no limit).
    max_step_s: float = 300.0
    # DDP's gradient buckets, MB: each is all-reduced as soon as its gradients are ready, and
    # torch.compile splits the model at the bucket boundaries so that they are ready early. At
    # medium512 on 2 H200s 50 beat PyTorch's 25 at 8 and 16 x 512 per GPU, and 2-10 were slower
    # (benchmarks/bench_ddp.py --exchange ddp --set ddp_bucket_mb=25 times another size).
    ddp_bucket_mb: float = 50.0
    # How the CUDA GPUs of one host exchange gradients. "auto": on two GPUs by NVLink copies
    # straight into the other GPU's memory during the backward (oelm_core/fast/peer_grads.py; its
    # scaling against DDP's: benchmarks/README.md), DDP elsewhere (more GPUs, where the copies'
    # gain is not measured yet; no peer access; CPU). "ddp": always DDP. "peer": the copies on
    # any number of GPUs (each rank copies to every other), or an error.
    # Measured on NVLink only: where peer access goes over PCIe, time both before choosing.
    grad_exchange: str = "auto"
    # --- fast paths (oelm_core/fast): each applied to the plain model or step where it runs,
    # tested against the reference path, its gain on the card in benchmarks/README.md; turn
    # one off to time it or to debug the reference.
    # The output layer and the cross-entropy in slices of loss_chunk_tokens tokens, never holding
    # every logit (one slice: 8,192 x 50,304 floats instead of the batch's); Triton kernels on CUDA.
    fused_loss: bool = True
    loss_chunk_tokens: int = 8192
    fused_logits: bool = True  # Hopper, bf16: the logits GEMM computes the loss's exp() itself
    cpu_heap: bool = True  # CPU: glibc keeps freed large blocks for the next step (mallopt)
    # Bit-identical runs of one configuration on one kind of device: deterministic kernels only
    # (torch.use_deterministic_algorithms; on CUDA, SDPA's backward without atomics and a fixed
    # cuBLAS workspace). Without it a GPU run at context 512 differs from its re-run by about as
    # much as one seed from another; its cost on the card: benchmarks/README.md.
    deterministic: bool = False
    progress: bool = True  # tqdm bar on rank 0
    tensorboard: bool = True  # live curves: TensorBoard event files in out_dir/tb (oelm_core/live_metrics.py)
    # End this session after this many optimiser steps (0: run to `steps`). The LR schedule still
    # follows `steps`, so a later --resume continues the same curve (time-boxed jobs, tests).
    stop_after: int = 0

    def validate(self, n_layer: int) -> "TrainConfig":
        """Raise ConfigError for values the loop cannot use (types are checked on loading);
        ``n_layer``: the model's depth, which bounds the unfreeze schedule's layer indices."""
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "ckpt_every",
            "keep_last",
            "log_every",
            "loss_chunk_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "stop_after", "early_stop_patience", "grad_clip", "weight_decay", "min_lr"):
            if not getattr(self, name) >= 0:  # "not >=": NaN fails too
                raise ConfigError(f"train.{name} must be 0 or positive, got {getattr(self, name)}")
        if not self.max_step_s >= 0:
            raise ConfigError(f"train.max_step_s must be 0 (no limit) or positive, got {self.max_step_s}")
        for name in ("lr", "eps", "ddp_bucket_mb", "ddp_timeout_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}: the cosine "
                f"schedule decays from lr to min_lr, so min_lr must be at most lr"
            )
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(
                    f"train.{name} must be in [0, 1) (AdamW's moment decay, e.g. 0.9), got {getattr(self, name)}"
                )
        for name, allowed in (("dtype", DTYPES), ("backend", BACKENDS), ("grad_exchange", GRAD_EXCHANGES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.compile not in (True, False, "auto"):
            raise ConfigError(f"train.compile must be true, false or auto, got {self.compile!r}")
        self.unfreeze_plan(n_layer)
        return self

    def compiles(self, device_type: str) -> bool:
        """Whether the step torch.compiles the model on a ``device_type`` ("cuda", "cpu") device:
        ``compile`` itself, or for "auto" a CUDA run of at least COMPILE_AUTO_MIN_STEPS steps."""
        if self.compile == "auto":
            return device_type == "cuda" and self.steps >= COMPILE_AUTO_MIN_STEPS
        return self.compile is True

    def unfreeze_plan(self, n_layer: int) -> dict[int, Any]:
        """``unfreeze_schedule`` as {step: "all" | sorted layer list}, in step order."""
        plan = {}
        for key, layers in self.unfreeze_schedule.items():
            try:
                step = int(key)
            except (TypeError, ValueError):
                step = -1
            if step < 0:
                raise ConfigError(
                    f"train.unfreeze_schedule key {key!r} is not a step number; write "
                    f"e.g. {{1000: all}} or {{1000: [0, 1]}}"
                )
            if layers != "all":
                if not isinstance(layers, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer for i in layers
                ):
                    raise ConfigError(
                        f"train.unfreeze_schedule[{key}] must be 'all' or a list of layer "
                        f"indices in 0..{n_layer - 1}, got {layers!r}"
                    )
                layers = sorted(set(layers))
            plan[step] = layers
        return dict(sorted(plan.items()))


DTYPES = ("auto", "float32", "bf16")
BACKENDS = ("auto", "nccl", "gloo")
GRAD_EXCHANGES = ("auto", "ddp", "peer")
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def check_device(name: str, setting: str = "train.device") -> torch.device:
    """``name`` ("cpu", "cuda" or "cuda:N", not "auto") as a torch.device, after checking that
    this machine has it; a bare "cuda" keeps index None. ConfigError naming ``setting`` (where
    ``name`` was given: train.device, the demo's --device) for a name that is not a device or
    not a CPU or CUDA one, CUDA without a visible GPU, or an index past the GPUs there are.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{setting} {name!r} is not a device: choose {DEVICE_CHOICES}") from None
    if device.type not in ("cpu", "cuda"):  # mps, xla, meta...: the models run on neither
        raise ConfigError(
            f"{setting} {name!r} is not supported: OELM Lab runs on the CPU or on CUDA GPUs; choose {DEVICE_CHOICES}"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{setting} is {name!r}, but PyTorch finds no CUDA GPU on this machine: set "
                f"{setting} to cpu (or auto, which picks a GPU only when there is one)"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"{setting} is {name!r}, but this machine has {count} CUDA GPU(s), "
                f"cuda:0..cuda:{count - 1}: choose one of them, or auto"
            )
    return device


@dataclass
class RunConfig:
    """One training run: a model, its data and its loop."""

    name: str = "run"
    out_dir: str = "runs/run"  # checkpoints, metrics.jsonl, config.yaml, summary.json
    preset: str = "medium512"
    variant: str = "gpt_base"
    model: dict = field(default_factory=dict)  # overrides of the preset and variant
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def model_config(self) -> ModelConfig:
        for key in ("preset", "variant"):
            if key in self.model:
                value = self.model[key]
                raise ConfigError(
                    f"model.{key} is not a model key: preset and variant are top-level "
                    f"keys; write `{key}: {value}` beside `model:` (or --set {key}={value})"
                )
        return model_config(self.preset, self.variant, **self.model)

    def validate(self) -> "RunConfig":
        """Check the model, data and loop settings together: every entry point (CLI, study,
        sweep, notebooks) fails here, before anything runs."""
        self.data.validate()
        self.train.validate(self.model_config().n_layer)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

# Temperatures below this draw the most likely token. For them the noise (< 17) vanished in the
# float32 rounding of logits / T wherever |logit| > 1e-3 (the draw was greedy already, ties
# aside), and logits / T overflowed to +inf for every logit above 3.4e38 * T, where argmax took
# the first of those, not the largest.
GREEDY_BELOW = 1e-12


@dataclass
class SamplingConfig:
    """How ``oelm_core.generate`` draws new tokens (the demo's settings, and any caller's)."""

    max_new_tokens: int = 200
    temperature: float = 0.8  # 0 (or below GREEDY_BELOW) picks the most likely token (greedy)
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1.0: no nucleus cut
    seed: Optional[int] = None  # None: a fresh random seed per call
    stop_at_eot: bool = True
    use_cache: bool = True
    fast: bool = True  # oelm_core.fast.decoder: the fast decoder where it runs; same tokens

    def validate(self) -> "SamplingConfig":
        """Raise ConfigError for a setting of the wrong type (the schema's builder checks them, as
        it checks every setting; a float max_new_tokens never equals a count of tokens, a float
        top_k reached torch.topk as a bare TypeError) or out of its range; returns self."""
        _build(
            SamplingConfig,
            dataclasses.asdict(self),
            "sampling",
            fix="pass one as SamplingConfig({key}=...)",
            yaml_numbers=False,
        )
        for key, ok, must, fix in (
            ("max_new_tokens", self.max_new_tokens >= 1, "be at least 1", "ask for 1 or more new tokens"),
            (
                "temperature",
                math.isfinite(self.temperature) and self.temperature >= 0,
                "be a finite number >= 0 (0 is greedy)",
                "use e.g. 0.8, or 0 for the most likely token",
            ),
            ("top_k", self.top_k >= 0, "be >= 0 (0 disables it)", "use e.g. 50, or 0 for no cut"),
            ("top_p", 0.0 < self.top_p <= 1.0, "be in (0, 1]", "use e.g. 0.9, or 1.0 for no cut"),
        ):
            if not ok:
                raise ConfigError(f"sampling.{key} must {must}, got {getattr(self, key)!r}; {fix}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether every draw is the most likely token: temperature 0 or below ``GREEDY_BELOW``."""
        return self.temperature < GREEDY_BELOW

    @property
    def inv_temperature(self) -> float:
        """1 / T rounded to float32: every path scales the logits by this one float32 multiply.
        (struct, not a tensor: the uncached path asks once per token.)"""
        return struct.unpack("f", struct.pack("f", 1.0 / self.temperature))[0]

    def top_k_for(self, vocab: int) -> int:
        """The top-k cut over ``vocab`` ids; 0 where there is none (off, or k >= vocab)."""
        return self.top_k if 0 < self.top_k < vocab else 0


# --------------------------------------------------------------------------------------------
# Loading, checking and overriding
# --------------------------------------------------------------------------------------------


def _type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` asks for. A whole number of any integer type (a
    NumPy one too) is an int, any real one a float; a bool is neither (True would pass as 1)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _yaml_float(text: str, where: str) -> float:
    """YAML 1.1 (PyYAML) reads 3e-4, without a dot, as a string: take it as the number meant."""
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"{where} should be a number, got the string {text!r}; fix the value in the parameter file or --set"
        ) from None


FILE_FIX = "fix the value in the parameter file or --set"


def _build(cls: type, values: dict, where: str, *, fix: str = FILE_FIX, yaml_numbers: bool = True):
    """Instantiate dataclass ``cls`` from ``values``, checking every key and type: the schema's
    one builder. A ConfigError names the dotted key (``where``.key), the value and ``fix`` (its
    ``{key}``: the key). ``yaml_numbers``: the values come from YAML, whose 1.1 reading leaves
    3e-4 a string; a string where a float belongs is taken as the number meant."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a mapping of keys to values, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(values) - set(known))
    moved = [k for k in unknown if cls is ModelConfig and k in MOVED_MODEL_KEYS]
    if moved:
        raise ConfigError(
            f"{where}.{moved[0]} is no longer a model setting: the model computes the plain "
            f"loss, and the fused loss is a fast path switched by train.fused_loss and "
            f"train.loss_chunk_tokens (from Python: oelm_core.fast.loss.install(model, chunk))"
        )
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; "
            f"valid keys in {where}: {', '.join(sorted(known))}"
        )
    kwargs = {}
    for key, value in values.items():
        hint = hints[key]
        if value is None and (dataclasses.is_dataclass(hint) or hint is dict):
            value = {}  # a section whose keys are all commented out
        if hint is float and isinstance(value, str) and yaml_numbers:
            value = _yaml_float(value, f"{where}.{key}")
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value, f"{where}.{key}", fix=fix, yaml_numbers=yaml_numbers)
        elif not _type_ok(value, hint):
            raise ConfigError(
                f"{where}.{key} should be {_type_name(hint)}, got {type(value).__name__} "
                f"{value!r}; {fix.format(key=key)}"
            )
        elif hint is float:
            value = float(value)
        elif hint is int:
            value = int(value)
        kwargs[key] = value
    return cls(**kwargs)


def build_section(cls: type, values: dict, where: str):
    """A dataclass ``cls`` from the mapping ``values``, every key and type checked by the one
    builder of this schema (messages name ``where``.KEY): the runner's plan and SLURM sections
    (oelm_core.runner.plan) are built by it too."""
    return _build(cls, values, where)


# Model keys that became train keys (execution switches, not the model's shape): old parameter
# files and the run configs inside old checkpoints still load. old key -> (new key, new value).
MOVED_MODEL_KEYS = {
    "loss_impl": ("fused_loss", lambda impl: impl != "full"),
    "loss_chunk_tokens": ("loss_chunk_tokens", lambda n: n),
}
# Switches of fast paths deleted because they saved under 2% of a step (benchmarks/README.md):
# execution settings, not the curve's, so a run folder or parameter file that sets them loads
# without them.
REMOVED_TRAIN_KEYS = ("cublaslt", "fused_clip", "tied_grad_split", "compile_tuning")


def upgrade_keys(values: dict) -> dict:
    """A copy of a parameter mapping with MOVED_MODEL_KEYS moved from ``model`` to ``train`` and
    REMOVED_TRAIN_KEYS dropped; for ``model_config`` mappings (a checkpoint's), see
    ``model_config_from_dict``."""
    model, train = values.get("model"), values.get("train")
    moved = isinstance(model, dict) and set(model) & set(MOVED_MODEL_KEYS)
    removed = isinstance(train, dict) and set(train) & set(REMOVED_TRAIN_KEYS)
    if not (moved or removed):
        return values
    values = {**values, "train": dict(train or {})}
    if moved:
        values["model"] = dict(model)
        for old, (new, convert) in MOVED_MODEL_KEYS.items():
            if old in values["model"]:
                value = values["model"].pop(old)
                values["train"].setdefault(new, convert(value) if isinstance(value, (str, int)) else value)
                log.info(
                    "model.%s is now train.%s (an execution switch, not the model's shape); read as train.%s: %r",
                    old,
                    new,
                    new,
                    values["train"][new],
                )
    for key in sorted(removed or ()):
        del values["train"][key]
        log.info(
            "train.%s is ignored: that fast path was removed (it saved under 2%% of a step; benchmarks/README.md)", key
        )
    return values


def model_config_from_dict(values: dict) -> ModelConfig:
    """A checked ModelConfig from a full mapping (a checkpoint's ``model_config``), ignoring the
    keys that moved to TrainConfig."""
    values = {k: v for k, v in values.items() if k not in MOVED_MODEL_KEYS}
    return _build(ModelConfig, values, "model_config").validate()


def run_config_from_dict(values: dict) -> RunConfig:
    """A RunConfig from a nested mapping (a parsed YAML file), with every key checked."""
    return _build(RunConfig, upgrade_keys(values or {}), "params").validate()
