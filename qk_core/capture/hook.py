"""The capture attention function, registered in transformers' AttentionInterface (SPEC 1.1-1.3).

For each backend a model can run on (``sdpa``, ``eager``, ``flash_attention_*``, ``flex_attention``) one
function is registered under ``qkcapture_<backend>`` (with the backend's own mask builder registered
under the same name in AttentionMaskInterface, so masks are built exactly as before). The function
records the sampled rows of the query/key tensors it is handed - i.e. after projections, q/k norm, RoPE
and any pre-attention query scaling, exactly what the kernel sees - and then calls the backend the
model would otherwise use, with unchanged arguments. No modeling code is copied and no module forward
is patched: a :class:`CaptureSession` only switches the text backbone's attention implementation to the
capture name (``set_attn_implementation``) and back.

Rows are gathered on the model's device with ``index_select`` and moved to host once per document by
:meth:`CaptureSession.collect` (SPEC 1.3).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from qk_core.capture.layers import CallInfo
from qk_core.capture.store import HeadRows

PREFIX = "qkcapture_"
_ACTIVE: ContextVar[CaptureSession | None] = ContextVar("qk_capture_session", default=None)
_REGISTERED: set[str] = set()


class CaptureHookError(RuntimeError):
    """The capture function could not be attached, or a layer yielded no vectors (names the layer)."""


def capture_impl_name(backend: str) -> str:
    return f"{PREFIX}{backend}"


def _backend_fn(backend: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The function the model would call for ``backend``: the registry's entry, or the modeling file's eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager)
    if fn is None:
        raise CaptureHookError(f"{type(module).__name__}: no '{backend}' attention function to delegate to")
    return fn


@contextlib.contextmanager
def _impl_name(config: Any, name: str) -> Iterator[None]:
    """Present ``name`` as the config's implementation while a flash backend runs (it reads the name)."""
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = saved


def _make_capture_fn(backend: str) -> Callable[..., Any]:
    def qk_capture_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        session = _ACTIVE.get()
        if session is not None:
            session.record(module, query, key, kwargs)
        fn = _backend_fn(backend, module)
        if "flash" in backend:
            with _impl_name(module.config, backend):
                return fn(module, query, key, value, attention_mask, *args, **kwargs)
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    qk_capture_attention.__qualname__ = f"qk_capture_attention[{backend}]"
    return qk_capture_attention


def ensure_registered(backend: str) -> str:
    """Register the capture function (and the backend's mask builder) for ``backend``; return its name."""
    return register_wrapper(capture_impl_name(backend), backend, _make_capture_fn)


