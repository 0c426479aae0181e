"""Strict value types and validation for every options table (issue 14; pydantic v2).

The option dataclasses (capture, PCA, rotation, plasticity, ...) annotate their fields with the types
below; :func:`validate_options` checks a table against those annotations: types without coercion
(``"true"`` is not a boolean, ``"3"`` and ``3.5`` are not integers, NaN is not a number), ranges, and
unknown keys. The registry (:mod:`qk_core.config.registry`) nests the same dataclasses in its entry schema,
so a registry table and a run-config override are checked by one schema. Direct construction in code
keeps the dataclasses' own ``__post_init__`` checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import AllowInfNan, ConfigDict, Field, Strict, StrictBool, StrictStr, TypeAdapter, ValidationError

Int = Annotated[int, Strict()]
PosInt = Annotated[int, Strict(), Field(ge=1)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
Float = Annotated[float, Strict(), AllowInfNan(False)]  # integers are accepted as floats
UnitFloat = Annotated[float, Strict(), Field(ge=0.0, le=1.0)]
PosFloat = Annotated[float, Strict(), AllowInfNan(False), Field(gt=0.0)]
Bool = StrictBool
Str = StrictStr


def IntIn(lo: int, hi: int) -> Any:
    """An integer in [lo, hi]: every count and size option has a range that means something (issue 25)."""
    return Annotated[int, Strict(), Field(ge=lo, le=hi)]


def FloatIn(lo: float, hi: float) -> Any:
    """A finite number in [lo, hi]."""
    return Annotated[float, Strict(), AllowInfNan(False), Field(ge=lo, le=hi)]


# The ranges, in one place. Tokens: a window of 2^24 is beyond every model in the study (the largest is
# 10M) and about 3 TB of float32 Q/K per layer; a bucket needs a few tokens to hold sampled positions.
MAX_TOKENS = 2**24
MIN_BUCKET = 4
MAX_HEADS = 2**20  # heads of a whole model, far above any study model (SmolLM3-3B has 576)
MAX_RESAMPLES = 100_000  # bootstrap resamples: the interval's Monte Carlo error is ~1e-3 at 10^4
MAX_PAIRS = 2**20  # key pairs per bucket (the per-head pair table is 2^20 x buckets rows)
MAX_DOCS = 10_000_000
MAX_COUNT = 100_000  # repeats, candidates, random sets, components, ...
MAX_GPUS = 64
Tokens = IntIn(1, MAX_TOKENS)

#: ``config_overrides``: how deep its tables may nest, and the largest architecture sizes it may set (a
#: model built with more would not fit any machine: the size is an error before anything is loaded).
MAX_OVERRIDE_DEPTH = 4
MAX_ARCHITECTURE = {"num_hidden_layers": 4096, "num_attention_heads": 4096, "num_key_value_heads": 4096,
                    "hidden_size": 2**17, "intermediate_size": 2**20, "head_dim": 4096, "vocab_size": 2**22,
                    "max_position_embeddings": MAX_TOKENS}


def check_config_overrides(value: Any, where: str = "", depth: int = 0) -> None:
    """Raise ``ValueError`` naming the key when ``config_overrides`` nests too deep or sets a size out of range."""
    if depth > MAX_OVERRIDE_DEPTH:
        raise ValueError(f"'{where}' nests deeper than {MAX_OVERRIDE_DEPTH} tables")
    if isinstance(value, Mapping):
        for key, item in value.items():
            name = f"{where}.{key}" if where else str(key)
            limit = MAX_ARCHITECTURE.get(str(key))
            if limit is not None and (isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= limit):
                raise ValueError(f"'{name}' must be an integer in [1, {limit}], got {item!r}")
            check_config_overrides(item, name, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_config_overrides(item, f"{where}[{i}]", depth + 1)

#: Set as ``__pydantic_config__`` on every options dataclass: unknown keys are errors.
STRICT_TABLE = ConfigDict(extra="forbid")

T = TypeVar("T")

_UNKNOWN = {"unexpected_keyword_argument", "extra_forbidden"}


class OptionsError(ValueError):
    """An options table is invalid; the message names where, the field and the value."""


def field_path(loc: tuple[Any, ...]) -> str:
    """``('capture', 'layers', 0)`` -> ``capture.layers[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def error_lines(exc: ValidationError, prefix: str = "") -> list[str]:
    """One line per error: ``field '<prefix.loc>': <message> (got <value>)``."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = field_path((prefix, *err["loc"]) if prefix else tuple(err["loc"]))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in _UNKNOWN:
            msg = "unknown key"
        elif err["type"] not in ("missing", "value_error"):
            msg += f" (got {err['input']!r})"
        lines.append(f"field '{loc or prefix or '(table)'}': {msg}")
    return lines


@cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def validate_options(cls: type[T], values: Mapping[str, Any] | None, name: str,
                     error: type[ValueError] = OptionsError, where: str | None = None) -> T:
    """Build ``cls`` from a table, checked against its annotated fields; raise ``error`` naming ``where``.

    ``name`` says which options these are (``pca``, ``plasticity``, ...); ``where`` prefixes the message
    (default ``<name> options``). Unknown keys list the known ones, so a misspelling is easy to fix.
    """
    where = where or f"{name} options"
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise error(f"{where}: must be a table of options, got {values!r}")
    try:
        return _adapter(cls).validate_python(dict(values))
    except ValidationError as exc:
        known = sorted(getattr(cls, "__dataclass_fields__", {}) or getattr(cls, "model_fields", {}))
        unknown = [field_path(e["loc"]) for e in exc.errors() if e["type"] in _UNKNOWN]
        lines = [ln for ln in error_lines(exc) if not ln.endswith(": unknown key")]
        if unknown:
            lines.insert(0, f"unknown {name} options {unknown}; known: {known}")
        raise error(f"{where}: " + "; ".join(lines)) from None
