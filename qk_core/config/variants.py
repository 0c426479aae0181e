"""Context-extension variants (SPEC 13.1): a registry model derived from a base entry by a RoPE override only.

A registry table ``[variants.<base>]`` declares the base's trained context C, the variants' window W (default
2C) and one line per variant::

    [variants.smollm2-135m]
    trained_context = 8192
    window = 16384
    groups = ["extension"]
    none = {}
    linear = { type = "linear", factor = 2 }
    dynamic = { type = "dynamic", factor = 2 }
    yarn = { type = "yarn", factor = 2 }
    theta = { rope_theta = 400000 }

Each line becomes the model key ``<base>~<name>``: every field of the base entry, except the window, the
bucket (default W / 16), the groups and the ``config_overrides``' RoPE, which is the variant's. The override
is written with transformers' own RoPE types (``rope_parameters``: ``linear``, ``dynamic``, ``yarn``,
``llama3``; a new ``rope_theta``), so the model's own rotary embedding applies it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qk_core.config.schema import MAX_TOKENS, FloatIn, IntIn, Str

#: The key separator of a variant: ``<base>~<variant>`` (never in a registry slug).
SEPARATOR = "~"
ROPE_TYPES = ("none", "linear", "dynamic", "yarn", "llama3")
#: Families whose text config has one global RoPE table that an override can replace. Gemma 3 has one RoPE
#: table per layer type, Ministral 3's YaRN carries a query temperature (llama_4_scaling_beta) that a new
#: type would silently drop: a variant of either is refused, naming the entry.
OVERRIDE_FAMILIES = ("llama", "mistral", "qwen3", "smollm3", "mllama")
#: Fields of ``[variants.<base>]`` that are not variants: what the variants share.
SHARED_FIELDS = ("trained_context", "window", "bucket", "groups", "corpus", "corpora", "capture", "analysis",
                 "description")
MAX_FACTOR = 1024.0


class VariantSpec(BaseModel):
    """One variant line: the RoPE type, its factor and parameters, and / or a new rope_theta."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["none", "linear", "dynamic", "yarn", "llama3"] = "none"
    factor: FloatIn(1.0, MAX_FACTOR) | None = None
    rope_theta: FloatIn(1.0, 1e12) | None = None
    beta_fast: FloatIn(0.0, 1e6) | None = None  # yarn
    beta_slow: FloatIn(0.0, 1e6) | None = None  # yarn
    attention_factor: FloatIn(0.0, 100.0) | None = None  # yarn
    low_freq_factor: FloatIn(0.0, 1e6) | None = None  # llama3
    high_freq_factor: FloatIn(0.0, 1e6) | None = None  # llama3

    @model_validator(mode="after")
    def _consistent(self) -> VariantSpec:
        if self.type == "none" and self.factor is not None:
            raise ValueError("'factor' needs a scaling type (linear, dynamic, yarn, llama3); 'none' takes none")
        if self.type != "none" and self.factor is None:
            raise ValueError(f"type {self.type!r} needs 'factor'")
        if self.type == "llama3" and self.factor is not None and self.factor <= 1.0:
            raise ValueError("type 'llama3' needs factor > 1")
        own = {"yarn": ("beta_fast", "beta_slow", "attention_factor"),
               "llama3": ("low_freq_factor", "high_freq_factor")}
        for kind, names in own.items():
            for name in names:
                if getattr(self, name) is not None and self.type != kind:
                    raise ValueError(f"'{name}' belongs to type '{kind}', not {self.type!r}")
        return self


class VariantsTable(BaseModel):
    """What the variants of one base share (the variant lines are checked one by one)."""

    model_config = ConfigDict(extra="forbid")
    trained_context: IntIn(16, MAX_TOKENS)
    window: IntIn(16, MAX_TOKENS) | None = None
    groups: Annotated[list[Str], Field(min_length=1)] = Field(default_factory=lambda: ["extension"])


@dataclass(frozen=True)
class Variant:
    """A variant of a base model (SPEC 13.1), carried by its :class:`ModelEntry` and recorded by its capture."""

    base: str
    name: str
    type: str  # none | linear | dynamic | yarn | llama3
    factor: float | None
    rope_theta: float | None
    trained_context: int
    window: int
    params: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.base}{SEPARATOR}{self.name}"

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        what = "no change (plain extrapolation)" if self.type == "none" else f"{self.type} x{self.factor:g}"
        if self.rope_theta is not None:
            what = f"rope_theta {self.rope_theta:g}" + ("" if self.type == "none" else f", {what}")
        return f"{self.key}: {what}; trained context C = {self.trained_context}, window W = {self.window}"

    def expected_rope(self) -> dict[str, Any]:
        """What every RoPE layer of the loaded config must record (checked by the capture)."""
        out: dict[str, Any] = {}
        if self.type != "none":
            out["rope_type"] = self.type
            out["rope_factor"] = float(self.factor or 1.0)
        if self.rope_theta is not None:
            out["rope_theta"] = float(self.rope_theta)
        if self.type in ("yarn", "llama3"):
            out["rope_original_context"] = int(self.trained_context)
        return out


def split_key(key: str) -> tuple[str, str | None]:
    """``base~name`` -> (base, name); a key without the separator -> (key, None)."""
    base, sep, name = key.partition(SEPARATOR)
    return (base, name) if sep else (key, None)


def rope_override(variant: Variant) -> dict[str, Any]:
    """The ``config_overrides`` of a variant: transformers' ``rope_parameters`` of its type, and the
    ``max_position_embeddings`` the type reads (dynamic NTK: the trained context, from which it rescales;
    yarn / llama3 / linear: the extended context C x factor, so transformers' consistency check holds)."""
    C = int(variant.trained_context)
    rope: dict[str, Any] = {}
    out: dict[str, Any] = {}
    if variant.type != "none":
        rope = {"rope_type": variant.type, "factor": float(variant.factor or 1.0), **variant.params}
        if variant.type in ("yarn", "llama3"):
            rope["original_max_position_embeddings"] = C
        if variant.type == "llama3":
            rope.setdefault("low_freq_factor", 1.0)
            rope.setdefault("high_freq_factor", 4.0)
        out["max_position_embeddings"] = C if variant.type == "dynamic" else math.ceil(C * rope["factor"])
    if variant.rope_theta is not None:
        rope["rope_theta"] = float(variant.rope_theta)
    if rope:
        out["rope_parameters"] = rope
    return out


def make_variant(base: str, name: str, spec: VariantSpec, trained_context: int, window: int) -> Variant:
    params = {k: float(v) for k in ("beta_fast", "beta_slow", "attention_factor", "low_freq_factor",
                                    "high_freq_factor") if (v := getattr(spec, k)) is not None}
    return Variant(base=base, name=name, type=spec.type, factor=None if spec.factor is None else float(spec.factor),
                   rope_theta=None if spec.rope_theta is None else float(spec.rope_theta),
                   trained_context=int(trained_context), window=int(window), params=params)
