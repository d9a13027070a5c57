"""glibc's heap settings for CPU training (oelm_core.fast.heap, switch train.cpu_heap)."""

import ctypes
import os

import pytest
from train_helpers import params, run

from oelm_core.fast.heap import keep_large_blocks_in_heap

pytestmark = pytest.mark.usefixtures("no_data_override")


def test_cpu_training_keeps_large_blocks_in_the_heap(tmp_path, folded, monkeypatch):
    """A CPU training (train.cpu_heap, on by default) raises glibc's mmap and trim thresholds
    through mallopt (one run spent a third of its CPU time faulting in the pages of freed 103 MB
    blocks again); off, it leaves them. Where the C library is not glibc, or has no mallopt,
    nothing is called and nothing fails."""
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    class Libc:
        pass

    libc = Libc()
    libc.mallopt = mallopt
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36", raising=False)
    run(params(tmp_path, folded, steps=1, ckpt_every=1, eval_every=1))
    assert calls == [(-3, 2**30), (-1, 2**30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD: 1 GiB
    calls.clear()
    run(params(tmp_path, folded, out="off", steps=1, ckpt_every=1, eval_every=1, cpu_heap=False))
    assert calls == []  # the switch off: glibc's own settings

    calls.clear()
    del libc.mallopt  # a C library without it
    assert keep_large_blocks_in_heap() is False

    def no_library(name):
        raise OSError("no C library to open")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert keep_large_blocks_in_heap() is False
    for confstr in (lambda name: "musl", lambda name: None):  # musl, macOS: not glibc
        monkeypatch.setattr(os, "confstr", confstr)
        assert keep_large_blocks_in_heap() is False
    monkeypatch.delattr(os, "confstr")  # Windows
    assert keep_large_blocks_in_heap() is False
    assert calls == []
