"""Stopping a training cleanly on a signal: a scheduler's warning before a time limit or preemption,
SIGTERM, or Ctrl-C.

SLURM sends a job its warning signal (``#SBATCH --signal=B:USR1@SECONDS``; oelm_core.runner.slurm's
job script forwards it to the training) and SIGTERM when it ends a job (scancel, the time limit, a
preemption); torchrun forwards both to its workers; a terminal sends SIGINT. Killed there, a run
loses every step since its last checkpoint. Instead the handler here only sets a flag: the
training loop reads it at the next step boundary, saves a step checkpoint (atomically, as every
checkpoint) and ends the session with the status "preempted" and the exit status
``EXIT_PREEMPTED``; ``--resume`` continues from that checkpoint along the very curve of an
uninterrupted run.

Where that boundary does not come, the process ends at once, with the exit status 128 + the
signal's number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1), as a shell reports a process
that a signal ended: on a second signal of the same kind (Ctrl-C twice), or when no boundary
came within ``StopRequest.wait_s`` (a step that runs for hours: the context far beyond the
preset's). SLURM's SIGTERM after its warning SIGUSR1 does not cut the checkpoint short. A watcher thread does this,
woken by the signal itself (``signal.set_wakeup_fd``), so it acts while the main thread is deep
in one long PyTorch operation, where Python runs no signal handler until the operation returns.

Under DDP every rank must stop at the same step (the checkpoint is a collective): ranks agree on
the flag at the steps that synchronise anyway (the logged ones, every train.log_every steps), so
the warning must leave time for that many steps and a checkpoint.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from oelm_core.distributed import Dist

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
# sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry"): what a session
# that stopped on a signal, its checkpoint saved, is.
EXIT_PREEMPTED = 75
# How long a stop signal waits for the step boundary, at least: a first step compiles and
# captures (CUDA graphs) for up to a minute; later ones wait WAIT_STEPS times the time the
# steps up to the next boundary take (``StopRequest.wait_s``).
MIN_WAIT_S = 60.0
WAIT_STEPS = 3.0


def exit_status(signum: int) -> int:
    """A process that ``signum`` ended at once exits with this (the shell's convention)."""
    return 128 + signum


class StopRequest:
    """Whether a stop signal has arrived (``signal``: its name, e.g. "SIGUSR1"; None: none).

    ``seconds_per_step`` (the loop's latest measure) and ``steps_apart`` (how many steps' time may
    pass between two boundaries where it can stop) decide ``wait_s``; ``stopping()`` says that the
    loop reached its boundary and is saving the checkpoint."""

    def __init__(self, steps_apart: float = 1) -> None:
        self.signal: Optional[str] = None
        self.steps_apart = steps_apart
        self.seconds_per_step: Optional[float] = None
        self.boundary = threading.Event()

    @property
    def wait_s(self) -> float:
        """How long after a first signal the process waits for the step boundary."""
        if self.seconds_per_step is None:
            return MIN_WAIT_S
        return max(MIN_WAIT_S, WAIT_STEPS * self.seconds_per_step * self.steps_apart)

    def stopping(self) -> None:
        self.boundary.set()

    def agreed(self, d: Dist, sync: bool) -> bool:
        """Whether the run stops after this step. One process: at any step. Under DDP: at the
        steps where ``sync`` (the ranks synchronise there anyway), when any rank got a signal."""
        if not d.enabled:
            stop = self.signal is not None
        elif not sync:
            return False
        else:
            flag = torch.tensor([float(self.signal is not None)], device=d.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            self.stopping()
        return stop


@contextmanager
def stop_on_signals(
    signals: tuple[signal.Signals, ...] = STOP_SIGNALS, steps_apart: float = 1
) -> Iterator[StopRequest]:
    """Within the block, the first of ``signals`` to arrive sets the StopRequest's flag; the same
    signal again, or none of the loop's step boundaries within ``wait_s``, ends the process at
    once (``exit_status``). Afterwards every handler is as it was.

    Signal handlers belong to the main thread: a training in another thread (the app's, a
    notebook's helper) runs without them, as before."""
    request = StopRequest(steps_apart)
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in signals}
    previous = {s: (signal.SIG_DFL if h is None else h) for s, h in previous.items()}  # None: set outside Python

    def handler(signum: int, frame) -> None:
        # No logging here: the signal may arrive while this thread holds the logging lock.
        request.signal = request.signal or signal.Signals(signum).name

    read, write = os.pipe()
    os.set_blocking(write, False)
    watcher = threading.Thread(target=_watch, args=(read, request, set(signals)), name="oelm-stop-signals", daemon=True)
    watcher.start()
    woken = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    try:
        for s in signals:
            signal.signal(s, handler)
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(woken)
        os.close(write)  # the watcher reads the end of the pipe and returns
        watcher.join()
        os.close(read)


def _watch(read: int, request: StopRequest, signals: set[int]) -> None:
    """The watcher thread: reads the signal numbers the C-level handler writes to ``read`` (every
    signal Python handles), and ends the process on one of ``signals`` that came before, or where
    the loop's boundary (``request.boundary``) does not come within ``request.wait_s`` of the
    first."""
    first: Optional[tuple[int, float]] = None
    seen: set[int] = set()
    while True:
        timeout = None
        if first is not None and not request.boundary.is_set():
            timeout = max(0.0, first[1] + request.wait_s - time.monotonic())
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:  # the wait ran out: no boundary came
            _end_now(first[0], f"no step boundary came within {request.wait_s:.0f} s of it")
        data = os.read(read, 64)
        if not data:  # the block ended: the write end was closed
            return
        for signum in data:
            if signum not in signals:
                continue
            request.signal = request.signal or signal.Signals(signum).name
            if signum in seen:
                _end_now(signum, f"the second {signal.Signals(signum).name}")
            seen.add(signum)
            first = first or (signum, time.monotonic())


def _end_now(signum: int, why: str) -> None:
    """End the process at once (no Python unwinding: the main thread may be inside one long
    operation), saying why on stderr. The run resumes from its latest checkpoint; what killed
    writes left there, the next session removes."""
    name = signal.Signals(signum).name
    os.write(
        2,
        (
            f"\nstopped at once by {name} ({why}): the run resumes from its latest checkpoint with "
            f"--resume; exit status {exit_status(signum)}\n"
        ).encode(),
    )
    os._exit(exit_status(signum))
