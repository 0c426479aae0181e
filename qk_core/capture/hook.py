"""The capture: a read hook on the backbone's attention session (SPEC 1.1-1.3).

A :class:`CaptureSession` rides on :mod:`qk_core.capture.attention`: it records the sampled rows of the query/key
tensors each attention call hands the kernel - after projections, q/k norm, RoPE, any pre-attention query scaling
and any write hook (``debias``) - exactly what the kernel sees. Rows are gathered on the model's device with
``index_select`` and moved to host once per document by :meth:`CaptureSession.collect` (SPEC 1.3). In the same read,
for every head of the layers in ``moments`` and every position, the SPEC 12.1 sums are formed on the device
(:func:`qk_core.capture.accumulation.accumulate`), their symmetric d x d sums packed there as the upper triangles the
moments file stores. On a CUDA device each layer's sums are copied into pinned host buffers on a side stream as soon
as they are formed, so the transfer runs beside the next layers' compute; :meth:`CaptureSession.collect_moments`
waits for those copies once per document. On the CPU they are written into reused host buffers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from qk_core.capture.accumulation import BucketLayouts, accumulate, pack_symmetric, to_host, triangle_index
from qk_core.capture.attention import AttentionHook, AttentionHookError, attach
from qk_core.capture.layers import CallInfo
from qk_core.capture.moments import MomentPlan
from qk_core.capture.store import HeadRows


class CaptureHookError(AttentionHookError):
    """The capture could not be attached, or a layer yielded no vectors (names the layer)."""


class _EveryLayerRead(Exception):  # noqa: N818 - a signal, not an error
    """Raised by the capture function inside :meth:`CaptureSession.forward` once every planned layer was read."""


def _heads(x: torch.Tensor, heads: list[int], index: torch.Tensor) -> torch.Tensor:
    """The rows of ``heads`` of a (1, H, n, d) query or key tensor: a view of the tensor when they are all of its
    heads in order, else gathered with ``index_select``. The view avoids a gather, not a copy: :func:`accumulate`
    copies the rows into its bucket-major buffers either way."""
    if list(heads) == list(range(x.shape[1])):
        return x[0]
    return x[0].index_select(0, index.to(x.device))


def copy_on_side_stream(sums: dict[str, torch.Tensor], store: dict[str, torch.Tensor], stream: torch.cuda.Stream
                        ) -> None:
    """Copy device ``sums`` into the pinned host buffers ``store`` (same keys and shapes) on ``stream``, once the
    device's current stream has formed them; the caller's stream goes on. Each sum is kept by the allocator until
    its copy is done; wait on ``stream`` before reading ``store``."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for k, v in sums.items():
            store[k].copy_(v, non_blocking=True)
            v.record_stream(stream)


