"""Per-layer metadata of a text backbone and the eligible-layer rule (SPEC 1.4, 1.8).

Metadata combines the text config (layer types, RoPE parameters, NoPE layers, cross-attention layers)
with what a short probe forward shows each attention module handing to the attention function (head
counts, head_dim, the kernel's scaling, the sliding window). A layer whose attention is never reached
in a text-only forward (e.g. Mllama cross-attention) is recorded as such and is never eligible.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings")


@dataclass
class CallInfo:
    """What one attention module was handed in a forward (read by the probe, SPEC 1.8)."""

    layer: int
    module: str
    n_q: int
    n_kv: int
    head_dim: int
    q_len: int
    k_len: int
    scaling: float | None
    sliding_window: int | None
    q_norm: bool
    k_norm: bool
    use_rope: bool | None


class LayerSelectionError(ValueError):
    """Requested layers cannot be captured; the message names the layer and why."""


@dataclass
class LayerInfo:
    """Metadata of one decoder layer (SPEC 1.8)."""

    layer: int
    attention_type: str  # full | sliding | cross | <other layer type>
    sliding_window: int | None
    rope_applied: bool
    rope_type: str | None
    rope_theta: float | None
    rope_factor: float | None
    rope_original_context: int | None
    rope_extra: dict[str, Any] = field(default_factory=dict)
    qk_norm: bool = False
    scaling: float | None = None  # the factor the kernel multiplies q·k by
    query_scaling: dict[str, Any] | None = None  # pre-attention query scaling already inside the captured q
    head_dim: int | None = None
    n_q: int | None = None
    n_kv: int | None = None
    module: str | None = None
    reached: bool = False  # attention function reached in a text-only forward
    eligible: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_params(config: Any, layer_type: str | None) -> dict[str, Any]:
    rp = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(rp.get(layer_type), dict):
        rp = dict(rp[layer_type])
    elif any(isinstance(v, dict) for v in rp.values()):
        rp = {}
    if not rp and getattr(config, "rope_theta", None) is not None:
        rp = {"rope_type": "default", "rope_theta": config.rope_theta}
    return rp


def describe_layers(config: Any, calls: dict[int, CallInfo], include_sliding: bool = False) -> list[LayerInfo]:
    """Metadata of every decoder layer of the text config, with eligibility under SPEC 1.4."""
    n_layers = int(config.num_hidden_layers)
    layer_types = list(getattr(config, "layer_types", None) or [])
    cross = set(getattr(config, "cross_attention_layers", None) or [])
    no_rope = getattr(config, "no_rope_layers", None)
    infos = []
    for i in range(n_layers):
        call = calls.get(i)
        lt = layer_types[i] if i < len(layer_types) else None
        is_cross = i in cross or (call is not None and call.module and "Cross" in call.module)
        window = call.sliding_window if call is not None else None
        if window is None and lt == "sliding_attention":
            window = getattr(config, "sliding_window", None)
        if is_cross:
            atype, window = "cross", None
        elif lt == "sliding_attention" or window is not None:
            atype = "sliding"
        elif lt in (None, "full_attention"):
            atype = "full"
        else:
            atype = str(lt)
        if no_rope is not None and i < len(no_rope):
            rope_applied = bool(no_rope[i])
        elif call is not None and call.use_rope is not None:
            rope_applied = call.use_rope
        else:
            rope_applied = not is_cross
        rp = _rope_params(config, lt)
        query_scaling = None
        if rp.get("llama_4_scaling_beta") is not None:
            query_scaling = {"type": "position_temperature",
                             "formula": "1 + beta * log(1 + floor(t / original_max_position_embeddings))",
                             "beta": rp["llama_4_scaling_beta"],
                             "original_max_position_embeddings": rp.get("original_max_position_embeddings")}
        info = LayerInfo(
            layer=i, attention_type=atype, sliding_window=window, rope_applied=rope_applied,
            rope_type=rp.get("rope_type") if rope_applied else None,
            rope_theta=float(rp["rope_theta"]) if rope_applied and rp.get("rope_theta") is not None else None,
            rope_factor=float(rp["factor"]) if rope_applied and rp.get("factor") is not None else None,
            rope_original_context=(int(rp["original_max_position_embeddings"])
                                   if rope_applied and rp.get("original_max_position_embeddings") else None),
            rope_extra={k: v for k, v in rp.items() if k not in ROPE_KEYS} if rope_applied else {},
            qk_norm=bool(call and call.q_norm and call.k_norm),
            scaling=call.scaling if call else None,
            query_scaling=query_scaling,
            head_dim=call.head_dim if call else getattr(config, "head_dim", None),
            n_q=call.n_q if call else config.num_attention_heads,
            n_kv=call.n_kv if call else getattr(config, "num_key_value_heads", config.num_attention_heads),
            module=call.module if call else None,
            reached=call is not None,
        )
        info.eligible = _eligible(info, include_sliding)
        infos.append(info)
    return infos


def variant_problems(infos: list[LayerInfo], expected: dict[str, Any]) -> list[str]:
    """SPEC 13.1: every RoPE layer of a variant's loaded model must record the variant's override (``expected``:
    :meth:`qk_core.config.variants.Variant.expected_rope`); one line per layer and field that does not."""
    out = []
    rope_layers = [i for i in infos if i.rope_applied]
    if expected and not rope_layers:
        out.append("no layer applies RoPE, so no RoPE override can act")
    for info in rope_layers:
        for name, want in expected.items():
            got = getattr(info, name)
            if isinstance(want, float) and got is not None:
                same = abs(float(got) - want) <= 1e-9 * abs(want)
            else:
                same = got == want
            if not same:
                out.append(f"layer {info.layer}: {name} is {got!r}, the variant sets {want!r}")
    return out


def _eligible(info: LayerInfo, include_sliding: bool) -> bool:
    """SPEC 1.4: self-attention with full attention; sliding only on request; cross-attention never."""
    if not info.reached or info.attention_type == "cross":
        return False
    return info.attention_type == "full" or (include_sliding and info.attention_type == "sliding")


def select_layers(infos: list[LayerInfo], requested: list[int] | None, include_sliding: bool) -> list[int]:
    """Eligible layers, or the requested ones (each must be eligible; the error names the layer)."""
    by_idx = {i.layer: i for i in infos}
    if requested is None:
        chosen = [i.layer for i in infos if i.eligible]
        if not chosen:
            kinds = sorted({i.attention_type for i in infos})
            raise LayerSelectionError(
                f"no eligible layers: the model's layers are {kinds}; full-attention self-attention layers are "
                "required (set capture.include_sliding = true to capture sliding-window layers)")
        return chosen
    for layer in requested:
        info = by_idx.get(layer)
        if info is None:
            raise LayerSelectionError(f"requested layer {layer} does not exist (the model has {len(infos)} layers)")
        if info.attention_type == "cross":
            raise LayerSelectionError(f"requested layer {layer} is a cross-attention layer; it is never sampled")
        if not info.reached:
            raise LayerSelectionError(
                f"requested layer {layer} yields no vectors: its attention never reaches the capture function")
        if not info.eligible:
            raise LayerSelectionError(
                f"requested layer {layer} is a {info.attention_type} layer (window {info.sliding_window}); "
                "set capture.include_sliding = true to capture it")
    return sorted(set(requested))
