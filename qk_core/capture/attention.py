"""One attention-interface session per backbone, carrying read hooks and write hooks (SPEC 1.1-1.3, 11.2).

For each backend a model can run on (``sdpa``, ``eager``, ``flash_attention_*``, ``flex_attention``) one
function is registered in transformers' ``AttentionInterface`` under ``qk_<backend>`` (with the backend's
own mask builder under the same name in ``AttentionMaskInterface``, so masks are built exactly as before).
While a session is active the backbone's attention implementation is switched to that name; every
attention call then runs, in this order:

1. the write hooks' :meth:`AttentionHook.edit_kv` (``debias`` changes keys; may repeat K/V per query head),
2. the read hooks' :meth:`AttentionHook.read` - they see exactly what the kernel sees (the capture),
3. the backend the model would otherwise use, with unchanged arguments,
4. the write hooks' :meth:`AttentionHook.edit_output` (``ablate``, mean recording).

No modeling code is copied and no module forward is patched. :func:`attach` adds a hook to the active
session of a backbone, or opens one; the session ends when its last hook leaves.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

PREFIX = "qk_"
_ACTIVE: ContextVar[AttentionSession | None] = ContextVar("qk_attention_session", default=None)
_REGISTERED: set[str] = set()


class AttentionHookError(RuntimeError):
    """A hook could not be attached (the backbone does not dispatch through AttentionInterface, ...)."""


class AttentionHook:
    """What a session carries. Read hooks (``writes = False``) implement :meth:`read`; write hooks
    implement :meth:`edit_kv` and/or :meth:`edit_output`. ``module_ids`` limits a hook to one backbone."""

    writes: bool = False

    def edit_kv(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Keys and values handed on, and the K/V group count the backend must read (None: unchanged)."""
        return key, value, None

    def read(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: Any, kwargs: dict[str, Any]) -> None:
        """See the tensors the kernel is about to be handed."""

    def edit_output(self, module: torch.nn.Module, layer: int, out: Any) -> Any:
        return out


def impl_name(backend: str) -> str:
    return f"{PREFIX}{backend}"


def backend_fn(backend: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The function the model would call for ``backend``: the registry's entry, or the modeling file's eager."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager)
    if fn is None:
        raise AttentionHookError(f"{type(module).__name__}: no '{backend}' attention function to delegate to")
    return fn


@contextlib.contextmanager
def _presented_as(config: Any, name: str) -> Iterator[None]:
    """Present ``name`` as the config's implementation while a flash backend runs (it reads the name)."""
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = saved


@contextlib.contextmanager
def _kv_groups(module: torch.nn.Module, groups: int | None) -> Iterator[None]:
    if groups is None:
        yield
        return
    had = hasattr(module, "num_key_value_groups")
    saved = getattr(module, "num_key_value_groups", None)
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        if had:
            module.num_key_value_groups = saved
        else:
            del module.num_key_value_groups


def call_backend(backend: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``backend`` exactly as the model would."""
    fn = backend_fn(backend, module)
    if "flash" in backend:
        with _presented_as(module.config, backend):
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
    return fn(module, query, key, value, attention_mask, *args, **kwargs)


def _make_fn(backend: str) -> Callable[..., Any]:
    def qk_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        session = _ACTIVE.get()
        if session is None or id(module) not in session.module_ids:  # another model in the same context
            return call_backend(backend, module, query, key, value, attention_mask, *args, **kwargs)
        layer = int(getattr(module, "layer_idx", -1))
        groups = None
        for hook in session.write_hooks:
            key, value, g = hook.edit_kv(module, layer, query, key, value, kwargs)
            groups = g if g is not None else groups
        for hook in session.read_hooks:
            hook.read(module, layer, query, key, value, attention_mask, kwargs)
        with _kv_groups(module, groups):
            out = call_backend(backend, module, query, key, value, attention_mask, *args, **kwargs)
        for hook in session.write_hooks:
            out = hook.edit_output(module, layer, out)
        return out

    qk_attention.__qualname__ = f"qk_attention[{backend}]"
    return qk_attention


def ensure_registered(backend: str) -> str:
    """Register the session's function for ``backend`` (and the backend's mask builder, once); its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = impl_name(backend)
    if name not in _REGISTERED:
        AttentionInterface.register(name, _make_fn(backend))
        mask_fn = ALL_MASK_ATTENTION_FUNCTIONS.get(backend)  # the public mapping of registered mask builders
        if mask_fn is not None:
            AttentionMaskInterface.register(name, mask_fn)
        _REGISTERED.add(name)
    return name


class AttentionSession:
    """The hooks active on one backbone; its attention implementation switched while the session lives."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        self.backbone = backbone
        self.module_ids = {id(m) for m in backbone.modules()}
        self.hooks: list[AttentionHook] = []
        self.backend = backbone.config._attn_implementation
        if self.backend is None or self.backend.startswith(PREFIX):
            raise AttentionHookError(f"unexpected attention implementation {self.backend!r} on the backbone")

    @property
    def write_hooks(self) -> list[AttentionHook]:
        return [h for h in self.hooks if h.writes]

    @property
    def read_hooks(self) -> list[AttentionHook]:
        return [h for h in self.hooks if not h.writes]

    def start(self) -> None:
        name = ensure_registered(self.backend)
        self.backbone.set_attn_implementation(name)
        if self.backbone.config._attn_implementation != name:
            self.backbone.set_attn_implementation(self.backend)
            raise AttentionHookError(f"{type(self.backbone).__name__} does not dispatch attention through "
                                     "AttentionInterface; its attention cannot be read or changed")

    def stop(self) -> None:
        self.backbone.set_attn_implementation(self.backend)


@contextlib.contextmanager
def attach(backbone: torch.nn.Module, hook: AttentionHook) -> Iterator[AttentionSession]:
    """Carry ``hook`` on the backbone's active session (opened here when none is active) while inside."""
    session = _ACTIVE.get()
    if session is not None and session.backbone is not backbone:
        raise AttentionHookError("an attention session of another backbone is already active in this context")
    if session is not None and any(h is hook for h in session.hooks):
        raise AttentionHookError(f"{type(hook).__name__} is already attached to this backbone")
    token = None
    if session is None:
        session = AttentionSession(backbone)
        session.start()
        token = _ACTIVE.set(session)
    session.hooks.append(hook)
    try:
        yield session
    finally:
        session.hooks[:] = [h for h in session.hooks if h is not hook]
        if token is not None:
            _ACTIVE.reset(token)
            session.stop()
