"""Stopping a training cleanly on a signal: a scheduler's warning before a time limit or preemption.

SLURM sends a job its warning signal (``#SBATCH --signal=B:USR1@SECONDS``; the job script of
oelm_core.runner.slurm forwards it to the training) and SIGTERM when it ends a job (scancel, the time limit, a
preemption); torchrun forwards both to its workers. Killed there, a run loses every step since its
last checkpoint. Instead the handler here only sets a flag: the training loop reads it at the next
step boundary, saves a step checkpoint (atomically, as every checkpoint) and ends the session with
the status "preempted" and the exit status ``EXIT_PREEMPTED``; ``--resume`` continues from that
checkpoint along the very curve of an uninterrupted run. A second signal of the same kind acts as
it did before (SIGTERM: the process ends at once), so a stuck run can still be stopped.

Under DDP every rank must stop at the same step (the checkpoint is a collective): ranks agree on
the flag at the steps that synchronise anyway (the logged ones, every train.log_every steps), so
the warning must leave time for that many steps and a checkpoint.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from oelm_core.distributed import Dist

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): what a session
# that stopped on a signal, its checkpoint saved, is.
EXIT_PREEMPTED = 75


class StopRequest:
    """Whether a stop signal has arrived (``signal``: its name, e.g. "SIGUSR1"; None: none)."""

    def __init__(self) -> None:
        self.signal: Optional[str] = None

    def agreed(self, d: Dist, sync: bool) -> bool:
        """Whether the run stops after this step. One process: at any step. Under DDP: at the
        steps where ``sync`` (the ranks synchronise there anyway), when any rank got a signal."""
        if not d.enabled:
            return self.signal is not None
        if not sync:
            return False
        flag = torch.tensor([float(self.signal is not None)], device=d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Within the block, the first of ``signals`` to arrive sets the StopRequest's flag (and puts
    back the handler it had before, for a second one); afterwards every handler is as it was.

    Signal handlers belong to the main thread: a training in another thread (the app's, a
    notebook's helper) runs without them, as before."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in signals}
    previous = {s: (signal.SIG_DFL if h is None else h) for s, h in previous.items()}   # None: set outside Python

    def handler(signum: int, frame) -> None:
        # No logging here: the signal may arrive while this thread holds the logging lock.
        request.signal = signal.Signals(signum).name
        signal.signal(signum, previous[signal.Signals(signum)])

    try:
        for s in signals:
            signal.signal(s, handler)
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
