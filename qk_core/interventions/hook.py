"""Head interventions: a write hook on the backbone's attention session (SPEC 11.2).

An :class:`InterventionSession` rides on :mod:`qk_core.capture.attention`, like the capture: write hooks
run before the read hooks, so a capture active at the same time sees exactly what the kernel then sees.
No modeling file is copied and no module forward is patched.

- ``ablate`` replaces a chosen head's attention output (before the output projection) by zero or by a
  given mean vector (the head's mean over the baseline run's positions, recorded with ``record_means``).
- ``debias`` removes a chosen head's key drift along its rotation axis a (SPEC 3):
  k <- k - alpha_K (t - t_bar) a, t = key position. Under GQA the keys and values of that layer are
  repeated per query head (``repeat_kv``) and only the chosen query head's copy is changed; for that call
  the module's ``num_key_value_groups`` reads 1 so the backend does not repeat them again. The kernel (and
  a capture running inside) therefore sees one key head per query head in such a layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from qk_core.capture.attention import AttentionHook, AttentionHookError, attach

Kind = Literal["none", "ablate", "debias"]


class InterventionError(RuntimeError):
    """An intervention that cannot be applied (names the layer / head and why)."""


@dataclass(frozen=True)
class DebiasAxis:
    """One head's drift axis a (unit vector, length d), slope alpha_K per token and reference position t_bar."""

    a: np.ndarray
    alpha_k: float
    t_bar: float

    def identity(self) -> dict[str, Any]:
        return {"a": [round(float(x), 8) for x in self.a], "alpha_k": float(self.alpha_k), "t_bar": float(self.t_bar)}


@dataclass
class Intervention:
    """What to do to which heads: ``kind`` on the set ``heads`` of (layer, query head).

    ``ablate``: ``mode`` is ``zero`` or ``mean`` (then ``means`` maps (layer, head) -> the mean output vector,
    set per prompt). ``debias``: ``axes`` maps each head to its :class:`DebiasAxis`.
    """

    kind: Kind = "none"
    heads: tuple[tuple[int, int], ...] = ()
    mode: Literal["zero", "mean"] = "mean"
    axes: dict[tuple[int, int], DebiasAxis] = field(default_factory=dict)
    means: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.heads = tuple(sorted({(int(la), int(h)) for la, h in self.heads}))
        if self.kind not in ("none", "ablate", "debias"):
            raise InterventionError(f"unknown intervention kind {self.kind!r} (none, ablate, debias)")
        if self.kind == "ablate" and self.mode not in ("zero", "mean"):
            raise InterventionError(f"unknown ablation mode {self.mode!r} (zero, mean)")
        if self.kind == "debias":
            missing = [h for h in self.heads if h not in self.axes]
            if missing:
                raise InterventionError(f"debias: no rotation axis for head(s) {missing} (layer, q_head)")

    def by_layer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, h in self.heads:
            out.setdefault(layer, []).append(h)
        return out

    def identity(self) -> dict[str, Any]:
        """JSON-able description (part of a capture fingerprint when a capture runs under it)."""
        ident: dict[str, Any] = {"kind": self.kind, "heads": [list(h) for h in self.heads]}
        if self.kind == "ablate":
            ident["mode"] = self.mode
        if self.kind == "debias":
            ident["axes"] = {f"{la}:{h}": self.axes[(la, h)].identity() for la, h in self.heads}
        return ident


