"""Which settings of a run shape what it learns, and which only how it executes.

A resume may change the second kind (``RESUMABLE_CHANGES``, checked by ``oelm_core.resume``); two
runs are the same training when the first kind agrees (``trained_settings``): the runner tells a
run folder's run from the planned one by it, the analysis the seeds of one setup from other
setups, the tuner the shape its runs trained.
"""

from __future__ import annotations

import dataclasses

from oelm_core.config import run_config_from_dict

# What --resume may change: where and how fast the steps run, how often the run reports, and
# how long it goes on. Everything else shapes the curve (seed, batch, optimiser, schedule, data)
# and must be the run's own, or the resumed run would continue a curve it is not part of. How
# long it goes on shapes the curve too where the schedule reads train.steps (the cosine ends
# there): oelm_core.resume.check_resumable refuses a change that moves the learning
# rate of the steps to come. grad_accum may change only with the number of processes, so that
# world size x grad_accum, the global batch, stays the run's own (check_resumable refuses any
# other change): W ranks with accumulation A draw exactly what one process with W x A does. EXECUTION_KEYS
# below reads this too.
RESUMABLE_CHANGES = {
    "train": {
        "steps",
        "stop_after",
        "eval_every",
        "ckpt_every",
        "keep_last",
        "log_every",
        "early_stop_patience",
        "progress",
        "device",
        "dtype",
        "compile",
        "cuda_graph",
        "backend",
        "ddp_bucket_mb",
        "grad_exchange",
        "grad_accum",
        "fused_loss",
        "loss_chunk_tokens",
        "fused_logits",
        "cpu_heap",
        "deterministic",
        "tensorboard",
        "ddp_timeout_s",
        "max_step_s",
    },
    "data": {"source", "out_dir", "num_proc"},  # the same stories may live elsewhere
}

# Settings that do not shape what a run learns: those a resume may change (RESUMABLE_CHANGES),
# but not the step count and the patience, which decide where a finished run ended, nor
# grad_accum, which a resume may change only to keep world size x grad_accum, the global batch
# (one process: it is the batch).
EXECUTION_KEYS = {f"{section}.{key}" for section, keys in RESUMABLE_CHANGES.items() for key in keys} - {
    "train.steps",
    "train.early_stop_patience",
    "train.grad_accum",
}


def trained_settings(params: dict) -> dict:
    """Every setting that shapes what a run learns, as {dotted key: value}, from a parameter
    mapping (a parsed parameter file or a run folder's config.yaml): the model as the preset,
    variant and overrides resolve it, so equal models written differently compare equal; the
    train and data sections without EXECUTION_KEYS. The runner tells a folder's run from the
    planned one by it, oelm_core.analysis the seeds of one setup from other setups.
    ConfigError where ``params`` do not load."""
    cfg = run_config_from_dict(params)
    flat = {f"model.{k}": v for k, v in dataclasses.asdict(cfg.model_config()).items()}
    for section in ("train", "data"):
        flat.update({f"{section}.{k}": v for k, v in dataclasses.asdict(getattr(cfg, section)).items()})
    return {k: v for k, v in flat.items() if k not in EXECUTION_KEYS}
