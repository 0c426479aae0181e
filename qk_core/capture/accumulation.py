"""The sums of SPEC 12.1 for one document, formed on the capture's device inside the attention hook.

:func:`accumulate` turns one layer's query and key tensors into the sums :mod:`qk_core.capture.moments` names
(keys, shapes and the accumulation dtype are that module's doc): batched over heads and buckets, with no loop over
positions, in torch on whatever device the rows are. :func:`pack_symmetric` keeps the symmetric d x d sums as the
upper triangles a moments file stores, and :func:`to_host` moves every layer's sums to the host in one transfer,
once per document. Everything after that (the merge, the files) is host numpy in :mod:`qk_core.capture.moments`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from qk_core.capture.moments import LW_INTENSITIES, SYMMETRIC, LayerMoments, upper_triangle_index


def _pos_sums(pos: np.ndarray, B: int, J: int) -> dict[str, np.ndarray]:
    """Position-only float64 sums per bucket (exact for integer positions): n, t, tt, s, ss, s3, s4."""
    t = np.asarray(pos, dtype=np.float64)
    b = np.clip(np.floor_divide(t, B).astype(np.int64), 0, J - 1)
    s = t - (b + 0.5) * B
    return {name: np.bincount(b, weights=w, minlength=J) for name, w in
            (("n", np.ones_like(t)), ("t", t), ("tt", t * t), ("s", s), ("ss", s * s), ("s3", s**3), ("s4", s**4))}


@dataclass(frozen=True, eq=False)
class _Buckets:
    """How a set of positions regroups into buckets (:func:`_bucketed`), with its device tensors: formed once per
    document and reused by every layer (:class:`BucketLayouts`). ``order`` / ``flat`` are None for every position
    of a document (0..n-1, the capture's case: a zero-padded reshape)."""

    n: int
    U: int  # buckets holding a position
    M: int  # rows per bucket after padding (the largest count)
    used: np.ndarray  # (U,) their numbers
    used_t: Any  # the same on the device
    order: Any  # (n,) rows in bucket order, or None
    flat: Any  # (n,) slot of each ordered row in the (U M) padded rows, or None
    t: Any  # (U, M) positions, 0 at the padding, in the accumulation dtype
    s: Any  # (U, M) t - tau_b
    sums: dict[str, Any]  # :func:`_pos_sums` as float64 tensors on the device
    rows: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # :func:`_bucketed` buffers, reused per layer


class BucketLayouts:
    """The bucket layouts (:class:`_Buckets`) of the position sets a capture hands :func:`accumulate`, kept for the
    next layers of the same document: each is formed once, with no host-to-device copy per layer. Holds the last
    ``kept`` sets, by (positions, B, J, device, dtype); a :class:`qk_core.capture.hook.CaptureSession` owns one."""

    def __init__(self, kept: int = 8) -> None:
        self.kept = int(kept)
        self._layouts: dict[tuple[Any, ...], _Buckets] = {}

    def get(self, pos: np.ndarray, B: int, J: int, dev: Any, dtype: Any) -> _Buckets:
        """The layout of positions ``pos`` in buckets of width ``B`` (J of them) on ``dev``, positions in ``dtype``."""
        import torch

        pos = np.asarray(pos, dtype=np.int64)
        n = len(pos)
        every = bool(n and n <= J * B and pos[0] == 0 and pos[-1] == n - 1 and np.all(np.diff(pos) == 1))
        key = (("every", n) if every else hashlib.blake2b(pos.tobytes(), digest_size=16).digest(), n, B, J,
               str(dev), str(dtype))
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        for held in self._layouts.values():  # row buffers (_rows_buffer) are kept for the newest layouts only
            held.rows.clear()
        b = np.clip(np.floor_divide(pos, B), 0, J - 1)
        counts = np.bincount(b, minlength=J)
        used = np.flatnonzero(counts)
        U, M = len(used), max(int(counts.max()) if n else 0, 1)
        order = flat = None
        if every:  # bucket u holds rows u B .. u B + B - 1: already in order
            slots, ordered = np.arange(n), pos
        else:
            ordering = np.argsort(b, kind="stable")
            rank = np.zeros(J, dtype=np.int64)
            rank[used] = np.arange(len(used))
            slots = (rank[b[ordering]] * M + np.arange(n)
                     - np.repeat(np.cumsum(counts[used]) - counts[used], counts[used]))
            ordered = pos[ordering]
            order, flat = torch.as_tensor(ordering, device=dev), torch.as_tensor(slots, device=dev)
        t = np.zeros(U * M)
        t[slots] = ordered
        s = np.zeros(U * M)
        s[slots] = ordered - (np.repeat(used, counts[used]) + 0.5) * B
        out = _Buckets(n, U, M, used, torch.as_tensor(used, device=dev), order, flat,
                       torch.as_tensor(t.reshape(U, M), device=dev).to(dtype),
                       torch.as_tensor(s.reshape(U, M), device=dev).to(dtype),
                       {k: torch.as_tensor(v, device=dev) for k, v in _pos_sums(pos, B, J).items()})
        if len(self._layouts) >= self.kept:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = out
        return out


def _rows_buffer(bk: _Buckets, name: str, H: int, d: int, dtype: Any, dev: Any) -> Any:
    """The (H, U, M, d) buffer ``name`` of layout ``bk``, zeros when made (a caller writes only the rows' real
    positions, so the padding's rows stay zero)."""
    import torch

    key = (name, H, d, dtype, str(dev))
    Y = bk.rows.get(key)
    if Y is None:
        Y = torch.zeros((H, bk.U, bk.M, d), dtype=dtype, device=dev)
        bk.rows[key] = Y
    return Y


def _bucketed(x: Any, bk: _Buckets, dtype: Any, name: str) -> Any:
    """Rows of ``x`` (H, n, d) regrouped by bucket into (H, U, M, d) in ``dtype`` for the U buckets of ``bk`` that
    hold a position, zero rows as padding (M = the largest bucket count): one copy from ``x``, whatever its strides,
    into the buffer ``name`` of ``bk`` (:func:`_rows_buffer`), reused by the next layers."""
    H, n, d = x.shape
    Y = _rows_buffer(bk, name, H, d, dtype, x.device)
    if bk.order is None:  # every position in order: bucket u holds rows u M .. u M + M - 1
        full = n // bk.M
        if full:
            Y[:, :full].copy_(x[:, : full * bk.M].unflatten(1, (full, bk.M)))
        if full < bk.U:
            Y[:, full, : n - full * bk.M].copy_(x[:, full * bk.M:])
    else:  # (a gather from the strided view attention hands over was pathologically slow on a loaded CPU)
        Y.view(H, bk.U * bk.M, d)[:, bk.flat] = x.contiguous().index_select(1, bk.order).to(dtype)
    return Y


def _weighted(w: Any, X: Any) -> Any:
    """sum_m w[.., j, m] X[h, j, m, :] for weights (J, M) or (H, J, M) and rows X (H, J, M, d): one batched
    matrix product (torch's einsum of the same was several times slower on CPU)."""
    return (w.unsqueeze(-2) @ X).squeeze(-2)


def _grouped_order(kv_index: Any, Hq: int, Hk: int) -> bool:
    """Whether ``kv_index`` is grouped-query order, query head h on KV row h // (Hq / Hk) (the capture's case: the
    pairs then broadcast each KV head over its query heads, no gathered copy). An index on an accelerator is not
    read back (that would wait for the device): it counts as not grouped."""
    import torch

    if isinstance(kv_index, torch.Tensor):
        if kv_index.device.type != "cpu":
            return False
        kv_index = kv_index.numpy()
    return Hq % Hk == 0 and np.array_equal(np.asarray(kv_index), np.arange(Hq) // (Hq // Hk))


def accumulate(q: Any, q_pos: np.ndarray, k: Any, k_pos: np.ndarray, kv_index: Any, bucket: int,
               n_buckets: int, dtype: Any = None, lw_intensity: str = "exact",
               layouts: BucketLayouts | None = None, native: bool | None = None) -> dict[str, Any]:
    """SPEC 12.1 sums of one document: torch tensors on the device of ``q`` (keys: module doc).

    ``q`` (Hq, n_q, d) query vectors at positions ``q_pos`` (n_q,), ``k`` (Hk, n_k, d) key vectors at
    ``k_pos`` (n_k,), torch tensors (a numpy array is taken as a CPU tensor); positions are distinct within
    a document. ``kv_index`` (Hq,), numpy or a tensor: the row of ``k`` of each query head's KV head. Vector
    sums are formed in ``dtype`` (default: the dtype of ``q`` promoted to at least float32), each over the rows
    of one bucket; the per-bucket query sums are returned in ``dtype``, the pooled and position-only sums in
    float64. Heads and buckets are batched (no Python loop over either, nor over positions); the bucket layout
    of a set of positions is taken from ``layouts`` (formed there once for the next layers; default: for this
    call only). ``lw_intensity = "exact"`` adds the ``LW_KEYS`` sums.

    ``native``: form the vector sums from bf16 / fp16 inputs as they are, products exact and accumulated in
    float32 (:func:`_accumulate_native`: the tensor cores on a CUDA device), instead of widening the rows to
    ``dtype`` first. None (default): where it applies and runs on the tensor cores (a CUDA device that passes
    :func:`native_works`, bf16 / fp16 rows, float32 sums, the Gaussian form, every position of a document with
    the same query and key positions). True forces it where it applies (on a CPU it widens the operands, same
    algebra: the tests' path).
    """
    import torch

    if lw_intensity not in LW_INTENSITIES:
        raise ValueError(f"lw_intensity must be one of {LW_INTENSITIES}, got {lw_intensity!r}")
    q, k = torch.as_tensor(q), torch.as_tensor(k)
    dev = q.device
    acc = dtype or torch.promote_types(q.dtype, torch.float32)
    f64 = torch.float64
    B, J = int(bucket), int(n_buckets)
    Hq, Hk, d = q.shape[0], k.shape[0], q.shape[-1]
    exact = lw_intensity == "exact"
    grouped = _grouped_order(kv_index, Hq, Hk)
    kv = (kv_index.to(dev) if isinstance(kv_index, torch.Tensor)
          else torch.as_tensor(np.asarray(kv_index, dtype=np.int64), device=dev))
    q_pos, k_pos = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
    out: dict[str, Any] = {}

    # position-only sums in float64, from the layout of the positions (broadcast over heads)
    layouts = BucketLayouts() if layouts is None else layouts
    qb, kb = layouts.get(q_pos, B, J, dev, acc), layouts.get(k_pos, B, J, dev, acc)
    for name in ("n", "t", "tt", "s", "ss", *(("s3", "s4") if exact else ())):
        out[f"q_{name}"] = qb.sums[name].repeat(Hq, 1)
    for name in ("n", "t", "tt"):
        out[f"k_{name}"] = kb.sums[name].sum().repeat(Hk)
    if (native is not False and _native_applies(q, k, acc, exact, qb, kb, q_pos, k_pos)
            and (native or (dev.type == "cuda" and native_works(dev)))):
        _accumulate_native(q, k, kv, grouped, qb, B, J, out)
        return out

    # the rows are copied once, bucket by bucket, into buffers kept for the next layers (_bucketed); per (head,
    # bucket) one batched Gram X^T X holds sum x x^T (the padding's zero rows add nothing), and sum x and sum x t are
    # a sum and a weighted sum over the bucket's rows. On the 2-core development CPU a SmolLM2 layer's call at 2K
    # took 3.8 ms (median) this way, 4.4 ms with Grams of rows augmented with [1, t] (d + 2 wide, odd for the BLAS
    # kernels), with the same x x^T bits (2026-11-30, bench/results/accumulate_cpu.md)
    X = _bucketed(q, qb, acc, "q")  # (Hq, U, M, d)
    vals = {"q_x": X.sum(2), "q_xt": _weighted(qb.t, X), "q_xx": X.mT @ X}
    if exact:
        sp = qb.s
        Xt, r2 = X.transpose(-1, -2), (X * X).sum(-1)  # (Hq, U, M)
        vals.update({
            "q_xxs": Xt @ (X * sp[..., None]), "q_xxs2": Xt @ (X * (sp * sp)[..., None]),
            "q_xs2": _weighted(sp * sp, X), "q_xs3": _weighted(sp * sp * sp, X),
            "q_r2x": _weighted(r2, X), "q_r2xs": _weighted(r2 * sp, X),
            "q_r4": (r2 * r2).sum(2), "q_r2": r2.sum(2), "q_r2s": (r2 * sp).sum(2), "q_r2s2": (r2 * sp * sp).sum(2)})
    for key, v in vals.items():
        if len(qb.used) == J:
            out[key] = v
        else:  # buckets without a position sum to 0
            out[key] = torch.zeros((Hq, J, *v.shape[2:]), dtype=v.dtype, device=dev)
            out[key][:, qb.used_t] = v
    del vals

    # key sums, pooled; formed per bucket as well (bounded float32 sums), added in float64
    K = _bucketed(k, kb, acc, "k")
    out["k_x"] = K.sum(2).sum(1, dtype=f64)
    out["k_xt"] = _weighted(kb.t, K).sum(1, dtype=f64)
    out["k_xx"] = (K.mT @ K).sum(1, dtype=f64)

    # same-position pairs delta = q - k(kv head), per bucket
    paired = np.array_equal(q_pos, k_pos)  # the capture's case: rows already paired, none to select
    common, iq, ik = ((q_pos, None, None) if paired else
                      np.intersect1d(q_pos, k_pos, assume_unique=True, return_indices=True))
    out["p_n"] = torch.full((Hq,), float(len(common)), dtype=f64, device=dev)
    if len(common) and paired:  # one layout (qb is kb): subtract the rows laid out above (padding stays 0)
        D = _rows_buffer(qb, "p", Hq, d, acc, dev)
        Kq = K.unsqueeze(1) if grouped else K.index_select(0, kv)
        torch.sub(X.unflatten(0, (Hk, Hq // Hk)) if grouped else X, Kq,
                  out=D.unflatten(0, (Hk, Hq // Hk)) if grouped else D)
    elif len(common):
        diff = (q.index_select(1, torch.as_tensor(iq, device=dev)).to(acc)
                - k.index_select(1, torch.as_tensor(ik, device=dev)).index_select(0, kv).to(acc))
        D = _bucketed(diff, layouts.get(common, B, J, dev, acc), acc, "p")
    if len(common):
        out["p_x"] = D.sum(2).sum(1, dtype=f64)
        out["p_xx"] = (D.mT @ D).sum(1, dtype=f64)
    else:
        out["p_x"] = torch.zeros((Hq, d), dtype=f64, device=dev)
        out["p_xx"] = torch.zeros((Hq, d, d), dtype=f64, device=dev)
    return out


def _native_applies(q: Any, k: Any, acc: Any, exact: bool, qb: _Buckets, kb: _Buckets, q_pos: np.ndarray,
                    k_pos: np.ndarray) -> bool:
    """Whether :func:`_accumulate_native` computes this call's sums: bf16 / fp16 rows of one dtype, float32 sums,
    the Gaussian form, every position of the document in order (no reordering), the same positions for Q and K."""
    import torch

    return (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and acc == torch.float32
            and not exact and qb.order is None and kb.order is None and np.array_equal(q_pos, k_pos))


@cache
def native_works(dev: Any) -> bool:
    """Whether :func:`_accumulate_native` runs on ``dev`` (on CUDA: torch >= 2.8's ``bmm(out_dtype=float32)`` on
    the operand layouts it uses) and gives the widened path's sums there within float32 rounding, on a small random
    bf16 layer with a partial last bucket and an empty one. Checked once per device; where it fails, :func:`accumulate`
    widens the rows (same sums, slower)."""
    import torch

    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    Hq, Hk, n, d, B, J = 4, 2, 80, 16, 32, 4
    q, k = (torch.randn((n, h, d), generator=g, device=dev).to(torch.bfloat16).transpose(0, 1) for h in (Hq, Hk))
    pos, kv = np.arange(n), np.arange(Hq) // (Hq // Hk)
    try:
        native = accumulate(q, pos, k, pos, kv, B, J, torch.float32, "gaussian", native=True)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    widened = accumulate(q, pos, k, pos, kv, B, J, torch.float32, "gaussian", native=False)
    return all(bool(((native[key].double() - w.double()).abs().max() <= 1e-5 * w.double().abs().max()).item())
               for key, w in widened.items())


def _mm32(a: Any, b: Any) -> Any:
    """Batched ``a @ b`` of bf16 / fp16 operands with float32 products and sums: on a CUDA device the tensor cores
    (exact products, float32 accumulation, float32 out); elsewhere the operands widened to float32 (exact too)."""
    import torch

    if a.device.type == "cuda":
        return torch.bmm(a, b, out_dtype=torch.float32)  # native_works(device) checked that this runs and is right
    return torch.bmm(a.float(), b.float())


def _bucket_major(x: Any, U: int, M: int) -> Any:
    """Rows of ``x`` (H, n, d), every position in order, as (U, H, M, d) in their own dtype: bucket u holds rows
    u M .. u M + M - 1, zero rows after the last position (one copy, whatever the strides of ``x``)."""
    import torch

    H, n, d = x.shape
    full = n // M
    X = (torch.empty if full == U else torch.zeros)((U, H, M, d), dtype=x.dtype, device=x.device)
    if full:
        X[:full].copy_(x[:, : full * M].unflatten(1, (full, M)).transpose(0, 1))
    if full < U:
        X[full, :, : n - full * M].copy_(x[:, full * M:])
    return X


def _accumulate_native(q: Any, k: Any, kv: Any, grouped: bool, qb: _Buckets, B: int, J: int,
                       out: dict[str, Any]) -> None:
    """The vector sums of :func:`accumulate` (Gaussian form) from bf16 / fp16 rows of every position, into ``out``.

    Every product is exact in float32 (two bf16 / fp16 significands, or one and an integer below 256) and every
    sum over one bucket's rows (<= B terms) is accumulated in float32, as the widened path's; on a CUDA device
    the batched products run on the tensor cores (``_mm32``) and read the rows in their own dtype. Rows are laid
    out bucket-major once per tensor (``_bucket_major``). Position weights enter exactly: sum x t over bucket u
    is u B sum x + sum_i 256^i sum x m_i, m_i the base-256 digits of the row's offset m = t - u B in its bucket,
    added in float64. Same-position pairs delta = q - k are expanded, sum delta delta^T = sum q q^T - sum q k^T
    - sum k q^T + sum k k^T, each summed per bucket in float32 and the four added in float64: the error is that
    of the float32 sums of the four terms (relative to their size, not to |sum delta delta^T|).
    """
    import torch

    f32, f64 = torch.float32, torch.float64
    dev = q.device
    Hq, _, d = q.shape
    Hk = k.shape[0]
    U, M = qb.U, qb.M
    X, K = _bucket_major(q, U, M), _bucket_major(k, U, M)
    Xr, Kr = X.view(U * Hq, M, d), K.view(U * Hk, M, d)
    digits = 1
    while 256**digits < M:  # base-256 digits of the offsets 0 .. M - 1
        digits += 1
    m = torch.arange(M, device=dev)
    W = torch.stack([torch.ones(M, device=dev, dtype=torch.long)]
                    + [(m // 256**i) % 256 for i in reversed(range(digits))]).to(q.dtype)  # (1 + digits, M)
    start = qb.used_t.to(f64) * B  # (U,) first position of each bucket

    def weighted(R: Any, H: int) -> tuple[Any, Any]:
        """sum x and sum x t per (bucket, head) of R (U H, M, d): float64 (U, H, d) each."""
        S = _mm32(W.expand(U * H, *W.shape).contiguous(), R).view(U, H, 1 + digits, d).to(f64)
        scale = torch.tensor([256.0**i for i in reversed(range(digits))], dtype=f64, device=dev)
        offset = (S[:, :, 1:] * scale[:, None]).sum(2)
        return S[:, :, 0], start[:, None, None] * S[:, :, 0] + offset

    def per_bucket(v: Any, tail: tuple[int, ...]) -> Any:
        """(U, Hq, *tail) -> (Hq, J, *tail) float32, zero in the buckets without a position."""
        if U == J:
            return v.transpose(0, 1).to(f32).contiguous()
        full = torch.zeros((Hq, J, *tail), dtype=f32, device=dev)
        full[:, qb.used_t] = v.transpose(0, 1).to(f32)
        return full

    qx, qxt = weighted(Xr, Hq)
    qxx = _mm32(Xr.mT, Xr).view(U, Hq, d, d)
    out["q_x"], out["q_xt"], out["q_xx"] = per_bucket(qx, (d,)), per_bucket(qxt, (d,)), per_bucket(qxx, (d, d))
    kx, kxt = weighted(Kr, Hk)
    kxx = _mm32(Kr.mT, Kr).view(U, Hk, d, d).to(f64).sum(0)
    out["k_x"], out["k_xt"], out["k_xx"] = kx.sum(0), kxt.sum(0), kxx

    # sum q k^T of each query head with its KV head, per bucket: by group (query heads g, g + G, ... of a KV head
    # are a strided batch of the bucket-major rows, no copy), else the KV rows gathered per query head
    if grouped:
        G = Hq // Hk
        Xg = X.view(U * Hk, G, M, d)
        cross = torch.stack([_mm32(Xg[:, g].mT, Kr).view(U, Hk, d, d).to(f64).sum(0) for g in range(G)], 1)
        cross = cross.flatten(0, 1)
    else:
        Kq = K.index_select(1, kv).view(U * Hq, M, d)
        cross = _mm32(Xr.mT, Kq).view(U, Hq, d, d).to(f64).sum(0)
    out["p_n"] = qb.sums["n"].sum().repeat(Hq)
    out["p_x"] = qx.sum(0) - kx.sum(0)[kv]
    out["p_xx"] = qxx.to(f64).sum(0) - cross - cross.mT + kxx[kv]


def to_host(per_layer: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, np.ndarray]]:
    """Every layer's device sums to host numpy in one transfer (SPEC 1.3, 12.1), each in its own dtype. Sums
    already on the host come back as views of their tensors (no copy): valid while those hold them."""
    import torch

    items = [(layer, key, t.contiguous()) for layer, sums in sorted(per_layer.items()) for key, t in sums.items()]
    if not items:
        return {}
    if all(t.device.type == "cpu" for _, _, t in items):
        host: dict[int, dict[str, np.ndarray]] = {}
        for layer, key, t in items:
            host.setdefault(layer, {})[key] = t.numpy()
        return host
    raw = torch.cat([t.reshape(-1).view(torch.uint8) for _, _, t in items]).cpu().numpy()
    out: dict[int, dict[str, np.ndarray]] = {}
    offset = 0
    for layer, key, t in items:
        size = t.numel() * t.element_size()
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))
        out.setdefault(layer, {})[key] = raw[offset: offset + size].view(dtype).reshape(tuple(t.shape))
        offset += size
    return out


def document_moments(layer: int, q_heads: Sequence[int], kv_heads: Sequence[int], kv_index: Sequence[int],
                     q: Any, q_pos: np.ndarray, k: Any, k_pos: np.ndarray, bucket: int, n_buckets: int,
                     example_id: int, dtype: Any = None, lw_intensity: str = "exact") -> LayerMoments:
    """:func:`accumulate` of one document and layer as a host float64 :class:`LayerMoments` (rows from numpy or
    torch)."""
    host = to_host({layer: accumulate(q, q_pos, k, k_pos, np.asarray(kv_index), bucket, n_buckets, dtype,
                                      lw_intensity)})
    return LayerMoments(int(layer), np.asarray(q_heads, np.int64), np.asarray(kv_heads, np.int64),
                        np.asarray(kv_index, np.int64), int(bucket), int(n_buckets),
                        {key: a.astype(np.float64) for key, a in host[layer].items()}, [int(example_id)])


# ---- packing on the device ---------------------------------------------------------------------------


def triangle_index(d: int, device: Any) -> Any:
    """The flat d x d index of each upper-triangle entry as a torch tensor on ``device`` (:func:`pack_symmetric`)."""
    import torch

    return torch.as_tensor(upper_triangle_index(d), device=device)


def pack_symmetric(sums: Mapping[str, Any], index: Any) -> dict[str, Any]:
    """Torch sums of :func:`accumulate` with their symmetric d x d sums as the upper triangles a moments file
    stores (:data:`qk_core.capture.moments.SYMMETRIC`; ``index``: :func:`triangle_index` on their device): half the
    bytes to move and write; :func:`qk_core.capture.moments.write_moments` takes them as they are. One gather along
    the flattened last axis: for a SmolLM2 layer's (9, 16) query sums at 2K an index_select there took 0.35 ms on
    the 2-core development CPU, the gather 0.09 ms (2026-11-29)."""
    return {k: _gather_last(v.flatten(-2), index) if k in SYMMETRIC else v for k, v in sums.items()}


def _gather_last(v: Any, index: Any) -> Any:
    """``v[..., index]`` for a 1-D ``index``, as one gather (the index broadcast over the leading axes)."""
    import torch

    return torch.gather(v, -1, index.expand(*v.shape[:-1], -1))