class InterventionSession(AttentionHook):
    """Applies one :class:`Intervention` to a text backbone while active (a context manager).

    With ``record_means`` the session also accumulates, per layer, each head's attention output summed
    over positions while :attr:`recording` is true (:meth:`head_means` returns the means).
    """

    writes = True

    def __init__(self, backbone: torch.nn.Module, intervention: Intervention | None = None,
                 record_means: bool = False):
        self.backbone = backbone
        self.intervention = intervention or Intervention()
        iv = self.intervention
        self.ablate = iv.by_layer() if iv.kind == "ablate" else {}
        self.debias = iv.by_layer() if iv.kind == "debias" else {}
        if iv.kind == "ablate" and iv.mode == "mean":
            missing = [h for h in iv.heads if h not in iv.means]
            if missing:
                raise InterventionError(f"mean ablation: no baseline mean output for head(s) {missing}")
        self.record_means = record_means
        self.recording = record_means
        self._sums: dict[int, torch.Tensor] = {}
        self._counts: dict[int, int] = {}
        self._stack = contextlib.ExitStack()
        self._axes: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def __enter__(self) -> InterventionSession:
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(attach(self.backbone, self))
        except AttentionHookError as exc:
            raise InterventionError(f"{exc}; heads cannot be intervened on") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def identity(self) -> dict[str, Any]:
        """The intervention's description (part of a capture's fingerprint when one runs under it)."""
        return self.intervention.identity()

    def capture_problem(self) -> str | None:
        """Why a capture cannot run under this intervention, or None."""
        iv = self.intervention
        if iv.kind == "ablate" and iv.mode == "mean":
            return "a capture cannot run under mean ablation (the means are per prompt); use zero"
        return None

    # ---- the hook -----------------------------------------------------------------------------------
    def edit_kv(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        heads = self.debias.get(layer)
        if not heads:
            return key, value, None
        key, value = self.debiased_kv(layer, module, query, key, value, kwargs, heads)
        return key, value, 1  # one key head per query head: the backend must not repeat them again

    # ---- debias ------------------------------------------------------------------------------------
    def _axis(self, layer: int, h: int, device: torch.device) -> torch.Tensor:
        key = (layer, h, device)
        if key not in self._axes:
            a = np.array(self.intervention.axes[(layer, h)].a, dtype=np.float64)  # a writable copy
            self._axes[key] = torch.as_tensor(a, dtype=torch.float32, device=device)
        return self._axes[key]

    def debiased_kv(self, layer: int, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, kwargs: dict[str, Any], heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values repeated per query head; the chosen heads' copies debiased (SPEC 11.2)."""
        if kwargs.get("sliding_window") is not None:
            raise InterventionError(f"layer {layer}: debias on a sliding-window layer is not supported "
                                    "(its cached key positions are not 0..T-1)")
        n_q, n_kv, k_len, d = int(query.shape[1]), int(key.shape[1]), int(key.shape[2]), int(key.shape[3])
        if n_q % n_kv:
            raise InterventionError(f"layer {layer}: {n_q} query heads not a multiple of {n_kv} KV heads")
        groups = n_q // n_kv
        key = key.repeat_interleave(groups, dim=1) if groups > 1 else key.clone()
        value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
        t = torch.arange(k_len, device=key.device, dtype=torch.float32)
        for h in heads:
            if not 0 <= h < n_q:
                raise InterventionError(f"layer {layer}: query head {h} out of range (0..{n_q - 1})")
            ax = self.intervention.axes[(layer, h)]
            a = self._axis(layer, h, key.device)
            if a.shape[0] != d:
                raise InterventionError(f"layer {layer} head {h}: axis a has length {a.shape[0]}, head_dim is {d}")
            shift = (float(ax.alpha_k) * (t - float(ax.t_bar)))[:, None] * a[None, :]  # (k_len, d)
            key[:, h] = (key[:, h].float() - shift).to(key.dtype)
        return key, value

    # ---- ablate and mean recording -----------------------------------------------------------------
    def edit_output(self, module: torch.nn.Module, layer: int, out: Any) -> Any:
        heads = self.ablate.get(layer)
        if not heads and not self.recording:
            return out
        attn, *rest = out if isinstance(out, tuple) else (out,)
        if self.recording:  # attn: (batch, q_len, n_q, d)
            s = attn.detach().float().sum(dim=(0, 1))
            self._sums[layer] = self._sums.get(layer, 0) + s
            self._counts[layer] = self._counts.get(layer, 0) + int(attn.shape[0] * attn.shape[1])
        if heads:
            attn = attn.clone()
            for h in heads:
                if self.intervention.mode == "zero":
                    attn[:, :, h, :] = 0
                else:
                    mean = torch.as_tensor(self.intervention.means[(layer, h)], dtype=attn.dtype, device=attn.device)
                    attn[:, :, h, :] = mean
        return (attn, *rest) if isinstance(out, tuple) else attn

    def head_means(self) -> dict[tuple[int, int], np.ndarray]:
        """Mean attention output per (layer, head) over the positions seen while recording."""
        out: dict[tuple[int, int], np.ndarray] = {}
        for layer, s in self._sums.items():
            m = (s / max(self._counts[layer], 1)).cpu().numpy()
            out.update({(layer, h): m[h] for h in range(m.shape[0])})
        return out

    def reset_means(self) -> None:
        self._sums.clear()
        self._counts.clear()
