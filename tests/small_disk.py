"""A small file system of its own for the tests of a full disk: a tmpfs of a given size, mounted
on a folder of the test's (Linux, as root: CI runs as root on Debian); skipped where it cannot be."""

import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(folder: Path, size_kb: int):
    """``folder`` as the mount point of a ``size_kb`` KiB tmpfs for the with-block; unmounted
    afterwards. ``resize(kb)`` on the yielded object grows or shrinks it (mount -o remount)."""
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: a full disk needs a small file system of its own")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {size_kb} KiB tmpfs (needs root, as CI has): {done.stderr.strip()}")

    class Disk:
        path = folder

        @staticmethod
        def resize(kb: int) -> None:
            subprocess.run(["mount", "-o", f"remount,size={kb}k", str(folder)], check=True)

    try:
        yield Disk
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