def register_wrapper(name: str, inner: str, make_fn: Callable[[str], Callable]) -> str:
    """Register ``make_fn(inner)`` as attention function ``name``, with ``inner``'s mask builder (once)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    if name not in _REGISTERED:
        AttentionInterface.register(name, make_fn(inner))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(inner)  # the public mapping of registered mask builders
        if mask_fn is not None:
            AttentionMaskInterface.register(name, mask_fn)
        _REGISTERED.add(name)
    return name


class CaptureSession:
    """Records sampled Q/K rows of one text backbone while it runs under the capture function.

    ``heads`` maps layer -> (sampled query heads, their KV heads, deduplicated, sorted). Before each
    forward call :meth:`set_positions`; after it, :meth:`collect`. With ``heads=None`` the session only
    probes: it records what every attention module was handed (:attr:`calls`) and gathers nothing.
    """

    def __init__(self, backbone: torch.nn.Module, heads: dict[int, tuple[list[int], list[int]]] | None = None):
        self.backbone = backbone
        self.device = next(backbone.parameters()).device
        self.heads = heads
        self.calls: dict[int, CallInfo] = {}
        self._module_ids = {id(m) for m in backbone.modules()}
        self._index = {layer: (torch.tensor(q, device=self.device), torch.tensor(kv, device=self.device))
                       for layer, (q, kv) in (heads or {}).items()}
        self._pos_np: dict[tuple[int, str], np.ndarray] = {}
        self._pos_t: dict[tuple[int, str], torch.Tensor] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._token = None
        self._saved_impl: str | None = None
        self.backend: str | None = None

    # ---- context ------------------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        if _ACTIVE.get() is not None:
            raise CaptureHookError("a capture session is already active in this context")
        current = self.backbone.config._attn_implementation
        if current is None or current.startswith(PREFIX):
            raise CaptureHookError(f"unexpected attention implementation {current!r} on the backbone")
        self.backend = current
        name = ensure_registered(current)
        self._saved_impl = current
        self.backbone.set_attn_implementation(name)
        if self.backbone.config._attn_implementation != name:
            self.backbone.set_attn_implementation(current)
            raise CaptureHookError(
                f"{type(self.backbone).__name__} does not dispatch attention through AttentionInterface; "
                "it cannot be captured")
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        if self._saved_impl is not None:
            self.backbone.set_attn_implementation(self._saved_impl)
            self._saved_impl = None

    # ---- positions ----------------------------------------------------------------------------
    def set_positions(self, positions: dict[tuple[int, str], np.ndarray] | np.ndarray) -> None:
        """Positions to gather in the next forward: one array for every layer and kind, or per (layer, kind)."""
        self._buffers.clear()
        self.calls.clear()
        self._pos_np.clear()
        self._pos_t.clear()
        if isinstance(positions, np.ndarray):
            shared = torch.as_tensor(positions, dtype=torch.long, device=self.device)
            for layer in self._index:
                for kind in ("q", "k"):
                    self._pos_np[(layer, kind)] = positions
                    self._pos_t[(layer, kind)] = shared
        else:
            for key, pos in positions.items():
                self._pos_np[key] = pos
                self._pos_t[key] = torch.as_tensor(pos, dtype=torch.long, device=self.device)

    # ---- called from the attention function --------------------------------------------------
    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
        if id(module) not in self._module_ids:
            return  # another model running in the same context
        layer = int(getattr(module, "layer_idx", -1))
        if layer in self.calls:
            raise CaptureHookError(f"layer {layer}: attention called twice in one forward")
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        window = kwargs.get("sliding_window")
        use_rope = getattr(module, "use_rope", None)
        self.calls[layer] = CallInfo(
            layer=layer, module=type(module).__name__, n_q=int(query.shape[1]), n_kv=int(key.shape[1]),
            head_dim=int(query.shape[-1]), q_len=int(query.shape[-2]), k_len=int(key.shape[-2]),
            scaling=None if scaling is None else float(scaling),
            sliding_window=None if window is None else int(window),
            q_norm=isinstance(getattr(module, "q_norm", None), torch.nn.Module),
            k_norm=isinstance(getattr(module, "k_norm", None), torch.nn.Module),
            use_rope=None if use_rope is None else bool(use_rope),
        )
        idx = self._index.get(layer)
        if idx is None:
            return
        if query.shape[0] != 1:
            raise CaptureHookError(f"layer {layer}: capture runs with batch size 1, got {query.shape[0]}")
        dev = query.device  # layers of a model sharded over devices may live elsewhere
        q_heads, kv_heads = (t.to(dev) for t in idx)
        q = query[0].index_select(0, q_heads).index_select(1, self._pos_t[(layer, "q")].to(dev))
        k = key[0].index_select(0, kv_heads).index_select(1, self._pos_t[(layer, "k")].to(dev))
        self._buffers[layer] = (q.to(self.device, torch.float32), k.to(self.device, torch.float32))

    # ---- after the forward -------------------------------------------------------------------
    def missing_layers(self) -> list[int]:
        """Planned layers whose attention never reached the capture function in the last forward."""
        return sorted(set(self._index) - set(self._buffers))

    def collect(self) -> list[HeadRows]:
        """All rows of the last forward, moved to host in one transfer (SPEC 1.3)."""
        missing = self.missing_layers()
        if missing:
            raise CaptureHookError(
                f"layer(s) {missing} yielded no vectors: their attention never reached the capture function "
                "(not a self-attention layer of the text model, or skipped in a text-only forward)")
        layers = sorted(self._buffers)
        parts = [t.reshape(-1) for layer in layers for t in self._buffers[layer]]
        flat = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.float32)
        rows: list[HeadRows] = []
        offset = 0
        for layer in layers:
            q_heads, kv_heads = self.heads[layer]  # type: ignore[index]
            for kind, heads, tensor in (("q", q_heads, self._buffers[layer][0]),
                                        ("k", kv_heads, self._buffers[layer][1])):
                n_h, n_p, d = tensor.shape
                block = flat[offset: offset + n_h * n_p * d].reshape(n_h, n_p, d)
                offset += n_h * n_p * d
                pos = self._pos_np[(layer, kind)].astype(np.int32)
                rows += [HeadRows(kind, layer, int(h), pos, block[i]) for i, h in enumerate(heads)]
        self._buffers.clear()
        return rows
