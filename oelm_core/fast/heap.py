"""glibc's heap settings for CPU training: large freed blocks stay in the heap for the next step.

Each CPU step allocates and frees the same large temporaries (a 512 x 50,304 float32 logits
slice: 103 MB). glibc serves a block above its mmap threshold (adaptive, at most 32 MB) with
fresh pages and hands them back when it is freed, so every step faults all of them in again.
With both thresholds raised the blocks stay in the heap and are reused. The price: the heap
keeps freed blocks rather than returning them to the system (a higher peak RSS), also after
training.

Switch: ``train.cpu_heap`` (CPU training only). Gain: benchmarks/README.md.
"""

from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h) and the size up to which freed blocks stay in the heap
# (mallopt takes a C int: at most 2 GiB - 1).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_BYTES = 1 << 30


def keep_large_blocks_in_heap() -> bool:
    """Make glibc keep freed blocks of up to HEAP_BLOCK_BYTES for reuse (process-wide).

    Returns whether glibc took both settings; False, changing nothing, on other C libraries
    (macOS, musl, Windows), whose allocators have other switches or none.
    """
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not that name
        glibc = False
    if not glibc:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES), mallopt(M_TRIM_THRESHOLD, HEAP_BLOCK_BYTES)])
