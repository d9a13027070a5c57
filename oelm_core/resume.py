"""What --resume checks before it continues a run, and what it restores.

A resume continues the newest step checkpoint of the run folder along the curve the run would
have followed uninterrupted, or refuses with what to change: the same model, the same settings
(only RESUMABLE_CHANGES may differ: execution and reporting), the same global batch (world size x
grad_accum), a learning-rate schedule that does not jump at the resumed step, the same stories.
A restore puts back the weights, the optimiser, the samplers' places, every rank's random state
and the run's figures (best validation loss, evaluations without improvement, wall time).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Optional

import torch

from oelm_core.checkpoint import TRAINING_KEYS, CheckpointError, load_checkpoint
from oelm_core.config import ConfigError, ModelConfig, RunConfig, TrainConfig, run_config_from_dict
from oelm_core.distributed import Dist
from oelm_core.run_folder import checkpoints, step_number
from oelm_core.run_settings import RESUMABLE_CHANGES
from oelm_core.step import lr_at

log = logging.getLogger(__name__)

# What identifies the prepared data a run trains on: meta.json's entries, stored in checkpoints.
# text_hash is the same for the same stories from the hub or a folder; content_hash is not, and
# is all that checkpoints written before text_hash existed have (prepare adds text_hash to data
# prepared before then, so the data always has one).
DATA_IDENTITY = ("text_hash", "content_hash", "train_tokens", "val_tokens")


def resume_point(cfg: RunConfig, resume: bool, world_size: int) -> Optional[tuple[Path, dict]]:
    """The newest checkpoint of ``cfg.out_dir`` and its state when resuming (None: start at step
    0), after checking that this run may continue it and that a fresh start overwrites nothing."""
    out = Path(cfg.out_dir)
    existing = checkpoints(out)
    if existing and not resume:
        raise ConfigError(
            f"{out} already holds a run (checkpoints up to step "
            f"{step_number(existing[-1])}); pass --resume to continue it, or set "
            f"out_dir to a new folder (or delete it) to start over"
        )
    if not existing:
        if resume:
            log.info("nothing to resume in %s; starting at step 0", out / "ckpt")
        return None
    path = existing[-1]
    try:
        state = load_checkpoint(path, map_location="cpu")
    except CheckpointError as exc:
        fix = (
            f"To resume from the checkpoint before it ({existing[-2].name}), delete {path}"
            if len(existing) > 1
            else f"It is the run's only checkpoint: deleting {path} makes --resume start the run again from step 0"
        )
        raise CheckpointError(f"cannot resume: {exc}. {fix}") from None
    if any(key not in state for key in TRAINING_KEYS):
        raise CheckpointError(
            f"{path} holds weights only, not a training checkpoint (best.pt?); remove it from {out / 'ckpt'}"
        )
    check_resumable(cfg, state, path, world_size)
    return path, state


def check_resumable(cfg: RunConfig, state: dict, path: Path, world_size: int) -> None:
    """Refuse a resume whose settings would continue the run along another curve."""
    config_file = Path(cfg.out_dir) / "config.yaml"
    saved_cfg = run_config_from_dict(state["run_config"])
    saved, now = saved_cfg.model_config(), cfg.model_config()
    if saved != now:
        diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(saved, f.name) != getattr(now, f.name)]
        raise ConfigError(
            f"{path} was trained with a different model (model keys {diff} differ); "
            f"resume with the run's own parameters ({config_file}) "
            f"or set out_dir to a new folder"
        )
    changed = [
        f"{section}.{key}: {getattr(getattr(saved_cfg, section), key)!r} -> {value!r}"
        for section in ("train", "data")
        for key, value in dataclasses.asdict(getattr(cfg, section)).items()
        if key not in RESUMABLE_CHANGES[section] and getattr(getattr(saved_cfg, section), key) != value
    ]
    if changed:
        raise ConfigError(
            f"{path} was trained with other settings ({'; '.join(changed)}); resume "
            f"with the run's own parameters ({config_file}) or set "
            f"out_dir to a new folder. Only these may change on resume: "
            f"{', '.join(f'{s}.{k}' for s in RESUMABLE_CHANGES for k in sorted(RESUMABLE_CHANGES[s]))}"
        )
    saved_batch = state["sampler"]["virtual_world"]
    if saved_batch != world_size * cfg.train.grad_accum:
        fix = (
            f"train.grad_accum: {saved_batch // world_size}"
            if saved_batch % world_size == 0
            else f"a number of processes that divides {saved_batch}"
        )
        raise ConfigError(
            f"{path} was trained with world size x train.grad_accum = {saved_batch} batches a "
            f"step, this run would take {world_size} x {cfg.train.grad_accum}: the global "
            f"batch shapes the curve. Resume with {fix}, or set out_dir to a new folder"
        )
    check_schedule(saved_cfg.train, cfg.train, int(state["step"]), path)


def lr_moves(step: int, before: TrainConfig, after: TrainConfig) -> bool:
    """Whether ``after`` trains the step that follows ``step`` at another learning rate than ``before``."""
    return not math.isclose(lr_at(step, before), lr_at(step, after), rel_tol=1e-9)


def check_schedule(saved: TrainConfig, tc: TrainConfig, step: int, path: Path) -> None:
    """Refuse resumable changes (train.steps) that move the learning rate of the next step:
    the resumed curve would jump there and match neither the old run nor a new one.

    Equal there, the run goes on as one started with the new settings would have: a resume
    within the warm-up, or a schedule that does not read train.steps (min_lr = lr)."""
    if not lr_moves(step, saved, tc):
        return
    was, now = lr_at(step, saved), lr_at(step, tc)
    # Only resumable keys differ here (check_resumable refused the others): name those that move it.
    moved = [
        f"train.{key} {getattr(saved, key)!r} -> {getattr(tc, key)!r}"
        for key in sorted(RESUMABLE_CHANGES["train"])
        if lr_moves(step, saved, dataclasses.replace(saved, **{key: getattr(tc, key)}))
    ]
    raise ConfigError(
        f"cannot resume {path}: {', '.join(moved)} changes the learning rate of step "
        f"{step + 1} from {was:.4g} to {now:.4g} (the cosine decays to train.min_lr at "
        f"train.steps), and the curve would jump there. Keep train.steps: {saved.steps} to "
        f"continue this run, or train from step 0 with out_dir set to a new folder. Only a run "
        f"with train.min_lr equal to train.lr (constant after warm-up) can be extended"
    )


def check_same_data(cfg: RunConfig, state: dict, path: Path, meta: dict) -> None:
    """Refuse a resume on other data than the run's: data.source and data.out_dir may change
    (the same stories may move, or come from a folder instead of the hub), the stories may
    not. Compared by text hash, or by content hash where the checkpoint predates text hashes.
    Checkpoints from before the trainer recorded its data resume unchecked. ``meta``: the
    prepared data's meta.json."""
    saved = state.get("data")
    now = {key: meta.get(key) for key in DATA_IDENTITY}
    if saved is None:
        return
    by = "text_hash" if saved.get("text_hash") else "content_hash"
    same_counts = all(saved.get(key) == now.get(key) for key in ("train_tokens", "val_tokens"))
    if same_counts and saved.get(by) == now.get(by):
        return

    def described(d: dict) -> str:
        return (
            f"{by.replace('_', ' ')} {str(d.get(by))[:12]}..., {d.get('train_tokens')} train "
            f"/ {d.get('val_tokens')} val tokens"
        )

    trained = run_config_from_dict(state["run_config"]).data
    if by == "content_hash" and same_counts:
        # The content hash of hub data is one of the dataset's name, that of a folder one of
        # its texts: the same stories, from the hub once and from a folder now, differ by it.
        unset = " and OELM_DATA unset" if os.environ.get("OELM_DATA") else ""
        raise ConfigError(
            f"cannot resume {path}: it predates text hashes and records only the content hash of its "
            f"data ({described(saved)}, from {trained.source}), which differs from that of "
            f"{cfg.data.out_dir} ({described(now)}, prepared from {meta.get('source')}). The "
            f"stories may be the same (from the hub once and from a folder now, or the other way "
            f"round), which that hash cannot tell. Resume once from the source it was trained on "
            f"(--set data.source={trained.source} data.out_dir={trained.out_dir}{unset}) until it "
            f"writes a checkpoint: that one records the text hash, which is the same from either source"
        )
    raise ConfigError(
        f"cannot resume {path}: it was trained on other data ({described(saved)}, from "
        f"{trained.source}) than {cfg.data.out_dir} holds now ({described(now)}, prepared from "
        f"{meta.get('source')}). Resume with the stories the run trained on, or train on "
        f"these from step 0 with out_dir set to a new folder"
    )


