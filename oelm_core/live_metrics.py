"""Live training curves: TensorBoard event files beside metrics.jsonl, for a run while it trains.

    RUN/tb/events.out.tfevents.*     train/loss, train/lr, train/grad_norm, train/tokens_per_s,
                                     train/mfu, val/loss, val/ppl, val/bpb, by optimiser step

``make tensorboard`` (or ``tensorboard --logdir runs/smoke``) serves every run below a folder,
each named by its path. The values are the metrics rows' own, written when a row is written (at
log steps, from figures already read back from the device); torch's SummaryWriter queues them
to a background thread that writes and flushes the file, so a step never waits for it.

``train.tensorboard: false`` turns it off; without the ``tensorboard`` package (the
``notebooks`` extra; a CUDA image usually has it) the run trains without it and says so once.
A resumed run's writer purges the steps after the checkpoint it resumed from, as
metrics.jsonl is cut back: the curve shows each step once.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

FOLDER = "tb"
# metrics row key -> TensorBoard tag; keys absent from a row (val_* between evaluations, mfu
# without a known peak) are skipped.
TAGS = {
    "train_loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "val_loss": "val/loss",
    "val_ppl": "val/ppl",
    "val_bpb": "val/bpb",
}
FLUSH_SECS = 10  # how stale the live view may be; the writer's thread flushes this often


class LiveMetrics:
    """Writes metrics rows to ``out_dir``/tb as TensorBoard scalars; does nothing when disabled,
    on ranks other than 0, or without the tensorboard package. ``first_step``: the step this
    session starts after (a resume purges later ones left by the interrupted session)."""

    def __init__(self, out_dir: Path, enabled: bool, first_step: int = 0):
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            _say_missing(str(exc))
            return
        self.writer = SummaryWriter(
            str(Path(out_dir) / FOLDER), flush_secs=FLUSH_SECS, purge_step=first_step + 1 if first_step else None
        )

    def write(self, row: dict) -> None:
        """One metrics row (its "step" and any of TAGS' keys with a finite value)."""
        if self.writer is None:
            return
        for key, tag in TAGS.items():
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(tag, value, row["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@functools.lru_cache(maxsize=1)
def _say_missing(reason: str) -> None:
    """Once per process: a study trains many runs in one."""
    log.warning(
        "no live TensorBoard curves (%s): pip install tensorboard, or set train.tensorboard: false to silence this",
        reason,
    )
