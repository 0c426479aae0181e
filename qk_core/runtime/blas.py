"""Limit the threads of the OpenBLAS libraries bundled with numpy and scipy for a block of code.

The per-head analyses (SPEC 2-4) do many small dense products (n x d by d x d, d ~ 64-256). On a machine
whose cores are already busy, threaded OpenBLAS spin-waits and these products become 10-30x slower than
single-threaded ones (measured on 2 shared cores: bench/results/pca_rotation.md); on an idle machine the
gain of a second thread is below 2x. :func:`blas_threads` sets the thread count of the OpenBLAS copies that
numpy and scipy ship (``numpy.libs`` / ``scipy.libs`` wheels) and restores it afterwards. Where no such
library is found (another BLAS, another platform) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

# (setter, getter) symbol pairs: 64-bit-integer build (numpy), 32-bit build (scipy), plain OpenBLAS.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)


@cache
def _controls() -> tuple[tuple[object, object], ...]:
    found = []
    for pkg in ("numpy", "scipy"):
        try:
            mod = importlib.import_module(pkg)
        except ImportError:
            continue
        libdir = Path(mod.__path__[0]).parent / f"{pkg}.libs"
        for path in sorted(libdir.glob("*openblas*.so*")):
            try:
                lib = ctypes.CDLL(str(path))  # the copy the process already loaded (same path)
            except OSError:
                continue
            for set_name, get_name in _SYMBOLS:
                if hasattr(lib, set_name) and hasattr(lib, get_name):
                    found.append((getattr(lib, set_name), getattr(lib, get_name)))
                    break
    return tuple(found)


def available() -> bool:
    """Whether an OpenBLAS thread control was found."""
    return bool(_controls())


@contextlib.contextmanager
def blas_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` OpenBLAS threads (None or 0: leave the setting alone)."""
    if not n:
        yield
        return
    controls = _controls()
    before = [int(get()) for _, get in controls]
    for setter, _ in controls:
        setter(int(n))
    try:
        yield
    finally:
        for (setter, _), old in zip(controls, before, strict=True):
            setter(old)


def current_threads() -> list[int]:
    """The thread count of every controlled OpenBLAS copy (empty when none was found)."""
    return [int(get()) for _, get in _controls()]