def restore_state(
    state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, samplers: list, d: Dist, seed: int
) -> None:
    """Load the weights, the optimiser state and the samplers' places of ``state`` (the model
    must have the checkpoint's parameter set: unfreeze first), and this rank's random state: the
    saved one where the world size is the run's, else a seed of its own for the resumed step."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    for sampler in samplers:
        sampler.load_state_dict(state["sampler"])
    rng = state["rng"]
    if len(rng["cpu"]) == d.world_size:
        torch.set_rng_state(rng["cpu"][d.rank])
        if d.device.type == "cuda" and len(rng["cuda"]) == d.world_size:
            torch.cuda.set_rng_state(rng["cuda"][d.rank], d.device)
    else:
        torch.manual_seed(seed + d.rank + int(state["step"]))


def ended(tc: TrainConfig, step: int, bad_evals: int) -> Optional[str]:
    """How a run at ``step`` ended ("completed", "stopped_early"), or None: it has steps to go."""
    if 0 < tc.early_stop_patience <= bad_evals:
        return "stopped_early"
    return "completed" if step >= tc.steps else None


def how_to_go_on(tc: TrainConfig, step: int, bad_evals: int) -> str:
    """What lets a run that ended train on: the settings --resume would accept."""
    at_end = step >= tc.steps
    if at_end and lr_moves(step, tc, dataclasses.replace(tc, steps=step + 1)):
        return (
            f"its learning rate has decayed to train.min_lr at train.steps ({tc.steps}) and more "
            f"steps would raise it again, which --resume refuses: to train longer, train from "
            f"step 0 with a larger train.steps and out_dir set to a new folder"
        )
    ways = ["raise train.steps"] if at_end else []
    if 0 < tc.early_stop_patience <= bad_evals:
        ways.append(f"raise train.early_stop_patience above {bad_evals} (0 turns early stopping off)")
    return " and ".join(ways) + " to go on"
