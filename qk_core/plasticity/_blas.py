"""Best-effort limit on OpenBLAS threads while a head is analysed (no effect on any value).

The per-head products are small (hundreds of rows); multithreaded BLAS spends more time waking and
synchronising threads than computing, badly so on a shared machine (measured 3-5x slower with 2
threads on 2 busy cores). :func:`blas_threads` sets the thread count of every OpenBLAS library loaded
in the process (found in ``/proc/self/maps``, as threadpoolctl does) and restores it afterwards. Where
no OpenBLAS is found (other BLAS, other OS) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from functools import cache

_NAMES = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads"))


@cache
def _controls() -> tuple[tuple[object, object], ...]:
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln})
    except OSError:
        return ()
    out = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get, set_ in _NAMES:
            g, s = getattr(lib, get, None), getattr(lib, set_, None)
            if g is not None and s is not None:
                g.restype = ctypes.c_int
                s.argtypes = [ctypes.c_int]
                out.append((g, s))
                break
    return tuple(out)


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block with at most ``n`` OpenBLAS threads (``None``: leave the setting alone)."""
    if n is None:
        yield
        return
    import numpy  # noqa: F401  (its OpenBLAS must be loaded to be found)

    ctl = _controls()
    before = [g() for g, _ in ctl]
    for _, s in ctl:
        s(int(n))
    try:
        yield
    finally:
        for (_, s), b in zip(ctl, before, strict=True):
            s(int(b))