class CaptureSession(AttentionHook):
    """Records sampled Q/K rows of one text backbone while it runs under the capture function.

    ``heads`` maps layer -> (sampled query heads, their KV heads, deduplicated, sorted). Before each
    forward call :meth:`set_positions`; after it, :meth:`collect`. The forward is either a plain call of the
    backbone (it runs whole) or :meth:`forward` (it stops once every planned layer was read). With
    ``heads=None`` the session only probes: it records what every attention module was handed (:attr:`calls`)
    and gathers nothing.

    ``moments``: the layers and heads whose SPEC 12.1 moments are accumulated over every position, and how
    (:class:`qk_core.capture.moments.MomentPlan`); None: none.
    """

    def __init__(self, backbone: torch.nn.Module, heads: dict[int, tuple[list[int], list[int]]] | None = None,
                 moments: MomentPlan | None = None):
        self.backbone = backbone
        self.device = next(backbone.parameters()).device
        self.heads = heads
        self.calls: dict[int, CallInfo] = {}
        self._index = {layer: (torch.tensor(q, device=self.device), torch.tensor(kv, device=self.device))
                       for layer, (q, kv) in (heads or {}).items()}
        self._pos_np: dict[tuple[int, str], np.ndarray] = {}
        self._pos_t: dict[tuple[int, str], torch.Tensor] = {}
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # sampled rows: views of one flat float32 buffer, reused per document (_row_buffers)
        self._rows_flat: torch.Tensor | None = None
        self._row_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.moments = moments
        self._m_index = {layer: (torch.tensor(q, device=self.device), torch.tensor(kv, device=self.device))
                         for layer, (q, kv, _) in (moments.layers if moments else {}).items()}
        self._moments: dict[int, dict[str, torch.Tensor]] = {}
        self._layouts = BucketLayouts()  # a document's bucket layout, formed by its first layer for the others
        self._triangles: dict[tuple[int, str], torch.Tensor] = {}  # upper-triangle index per (d, device)
        # every document's sums, reused (_moment_store): one host store on the CPU; from a CUDA device two pinned
        # ones, alternated per document (the sums of one stay valid while the next forward fills the other)
        self._m_store: list[dict[int, dict[str, torch.Tensor]]] = [{}, {}]
        self._slot = 0
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stack = contextlib.ExitStack()
        self.backend: str | None = None
        self._unread: set[int] | None = None  # inside forward(): planned layers not read yet

    # ---- context ------------------------------------------------------------------------------
    def __enter__(self) -> CaptureSession:
        self._stack = contextlib.ExitStack()
        try:
            session = self._stack.enter_context(attach(self.backbone, self))
        except AttentionHookError as exc:
            raise CaptureHookError(f"{exc}; it cannot be captured") from exc
        self.backend = session.backend
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ---- positions ----------------------------------------------------------------------------
    def set_positions(self, positions: dict[tuple[int, str], np.ndarray] | np.ndarray) -> None:
        """Positions to gather in the next forward: one array for every layer and kind, or per (layer, kind)."""
        self._buffers.clear()
        self._row_views.clear()
        self._moments.clear()
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

    def forward(self, run: Callable[[], object]) -> None:
        """Run one forward for the capture alone (``run``: the backbone called on a document) and stop it once every
        planned layer was read (SPEC 1.3). Q and K of a layer depend only on what comes before its attention, so
        what follows the last planned layer's read - that layer's attention and MLP, any later layers, the final
        norm - changes nothing recorded and is not computed: about 1/L of the forward of an L-layer model whose last
        layer is read. The backbone's output is not returned; call the backbone directly for it (it then runs whole)."""
        self._unread = set(self._index) | set(self._m_index)
        try:
            run()
        except _EveryLayerRead:
            pass
        finally:
            self._unread = None

    # ---- called from the attention function --------------------------------------------------
    def read(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: Any, kwargs: dict[str, Any]) -> None:
        self._read(module, layer, query, key, kwargs)
        if self._unread:
            self._unread.discard(layer)
            if not self._unread:  # the last planned layer: stop before its attention runs
                raise _EveryLayerRead

    def _read(self, module: torch.nn.Module, layer: int, query: torch.Tensor, key: torch.Tensor,
              kwargs: dict[str, Any]) -> None:
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
        gather, accumulate = self._index.get(layer), self.moments is not None and layer in self._m_index
        if (gather is not None or accumulate) and query.shape[0] != 1:
            raise CaptureHookError(f"layer {layer}: capture runs with batch size 1, got {query.shape[0]}")
        if accumulate:
            self._accumulate(layer, query, key, self.moments)
        if gather is None:
            return
        dev = query.device  # layers of a model sharded over devices may live elsewhere
        q_heads, kv_heads = (t.to(dev) for t in gather)
        # positions first: the transient copy holds the sampled positions of every head, not every position
        planned = self.heads[layer]  # type: ignore[index]
        q = _heads(query.index_select(2, self._pos_t[(layer, "q")].to(dev)), planned[0], q_heads)
        k = _heads(key.index_select(2, self._pos_t[(layer, "k")].to(dev)), planned[1], kv_heads)
        q_out, k_out = self._row_buffers(layer, q.shape, k.shape)
        q_out.copy_(q)
        k_out.copy_(k)
        self._buffers[layer] = (q_out, k_out)

    def _row_buffers(self, layer: int, q_shape: torch.Size, k_shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 buffers on the session's device for ``layer``'s sampled rows: views of one flat buffer that holds
        every planned layer's rows in :meth:`collect`'s order, sized by the first layer's call of a forward and
        reused by the next documents while it is large enough. Before, each layer's rows were allocated between the
        forward's transient blocks and kept to the document's end, after a transient copy of every position of the
        layer's heads; an 8K-token SmolLM2 capture process then sometimes kept 400-500 MB more of the CPU heap
        (9 of 38 processes on 2026-11-29, none of 15 since: bench/results/capture_cpu_moments_8192_25cae81.md). A layer
        whose head size differs from the first layer's gets buffers of its own."""
        d = int(q_shape[-1])
        if not self._row_views:
            layers = sorted(self.heads)  # type: ignore[arg-type]
            shapes = [(len(heads), len(self._pos_np[(other, kind)]), d) for other in layers
                      for kind, heads in zip("qk", self.heads[other], strict=True)]  # type: ignore[index]
            sizes = [math.prod(shape) for shape in shapes]
            if self._rows_flat is None or self._rows_flat.numel() < sum(sizes):
                self._rows_flat = None  # freed before its successor is allocated
                self._rows_flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            views = [v.view(shape) for v, shape in zip(self._rows_flat[:sum(sizes)].split(sizes), shapes, strict=True)]
            self._row_views = {other: (views[2 * i], views[2 * i + 1]) for i, other in enumerate(layers)}
        q_out, k_out = self._row_views[layer]
        if q_out.shape != q_shape or k_out.shape != k_shape:
            q_out = torch.empty(q_shape, dtype=torch.float32, device=self.device)
            k_out = torch.empty(k_shape, dtype=torch.float32, device=self.device)
            self._row_views[layer] = (q_out, k_out)
        return q_out, k_out

    def _accumulate(self, layer: int, query: torch.Tensor, key: torch.Tensor, m: MomentPlan) -> None:
        """SPEC 12.1 sums of every listed head of ``layer`` over every position, on the layer's device."""
        if query.shape[-2] != key.shape[-2]:
            raise CaptureHookError(f"layer {layer}: {query.shape[-2]} query and {key.shape[-2]} key positions; "
                                   "moments need a plain causal forward without cache")
        dev = query.device
        q_idx, kv_idx = self._m_index[layer]
        q_heads, kv_heads, kv_index = m.layers[layer]
        pos = np.arange(int(query.shape[-2]))
        sums = accumulate(_heads(query, q_heads, q_idx), pos, _heads(key, kv_heads, kv_idx), pos,
                          np.asarray(kv_index, dtype=np.int64), m.bucket, m.n_buckets, getattr(torch, m.dtype),
                          m.lw_intensity, self._layouts)
        d = int(query.shape[-1])
        index = self._triangles.get((d, str(dev)))
        if index is None:
            index = self._triangles[(d, str(dev))] = triangle_index(d, dev)
        sums = pack_symmetric(sums, index)  # packed on the device: half the bytes to move, none to pack on the host
        pinned = dev.type == "cuda"
        store = self._moment_store(layer, sums, pinned)
        if pinned:  # device -> pinned host on a side stream, after the sums are formed; the forward goes on
            stream = self._copy_streams.get(dev)
            if stream is None:
                stream = self._copy_streams[dev] = torch.cuda.Stream(dev)
            copy_on_side_stream(sums, store, stream)
        else:
            for k, v in sums.items():
                store[k].copy_(v)
        self._moments[layer] = store

    def _moment_store(self, layer: int, sums: dict[str, torch.Tensor], pinned: bool) -> dict[str, torch.Tensor]:
        """The host buffers of ``layer``'s sums in the current slot, reused by every document (pinned for a copy
        from a CUDA device). The first layer's call allocates them for every planned layer at once: allocated one
        layer at a time, between the accumulation's transient blocks, they fragmented the CPU heap (glibc kept
        ~1 GB more resident over the 30 layers of an 8K-token SmolLM2 forward)."""
        stores = self._m_store[self._slot]

        def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pinned)

        if not stores:
            for other, (q_idx, kv_idx) in self._m_index.items():
                stores[other] = {k: alloc((len(kv_idx) if k.startswith("k_") else len(q_idx), *v.shape[1:]), v.dtype)
                                 for k, v in sums.items()}
        store = stores[layer]
        if set(store) != set(sums) or any(store[k].shape != v.shape or store[k].dtype != v.dtype
                                          for k, v in sums.items()):
            store = stores[layer] = {k: alloc(tuple(v.shape), v.dtype) for k, v in sums.items()}
        return store

    # ---- after the forward -------------------------------------------------------------------
    def missing_layers(self) -> list[int]:
        """Planned layers whose attention never reached the capture function in the last forward."""
        return sorted((set(self._index) - set(self._buffers)) | (set(self._m_index) - set(self._moments)))

    def collect_moments(self, copy: bool = False) -> dict[int, dict[str, np.ndarray]]:
        """Every moment layer's sums of the last forward on the host (SPEC 12.1): per-bucket query sums in the
        accumulation dtype, the others float64; the symmetric d x d sums as the upper triangles a moments
        file stores (:func:`qk_core.capture.accumulation.pack_symmetric`). They are views of the session's host
        buffers. On the CPU the next forward overwrites them: write them before it, or ask for a ``copy``.
        From a CUDA device (after waiting for the side-stream copies) they stay valid through the next
        forward, which fills the other pinned buffers, and are overwritten by the one after it."""
        missing = sorted(set(self._m_index) - set(self._moments))
        if missing:
            raise CaptureHookError(f"layer(s) {missing} yielded no vectors: their attention never reached the "
                                   "capture function")
        for stream in self._copy_streams.values():
            stream.synchronize()
        out = to_host(self._moments)
        if self._copy_streams:
            self._slot = 1 - self._slot
        elif copy:
            out = {layer: {k: v.copy() for k, v in sums.items()} for layer, sums in out.items()}
        self._moments.clear()
        return out

    def _rows_in_order(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The prefix of the session's flat row buffer when ``parts`` lie in it one after another from its start."""
        flat, offset = self._rows_flat, 0
        if flat is None:
            return None
        for t in parts:
            if t.data_ptr() != flat.data_ptr() + offset * flat.element_size():
                return None
            offset += t.numel()
        return flat[:offset]

    def collect(self, copy: bool = False) -> list[HeadRows]:
        """All rows of the last forward, moved to host in one transfer (SPEC 1.3). On the CPU the rows are views of
        the session's row buffer, which the next forward overwrites: use them before it, or ask for a ``copy``."""
        missing = self.missing_layers()
        if missing:
            raise CaptureHookError(
                f"layer(s) {missing} yielded no vectors: their attention never reached the capture function "
                "(not a self-attention layer of the text model, or skipped in a text-only forward)")
        layers = sorted(self._buffers)
        parts = [t for layer in layers for t in self._buffers[layer]]
        joined = self._rows_in_order(parts)
        if joined is None:  # layers with buffers of their own: joined in a fresh tensor
            host = (torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0)).cpu()
        else:
            host = joined.cpu()  # from another device a fresh host tensor; on the CPU the buffer itself
            if copy and host.data_ptr() == joined.data_ptr():
                host = host.clone()
        flat = host.numpy()
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
