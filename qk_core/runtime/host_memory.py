"""Keep freed host memory in a process that runs model forwards on the CPU (glibc's malloc).

A backbone forward on the CPU allocates and frees activations of a few to tens of MB in every layer. By default
glibc serves such blocks with ``mmap`` above an adaptive threshold and hands the top of its heap back to the system
once a few tens of MB lie free there; the next forward then faults the same pages in again, zeroed, and how many
depends on the allocation history (the capture's forwards, with more allocations between them, faulted more).
:func:`keep_freed_memory` fixes both thresholds, so freed blocks stay in the heap for the next forward;
:func:`release_freed_memory` hands what lies free back once the forwards are done. Measured on four 2K-token SmolLM2
forwards on 2 cores (bench/results/capture_cpu_moments_2048_9ce47fc.md against ..._2048_system.md): 0.7-1.7 million
minor page faults a pass before, 6-71 thousand after; the plain pass 3% faster, the capture 4%.

Elsewhere than glibc on Linux both do nothing. ``QK_HOST_MALLOC=system`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit (half its heap size): larger blocks stay mmapped
TRIM_THRESHOLD = 2**30  # free bytes at the heap's top before it shrinks: the forwards' working set stays
POLICIES = ("keep", "system")


def policy() -> str:
    """``QK_HOST_MALLOC``: ``keep`` (default) or ``system`` (glibc's adaptive defaults)."""
    value = os.environ.get("QK_HOST_MALLOC", "").strip() or "keep"
    if value not in POLICIES:
        raise ValueError(f"environment variable QK_HOST_MALLOC: {value!r} is not one of {POLICIES}")
    return value


@cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None  # musl and others
    return libc


_kept = False  # keep_freed_memory() set the thresholds in this process


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (the policy allowing; once is enough): whether they
    are set."""
    global _kept
    libc = _glibc()
    if not _kept and libc is not None and policy() == "keep":
        _kept = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                            TRIM_THRESHOLD))
    return _kept


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the system (``malloc_trim``) where :func:`keep_freed_memory` kept it:
    whether any was released."""
    libc = _glibc()
    return bool(_kept and libc is not None and libc.malloc_trim(0))
