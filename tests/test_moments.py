"""Every head, every position (SPEC 12): moments accumulated over exactly the sampled rows of a capture give
the row path's PCA, rotation and query model to 1e-10 relative in float64 (SPEC 12.2), and the merge of
per-document moments is exact and independent of document order (SPEC 12.1)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.accumulation import BucketLayouts, accumulate, document_moments
from qk_core.capture.moments import DOC_KEYS, LW_KEYS, LayerMoments, merge_documents
from qk_core.capture.store import CaptureReader, HeadData
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.geometry.driver import run_geometry
from qk_core.geometry.from_moments import layer_geometry
from qk_core.geometry.heads import iter_capture_heads
from qk_core.io.storage import Storage
from qk_core.plasticity.estimators import closed_form
from qk_core.plasticity.query_model import fit_query_model, fit_query_model_from_moments

torch.set_num_threads(1)
REL = 1e-10
N_DOCS = 9  # odd: the split halves differ in size


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Storage, Any, dict[int, list[HeadData]]]:
    """A tiny llama (GQA 4 q / 2 kv heads, d = 16) captured over 9 documents of different lengths."""
    tmp = tmp_path_factory.mktemp("moments")
    tm.build_tiny_model("llama", tmp / "model")
    texts = [t[: 80 + 6 * i] for i, t in enumerate(tm.sample_texts(N_DOCS, 140, seed=5))]
    tm.write_corpus_jsonl(tmp / "corpus.jsonl", texts, ids=[30 - 3 * i for i in range(N_DOCS)])
    reg = load_registry(tm.write_registry(tmp / "registry.toml", {"m": {
        "family": "llama", "source": {"local": str(tmp / "model")}, "window": 128, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 13, "moments": True}}}, tmp / "corpus.jsonl"))
    storage = Storage(tmp / "root")
    res = capture_model(reg.model("m"), local_corpus(reg.corpus("tiny").params), storage, device="cpu")
    reader = CaptureReader(storage, res.prefix)
    by_layer: dict[int, list[HeadData]] = {}
    for row in res.heads.sort_values(["layer", "q_head"]).itertuples():
        by_layer.setdefault(int(row.layer), []).append(reader.read_head(int(row.layer), int(row.q_head)))
    return storage, res, by_layer


def per_document_moments(heads: list[HeadData]) -> list[LayerMoments]:
    """SPEC 12.1 moments of one layer per document, from exactly the head's sampled rows (float64)."""
    q_heads = [h.q_head for h in heads]
    kv_heads = sorted({h.kv_head for h in heads})
    kv_index = [kv_heads.index(h.kv_head) for h in heads]
    k_rows = {h.kv_head: h for h in heads}
    out = []
    def rows(x: np.ndarray, pos: np.ndarray, docs: np.ndarray, doc: int) -> tuple[np.ndarray, np.ndarray]:
        sel = np.flatnonzero(docs == doc)
        sel = sel[np.argsort(pos[sel])]
        return x[sel], pos[sel]

    for doc in np.unique(heads[0].q_doc):
        qs = [rows(h.q, h.q_pos, h.q_doc, doc) for h in heads]
        ks = [rows(k_rows[kv].k, k_rows[kv].k_pos, k_rows[kv].k_doc, doc) for kv in kv_heads]
        assert all(np.array_equal(p, qs[0][1]) for _, p in qs) and all(np.array_equal(p, ks[0][1]) for _, p in ks)
        out.append(document_moments(heads[0].layer, q_heads, kv_heads, kv_index, np.stack([x for x, _ in qs]),
                                    qs[0][1], np.stack([x for x, _ in ks]), ks[0][1], heads[0].bucket,
                                    -(-heads[0].window // heads[0].bucket), int(doc), dtype=torch.float64))
    return out


def assert_rel(got: Any, want: Any, what: str) -> None:
    """Equal to 1e-10 relative: scalars against their magnitude, arrays against their largest element."""
    if want is None or isinstance(want, (str, bool, np.bool_)) or got is None:
        assert got == want or (got is None and want is None), f"{what}: {got!r} != {want!r}"
        return
    g, w = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaN pattern differs"
    fin = np.isfinite(w)
    if not fin.any():
        return
    scale = np.abs(w[fin]) if w.ndim == 0 else np.max(np.abs(w[fin]))
    err = np.max(np.abs(g[fin] - w[fin]))
    assert err <= REL * max(float(np.max(scale)), 1e-300), f"{what}: |{g} - {w}| = {err:.3g} (scale {scale})"


@pytest.mark.slow  # the module's capture fixture takes ~10 s on a busy CPU
@pytest.mark.parametrize("floor", ["permutation", "beta"])
@pytest.mark.parametrize("separation", ["centroid", "eigen"])
def test_geometry_from_moments_equals_the_row_path(capture: Any, floor: str, separation: str) -> None:
    storage, res, by_layer = capture
    pca_o = PCAOptions()
    rot_o = RotationOptions(separation=separation, capture_floor=floor)
    rows = run_geometry("m", iter_capture_heads(storage, res.heads), pca_o, rot_o)
    pca_t, rot_t = rows["pca"][0].set_index(["layer", "q_head"]), rows["rotation"][0].set_index(["layer", "q_head"])
    n_heads = 0
    for layer, heads in by_layer.items():
        lm = merge_documents(per_document_moments(heads))
        floors = ({int(h): float(rot_t.loc[(layer, h), "r2_floor"]) for h in lm.q_heads}
                  if floor == "permutation" else None)
        for rec in layer_geometry(lm, heads[0].window, pca_o, rot_o, floors):
            key = (layer, rec["q_head"])
            assert rec["n_q"] == rot_t.loc[key, "n_q"] and rec["n_k"] == rot_t.loc[key, "n_k"]
            assert rec["n_docs"] == N_DOCS
            for name, value in rec["pca"].items():
                assert_rel(value, pca_t.loc[key, name], f"pca {key} {name}")
            for name, value in rec["rotation"].items():
                want = rot_t.loc[key, name]
                if name == "notes" or name.startswith("complement"):
                    continue  # rows only (SPEC 12.1): the complement needs angles of individual vectors
                assert_rel(value, want, f"rotation {key} {name}")
            assert rec["rotation"]["status"] == "ok" and rec["pca"]["status"] == "ok"
            n_heads += 1
    assert n_heads == len(res.heads) == 13


@pytest.mark.slow
@pytest.mark.parametrize("covariance", ["full", "diagonal"])
def test_query_model_from_moments_equals_the_row_path(capture: Any, covariance: str) -> None:
    _, _, by_layer = capture
    rng = np.random.default_rng(0)
    for heads in by_layer.values():
        lm = merge_documents(per_document_moments(heads))
        for i, h in enumerate(heads):
            J = lm.n_buckets
            rows = fit_query_model(h.q, h.q_pos, h.window, h.bucket, covariance, min_queries=10)
            mom = fit_query_model_from_moments({k[2:]: v[i] for k, v in lm.sums.items() if k.startswith("q_")},
                                               h.window, h.bucket, covariance, min_queries=10)
            assert mom.status == rows.status and np.array_equal(mom.n_queries, rows.n_queries)
            for name in ("alpha", "beta", "H", "alpha_pos", "beta_pos", "sigma_pos2", "r2", "mean", "cov",
                         "shrinkage"):
                assert_rel(getattr(mom, name), getattr(rows, name), f"L{h.layer}H{h.q_head} {covariance} {name}")
            if covariance == "full":
                assert np.nanmax(rows.shrinkage) > 0.01  # the Ledoit-Wolf intensity is exercised
            delta = h.k[rng.integers(0, len(h.k), 64)] - h.k[rng.integers(0, len(h.k), 64)]
            for b in range(1, J):
                if rows.status[b] != "ok":
                    continue
                cf_m, cf_r = closed_form(mom, b, delta), closed_form(rows, b, delta)
                for name in ("m", "v", "z", "pp"):
                    assert_rel(getattr(cf_m, name), getattr(cf_r, name), f"closed form b={b} {name}")


def random_documents(n_docs: int, seed: int = 1) -> list[LayerMoments]:
    """Per-document moments of random rows of documents of different lengths (ids not in order)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_docs):
        n = 20 + 7 * i
        q, k = rng.normal(size=(4, n, 6)), rng.normal(size=(2, n, 6))
        out.append(document_moments(3, range(4), range(2), [0, 0, 1, 1], q, np.arange(n), k, np.arange(n), 16, 4,
                                    (17 * i) % 23, dtype=torch.float64))
    return out


def test_merge_is_exact_and_independent_of_document_order() -> None:
    docs = random_documents(7)
    one = merge_documents(docs)
    order = np.random.default_rng(1).permutation(len(docs))
    shuffled = merge_documents([docs[i] for i in order])
    shards = merge_documents(docs[4:] + docs[:4])  # two workers' documents, committed in any order
    assert one.docs == sorted(one.docs) == shuffled.docs == shards.docs
    for key in one.sums:
        assert np.array_equal(one.sums[key], shuffled.sums[key]), key  # to the last bit
        assert np.array_equal(one.sums[key], shards.sums[key]), key
    for key in DOC_KEYS:
        np.testing.assert_allclose(one.sums[key], sum(d.sums[key] for d in docs), rtol=1e-13)
    # parity halves: the 1st, 3rd, ... documents by sorted id (SPEC 3 (i))
    ids = sorted(d.docs[0] for d in docs)
    by_id = {d.docs[0]: d for d in docs}
    for half, chosen in ((0, ids[::2]), (1, ids[1::2])):
        np.testing.assert_allclose(one.sums["kh_xt"][half], sum(by_id[e].sums["k_xt"] for e in chosen), rtol=1e-14)
        np.testing.assert_allclose(one.sums["qh_x"][half], sum(by_id[e].sums["q_x"].sum(axis=1) for e in chosen),
                                   rtol=1e-14)
        assert one.sums["qh_n"][half][0] == sum(by_id[e].sums["q_n"][0].sum() for e in chosen)
    with pytest.raises(ValueError, match="twice"):
        merge_documents([docs[0], docs[0]])


@pytest.mark.parametrize("layout", ["every position", "sampled, empty buckets"])
def test_accumulate_matches_a_float64_brute_force_and_bounds_float32(layout: str) -> None:
    """Every key of :func:`accumulate` against a numpy float64 brute force (SPEC 12.1): over every position of
    a document (the capture's case: a reshape) and over a sorted-out subset that leaves buckets empty; the
    Gaussian form is the same sums without the exact Ledoit-Wolf terms; float32 within its stated bound
    (sums over at most one bucket in float32)."""
    rng = np.random.default_rng(3)
    Hq, Hk, n, d, B, J = 4, 2, 200, 8, 32, 8
    q = rng.normal(size=(Hq, n, d)) + rng.normal(size=d) * 3 + np.arange(n)[None, :, None] * 0.01
    k = rng.normal(size=(Hk, n, d))
    pos = np.arange(n)
    if layout != "every position":  # buckets 2 and 7 empty, the others partly filled, rows out of order
        keep = rng.permutation(np.flatnonzero((pos // B != 2) & (rng.random(n) < 0.6)))
        q, k, pos = q[:, keep], k[:, keep], pos[keep]
        assert 0 < len(pos) < n and 2 not in pos // B
    kv_index = np.array([0, 0, 1, 1])
    got = document_moments(0, range(Hq), range(Hk), kv_index, q, pos, k, pos, B, J, 7, dtype=torch.float64).sums
    t = pos.astype(float)
    b = np.minimum(pos // B, J - 1)
    s = t - (b + 0.5) * B
    onehot = np.eye(J)[b]  # (n, J)
    r2 = (q * q).sum(-1)
    n = len(pos)
    want = {
        "q_n": np.tile(onehot.sum(0), (Hq, 1)), "q_t": np.tile(t @ onehot, (Hq, 1)),
        "q_tt": np.tile((t * t) @ onehot, (Hq, 1)),
        "q_x": np.einsum("hnd,nj->hjd", q, onehot), "q_xt": np.einsum("hnd,n,nj->hjd", q, t, onehot),
        "q_xx": np.einsum("hnd,hne,nj->hjde", q, q, onehot),
        "q_xxs": np.einsum("hnd,hne,n,nj->hjde", q, q, s, onehot),
        "q_xxs2": np.einsum("hnd,hne,n,nj->hjde", q, q, s * s, onehot),
        "q_xs2": np.einsum("hnd,n,nj->hjd", q, s * s, onehot), "q_xs3": np.einsum("hnd,n,nj->hjd", q, s**3, onehot),
        "q_r2x": np.einsum("hn,hnd,nj->hjd", r2, q, onehot), "q_r2xs": np.einsum("hn,hnd,n,nj->hjd", r2, q, s, onehot),
        "q_r4": np.einsum("hn,nj->hj", r2 * r2, onehot), "q_r2": np.einsum("hn,nj->hj", r2, onehot),
        "q_r2s": np.einsum("hn,n,nj->hj", r2, s, onehot), "q_r2s2": np.einsum("hn,n,nj->hj", r2, s * s, onehot),
        "q_s": np.tile(s @ onehot, (Hq, 1)), "q_ss": np.tile((s * s) @ onehot, (Hq, 1)),
        "q_s3": np.tile(s**3 @ onehot, (Hq, 1)), "q_s4": np.tile(s**4 @ onehot, (Hq, 1)),
        "k_n": np.full(Hk, n), "k_t": np.full(Hk, t.sum()), "k_tt": np.full(Hk, (t * t).sum()),
        "k_x": k.sum(1), "k_xt": np.einsum("hnd,n->hd", k, t), "k_xx": np.einsum("hnd,hne->hde", k, k),
        "p_n": np.full(Hq, n), "p_x": (q - k[kv_index]).sum(1),
        "p_xx": np.einsum("hnd,hne->hde", q - k[kv_index], q - k[kv_index]),
    }
    assert set(got) == set(want) == set(DOC_KEYS) | set(LW_KEYS)
    for key, w in want.items():
        np.testing.assert_allclose(got[key], w, rtol=1e-12, atol=1e-12 * np.abs(w).max(), err_msg=key)
    gauss = document_moments(0, range(Hq), range(Hk), kv_index, q, pos, k, pos, B, J, 7, dtype=torch.float64,
                             lw_intensity="gaussian").sums
    assert set(gauss) == set(DOC_KEYS)
    for key in DOC_KEYS:
        assert np.array_equal(gauss[key], got[key]), key
    # float32 accumulation: each bucket sum in float32 (<= B terms), everything above in float64
    got32 = document_moments(0, range(Hq), range(Hk), kv_index, q.astype(np.float32), pos, k.astype(np.float32),
                             pos, B, J, 7, dtype=torch.float32).sums
    for key, w in want.items():
        assert got32[key].dtype == np.float64, key
        bound = 32 * np.sqrt(B) * 2.0**-24 * np.abs(w).max()  # float32 inputs (to the 4th power) and sums
        assert np.abs(got32[key] - w).max() <= bound, key


def test_row_buffers_kept_across_calls_leave_no_trace_of_earlier_rows() -> None:
    """:func:`accumulate` copies rows into buffers its bucket layouts keep for the next layers: a run of calls on
    one :class:`BucketLayouts` (new rows at the same positions, another length, sampled positions, keys at positions
    of their own, then the first positions again) gives each call the sums a call on fresh layouts gives, bit for
    bit; the pairs of keys at their own positions are those of the positions both hold (a float64 brute force)."""
    rng = np.random.default_rng(11)
    Hq, Hk, d, B, J = 6, 2, 8, 32, 8
    kv = np.arange(Hq) // (Hq // Hk)
    kept = BucketLayouts(kept=2)

    def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = rng.normal(size=(n, Hq, d)) + 2.0, rng.normal(size=(n, Hk, d))
        return tuple(torch.tensor(x, dtype=torch.float32).transpose(0, 1) for x in (q, k))  # strided, as attention's

    every, short = np.arange(200), np.arange(150)
    # two samples of 8 positions in each bucket: layouts of the same shape, other positions
    one, two = (np.concatenate([np.sort(rng.choice(np.arange(b * B, min(b * B + B, 200)), 8, replace=False))
                                for b in range(7)]) for _ in range(2))
    for q_pos, k_pos in ((every, every), (every, every), (short, short), (one, one), (two, two), (one, two),
                         (every, every)):
        q, k = rows(len(q_pos))[0], rows(len(k_pos))[1]
        got = accumulate(q, q_pos, k, k_pos, kv, B, J, torch.float32, "gaussian", kept)
        fresh = accumulate(q, q_pos, k, k_pos, kv, B, J, torch.float32, "gaussian")
        assert all(torch.equal(got[key], fresh[key]) for key in fresh), (len(q_pos), len(k_pos))
        common, iq, ik = np.intersect1d(q_pos, k_pos, return_indices=True)
        delta = q.double()[:, iq] - k.double()[kv][:, ik]
        assert got["p_n"][0] == len(common)
        np.testing.assert_allclose(got["p_x"], delta.sum(1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["p_xx"], delta.mT @ delta, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(("n", "B", "J", "kv_index"), [
    (256, 32, 8, [0, 0, 1, 1]),  # every bucket full, grouped-query heads
    (1000, 300, 4, [1, 0, 1, 0, 0, 1]),  # a partial last bucket, offsets of two base-256 digits, KV rows gathered
    (40, 64, 2, [0, 1, 2, 3]),  # shorter than one bucket: one partial bucket, buckets without a position
])
def test_native_accumulation_of_bf16_rows_matches_a_float64_brute_force(n: int, B: int, J: int,
                                                                        kv_index: list[int]) -> None:
    """The native path (bf16 rows multiplied as they are, float32 sums; the tensor cores on CUDA, here the same
    algebra on widened operands) gives every Gaussian-form key of :func:`accumulate` with the widened path's keys,
    shapes and dtypes, within the float32 bound of one bucket's sums, against float64 sums of the same bf16 rows
    laid out as attention hands them (heads of a (L, H, d) projection). Its pair sums are expanded (sum q q^T -
    sum q k^T - sum k q^T + sum k k^T): their bound is relative to those terms' size (module doc)."""
    rng = np.random.default_rng(n)
    Hq, Hk, d = len(kv_index), max(kv_index) + 1, 16
    q = rng.normal(size=(Hq, n, d)) * 2 + rng.normal(size=d) * 3 + np.arange(n)[None, :, None] * 0.01
    k = rng.normal(size=(Hk, n, d)) + 1.0
    q, k = (torch.tensor(x).bfloat16().transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k))
    pos, kv = np.arange(n), np.asarray(kv_index)
    want = accumulate(q.double(), pos, k.double(), pos, kv, B, J, torch.float64, "gaussian")
    native = accumulate(q, pos, k, pos, kv, B, J, torch.float32, "gaussian", native=True)
    widened = accumulate(q, pos, k, pos, kv, B, J, torch.float32, "gaussian", native=False)
    assert set(native) == set(widened) == set(want) == set(DOC_KEYS)
    qq, kk = want["q_xx"].abs().amax(), want["k_xx"].abs().amax()
    for key, w in want.items():
        assert native[key].dtype == widened[key].dtype and native[key].shape == widened[key].shape, key
        scale = (qq + kk) * 2 if key == "p_xx" else w.abs().amax()
        err = (native[key].double() - w).abs().amax()
        assert err <= 32 * np.sqrt(B) * 2.0**-24 * scale, (key, float(err / scale))
    # not forced: on a CPU the rows are widened (the native path runs only where it runs on tensor cores)
    auto = accumulate(q, pos, k, pos, kv, B, J, torch.float32, "gaussian")
    assert all(torch.equal(auto[key], widened[key]) for key in want)


def test_native_path_is_used_only_where_its_self_check_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`native_works` runs the native path on a small layer of the device and compares it with the widened
    one: it passes here, and fails for a product that is off by one part in 1e4 or that raises (an older torch
    without ``bmm(out_dtype=...)``), so such a device keeps the widened path."""
    from qk_core.capture import accumulation

    assert accumulation.native_works.__wrapped__("cpu")
    real = accumulation._mm32
    monkeypatch.setattr(accumulation, "_mm32", lambda a, b: real(a, b) * (1 + 1e-4))
    assert not accumulation.native_works.__wrapped__("cpu")

    def old_torch(a: Any, b: Any) -> Any:
        raise TypeError("bmm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(accumulation, "_mm32", old_torch)
    assert not accumulation.native_works.__wrapped__("cpu")


@pytest.mark.parametrize("tails", ["gaussian", "heavy"])
def test_gaussian_ledoit_wolf_intensity_tracks_the_exact_one_where_queries_are_gaussian(tails: str) -> None:
    """SPEC 4.1 / 12.1: the Gaussian intensity (the capture's default: no d x d sums beyond x x^T) against the
    exact one from the same sums. On planted Gaussian queries (a trend on position, a mean, a covariance with
    one large direction) they agree to sampling error, and so do the closed-form PP values; on heavy-tailed
    queries (Student t, 5 degrees of freedom) the exact intensity is larger, so the comparison can fail."""
    rng = np.random.default_rng(11)
    d, B, J, n = 8, 400, 4, 1600
    scale = np.diag(np.linspace(0.3, 3.0, d))
    z = rng.normal(size=(n, d)) if tails == "gaussian" else rng.standard_t(5, size=(n, d)) / np.sqrt(5 / 3)
    t = np.arange(n)
    q = (z @ scale + rng.normal(size=d) * 2 + np.outer(t, rng.normal(size=d)) * 1e-3)[None]
    k = rng.normal(size=(1, n, d))
    lm = document_moments(0, [0], [0], [0], q, t, k, t, B, J, 1, dtype=torch.float64)
    sums = {key[2:]: v[0] for key, v in lm.sums.items() if key.startswith("q_")}
    exact = fit_query_model_from_moments(sums, n, B)
    gauss = fit_query_model_from_moments({key: v for key, v in sums.items() if f"q_{key}" not in LW_KEYS}, n, B)
    assert (exact.lw_intensity, gauss.lw_intensity) == ("exact", "gaussian")
    assert np.array_equal(exact.mean, gauss.mean) and np.all(exact.shrinkage > 0)
    ratio = exact.shrinkage / gauss.shrinkage
    delta = rng.normal(size=(256, d))
    pp = [np.array([closed_form(m, b, delta).pp for b in range(1, J)]) for m in (exact, gauss)]
    if tails == "gaussian":
        assert np.all(np.abs(ratio - 1) < 0.25), ratio
        assert np.abs(pp[0] - pp[1]).max() < 1e-3
    else:
        assert np.all(ratio > 1.1) and np.median(ratio) > 1.2, ratio


@pytest.mark.slow
def test_plasticity_with_the_query_model_from_moments_equals_the_row_path(capture: Any) -> None:
    """SPEC 12.2 through the plasticity analysis: the query model from the moments of the same rows gives the
    same per-pair closed form, AP profile, bootstrap and diagnostics as the row path."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity.analysis import analyse_head

    _, _, by_layer = capture
    opts = PlasticityOptions(bootstrap=20, pairs_per_bucket=64, interval="percentile")
    heads = next(iter(by_layer.values()))
    lm = merge_documents(per_document_moments(heads))
    for i, h in enumerate(heads):
        rows = analyse_head(h, opts)
        mom = analyse_head(h, opts, query_sums={k[2:]: v[i] for k, v in lm.sums.items() if k.startswith("q_")})
        assert mom.row["coverage"] == "all" and rows.row["coverage"] == "sampled"
        assert mom.row["n_queries_model"] == rows.row["n_queries_model"] == len(h.q)
        assert np.isfinite(rows.ap[1:]).sum() >= 4
        for name in ("ap", "ap_empirical", "boot"):
            assert_rel(getattr(mom, name), getattr(rows, name), f"L{h.layer}H{h.q_head} {name}")
        for key, value in rows.row.items():
            if isinstance(value, (float, np.floating)):
                assert_rel(mom.row[key], value, f"L{h.layer}H{h.q_head} row {key}")
        for col in ("z", "pp", "delta_1"):
            assert_rel(mom.pairs[col].to_numpy(), rows.pairs[col].to_numpy(), f"pairs {col}")


def test_moments_round_trip_through_bytes() -> None:
    """The stored form (SPEC 12.1): every key back, symmetric sums from their upper triangle, no pickle."""
    from qk_core.capture.moments import moments_from_bytes, moments_to_bytes

    merged = merge_documents(random_documents(3))
    back = moments_from_bytes(moments_to_bytes([merged]))[merged.layer]
    assert back.docs == merged.docs and np.array_equal(back.kv_index, merged.kv_index)
    assert (back.bucket, back.n_buckets) == (merged.bucket, merged.n_buckets)
    assert set(back.sums) == set(merged.sums)
    for key, arr in merged.sums.items():
        np.testing.assert_allclose(back.sums[key], arr, rtol=1e-15, atol=1e-13 * np.abs(arr).max(), err_msg=key)


def test_pooled_decode_gives_the_bits_of_the_decoded_layer_pooled() -> None:
    """What PCA, rotation and the drift refits read (``decode_layer(pooled=True)``): each per-bucket query sum added
    over the buckets before its d x d unpacking is the decoded layer's bucket sum to the last bit, for a document's
    float32 sums (exact Ledoit-Wolf terms, a bucket without a position) and for a float64 merge; nothing else
    changes."""
    from qk_core.capture.accumulation import to_host
    from qk_core.capture.moments import PER_BUCKET, moments_from_bytes, moments_to_bytes

    rng = np.random.default_rng(4)
    pos = np.concatenate([np.arange(0, 30), np.arange(48, 75)])  # bucket 2 (32-47) holds no position
    q, k = (torch.as_tensor(rng.normal(size=(h, len(pos), 8)) * 3.7, dtype=torch.float32) for h in (4, 2))
    sums = to_host({5: accumulate(q, pos, k, pos, np.array([0, 0, 1, 1]), 16, 5, torch.float32, "exact")})[5]
    doc = LayerMoments(5, np.arange(4), np.arange(2), np.array([0, 0, 1, 1]), 16, 5, sums, [11])
    assert doc.sums["q_xx"].dtype == np.float32 and set(LW_KEYS) <= set(doc.sums)
    for layer in (doc, merge_documents(random_documents(3))):
        data = moments_to_bytes([layer])
        whole, pooled = moments_from_bytes(data)[layer.layer], moments_from_bytes(data, pooled=True)[layer.layer]
        assert (pooled.n_buckets, pooled.bucket, pooled.docs) == (1, whole.bucket, whole.docs)
        assert set(pooled.sums) == set(whole.sums)
        for key, arr in whole.sums.items():
            want = arr.sum(axis=1, keepdims=True) if key in PER_BUCKET else arr
            assert pooled.sums[key].dtype == np.float64 and np.array_equal(pooled.sums[key], want), key
        for key, arr in whole.q_pooled().items():
            assert np.array_equal(pooled.q_pooled()[key], arr), key


def test_permutation_floor_from_moments_matches_the_row_permutation() -> None:
    """SPEC 3 (ii) with every position (SPEC 12.2): the within-document permutation floor from the merged
    moments (exact permutation mean and covariance, Gaussian draws) agrees with permuting the rows themselves,
    where rows of a document are dependent (shared content, a smooth walk along positions) and the analytic
    floor of independent rows is far too low."""
    from qk_core.config.options import RotationOptions
    from qk_core.geometry.from_moments import layer_pooled
    from qk_core.geometry.moments import pooled_moments
    from qk_core.geometry.rotation import analytic_noise_floor, moment_permutation_floor, position_noise_floor

    rng = np.random.default_rng(0)
    d, docs, rows = 8, [], []
    for i in range(8):
        n = 60 + 10 * i
        content = rng.normal(size=(1, 1, d)) * 2
        walk = np.cumsum(rng.normal(size=(1, n, d)) * 0.3, axis=1)
        q = content + walk + rng.normal(size=(2, n, d))
        k = content + walk[:, :, ::-1] + rng.normal(size=(1, n, d))
        docs.append(document_moments(0, range(2), range(1), [0, 0], q, np.arange(n), k, np.arange(n), 16, 8, i,
                                     dtype=torch.float64))
        rows.append((q, k, np.arange(n), np.full(n, i)))
    lm = merge_documents(docs)
    assert not lm.sums["pm_unpaired"].any()
    opts = RotationOptions(capture_permutations=999)
    t, doc = np.concatenate([r[2] for r in rows]), np.concatenate([r[3] for r in rows])
    K = np.concatenate([r[1][0] for r in rows])
    for h in range(2):
        Q = np.concatenate([r[0][h] for r in rows])
        m = pooled_moments(Q, t, K, t)
        by_rows = position_noise_floor(Q, t, doc, K, t, doc, m, opts)
        by_moments = moment_permutation_floor(layer_pooled(lm)[h], lm.sums["pm_mean"][h], lm.sums["pm_cov"][h], opts)
        assert abs(by_moments - by_rows) < 0.1 * by_rows, (by_moments, by_rows)
        assert analytic_noise_floor(m) < 0.5 * by_rows


@pytest.mark.slow
def test_every_head_is_in_the_tables_the_depth_maps_and_the_report(capture: Any) -> None:
    """SPEC 12.3 as users see it: coverage "all" gives a row for every eligible head (more than were sampled),
    the depth maps have no blank cell, the plane figure still gets the sampled rows (projected on the axes of
    every position), and the report's basis table counts heads and positions."""
    from qk_core.geometry.driver import geometry_of_capture
    from qk_core.plots.geometry import fig_depth_heatmaps
    from qk_core.report.tables import basis_table

    storage, res, _ = capture
    reader = CaptureReader(storage, res.prefix)
    eligible = {(lay, int(h)) for lay in reader.moment_layers() for h in reader.read_moments(lay).q_heads}
    out = geometry_of_capture("m", storage, res.heads, PCAOptions(coverage="all"),
                              RotationOptions(coverage="all", capture_floor="beta"), keep_points=50)
    pca, rot, points = out["pca"][0], out["rotation"][0], out["rotation"][3]
    assert len(eligible) > len(res.heads) == 13
    for table in (pca, rot):
        assert set(zip(table["layer"], table["q_head"], strict=True)) == eligible
        assert set(table["coverage"]) == {"all"} and (table["status"] == "ok").all()
    # every position of every document: the query rows of the corpus (not the 2 sampled per bucket)
    n_tokens = int(reader.doc_tokens()["n_tokens"].sum())
    assert set(rot["n_q"]) == {n_tokens} and set(rot["n_docs"]) == {N_DOCS}

    sampled = set(zip(res.heads["layer"], res.heads["q_head"], strict=True))
    assert 0 < len(points) <= 6 and set(points) <= sampled
    for key, pts in points.items():
        head = reader.read_head(*key)
        row = rot.set_index(["layer", "q_head"]).loc[key]
        idx = np.unique(np.linspace(0, len(head.q) - 1, min(len(head.q), 50)).astype(int))
        np.testing.assert_allclose(pts["q_a"], head.q[idx].astype(np.float64) @ np.asarray(row["a"]), rtol=1e-12)
        np.testing.assert_array_equal(pts["q_t"], head.q_pos[idx])

    panels = [("bias_strength", "bias", "signed")]
    every = fig_depth_heatmaps(rot, panels, "m")
    assert not np.isnan(np.asarray(every.axes[0].images[0].get_array(), float)).any()
    assert every.axes[0].get_xlabel() == "layer" and "every eligible head" in every._suptitle.get_text()
    few = fig_depth_heatmaps(out_sampled := geometry_of_capture(
        "m", storage, res.heads, None, RotationOptions(coverage="sampled", capture_floor="beta"))["rotation"][0],
        panels, "m")
    assert len(out_sampled) == 13 and "not sampled" in few._suptitle.get_text()
    assert np.isnan(np.asarray(few.axes[0].images[0].get_array(), float)).sum() == len(eligible) - 13

    table = basis_table({"pca_heads": {"m": pca}, "rotation_heads": {"m": out_sampled}}, ["m"])
    cells = [[c.text for c in row] for row in table.rows]
    assert cells == [["m", "PCA (SPEC 2)", "all", f"{len(eligible)} of {len(eligible)}", str(N_DOCS),
                      str(n_tokens), str(n_tokens)],
                     ["m", "rotation (SPEC 3)", "sampled", "13 of 13", str(N_DOCS),
                      cells[1][5], cells[1][6]]]
    assert cells[1][5] != str(n_tokens)  # the sampled rows: fewer positions than every one

    # the coverage gap (SPEC 12.3) leads the models section with its headline metrics
    from qk_core.geometry.coverage import geometry_coverage_gap
    from qk_core.report.tables import GAP_SHOWN, fmt_num, gap_table

    gap, _ = geometry_coverage_gap("m", storage, res.heads, pca, rot)
    shown = gap_table({"geometry_coverage_gap": {"m": gap}}, ["m"])
    want = gap.set_index(["analysis", "metric"])
    keys = [k for k in GAP_SHOWN if k in want.index]
    assert [(r[1].text, r[2].text) for r in shown.rows] == keys and len(keys) == 6
    for row, key in zip(shown.rows, keys, strict=True):
        w = want.loc[key]
        assert [c.text for c in row[3:]] == [fmt_num(float(w[c])) for c in ("mean_sampled", "mean_all", "gap",
                                                                           "gap_heads", "gap_positions")]
        assert row[6].bold == bool(w["heads_beyond_95"]) and row[6].note == f"± {fmt_num(float(w['se_heads']))}"
        assert row[3].note == "13 heads" and row[4].note == f"{len(eligible)} heads"


@pytest.mark.slow
@pytest.mark.parametrize("covariance", ["full", "diagonal"])
@pytest.mark.parametrize("n_groups", [N_DOCS, 4])
def test_leave_one_group_out_from_moments_equals_the_row_refit(capture: Any, covariance: str, n_groups: int) -> None:
    """SPEC 4.6 with coverage 'all' (12.2): subtracting a document group's query sums from the merged ones and
    refitting gives the leave-one-out profiles of the rows' refit (:func:`loo_profiles` with ``refit_loop``,
    every document of the group left out at once), closed form and empirical, to 1e-10; with one document per
    group that is the delete-one-document jackknife."""
    from qk_core.capture.moments import document_groups
    from qk_core.plasticity.jackknife import loo_profiles, loo_profiles_from_moments

    _, _, by_layer = capture
    rng = np.random.default_rng(3)
    heads = next(iter(by_layer.values()))
    docs = per_document_moments(heads)
    doc_ids = np.array([m.docs[0] for m in docs])
    group_of = document_groups(len(docs), n_groups)
    assert group_of.max() + 1 == min(n_groups, N_DOCS) and np.all(np.diff(group_of) >= 0)
    lm = merge_documents(docs)
    n_compared = 0
    for i, h in enumerate(heads):
        J = lm.n_buckets
        q_bucket = np.minimum(h.q_pos // h.bucket, J - 1)
        order = np.argsort(q_bucket, kind="stable")
        counts = np.bincount(q_bucket, minlength=J)
        qgroup = group_of[np.searchsorted(doc_ids, h.q_doc[order])]
        n_p = 40 * (J - 1)
        pair_bucket = np.repeat(np.arange(1, J), 40)
        pi, pj = rng.integers(0, len(h.k), n_p), rng.integers(0, len(h.k), n_p)
        delta = np.subtract(h.k[pi], h.k[pj], dtype=np.float64)
        pair_group = group_of[np.searchsorted(doc_ids, h.k_doc[pi])]
        rows = loo_profiles(h.q[order], h.q_pos[order].astype(np.float64), qgroup, counts, h.window, h.bucket,
                            covariance, 10, pair_bucket, delta, pair_group, int(group_of.max()) + 1, refit_loop=True)
        total = {k[2:]: v[i] for k, v in lm.sums.items() if k.startswith("q_")}
        groups = {key: np.stack([sum(m.sums[f"q_{key}"][i] for m, g in zip(docs, group_of, strict=True) if g == gg)
                                 for gg in range(int(group_of.max()) + 1)]) for key in total}
        mom = loo_profiles_from_moments(total, groups, h.window, h.bucket, covariance, 10, pair_bucket, delta,
                                        pair_group, h.q[order], qgroup, counts)
        assert np.isfinite(rows.closed).sum() >= 4
        assert_rel(mom.closed, rows.closed, f"L{h.layer}H{h.q_head} closed")
        assert_rel(mom.empirical, rows.empirical, f"L{h.layer}H{h.q_head} empirical")
        n_compared += 1
    assert n_compared == len(heads)


@pytest.mark.parametrize("lw", ["exact", "gaussian"])
def test_batched_group_refit_equals_one_refit_per_group(capture: Any, lw: str) -> None:
    """The full-covariance leave-one-group-out refit runs over every group at once (SPEC 4.6, 12.2): each row equals
    :func:`fit_query_model_from_moments` of that group's complement followed by the closed form (4.3) of the other
    groups' pairs, one group at a time, to 1e-10, with the exact and with the Gaussian Ledoit-Wolf intensity."""
    from qk_core.capture.moments import document_groups
    from qk_core.plasticity.jackknife import _closed_refitted, loo_profiles_from_moments
    from qk_core.plasticity.query_model import QueryModelError

    _, _, by_layer = capture
    rng = np.random.default_rng(4)
    heads = next(iter(by_layer.values()))
    docs = per_document_moments(heads)
    group_of = document_groups(len(docs), 4)
    G = int(group_of.max()) + 1
    lm = merge_documents(docs)
    drop = set() if lw == "exact" else {k[2:] for k in LW_KEYS}
    for i, h in enumerate(heads):
        J = lm.n_buckets
        q_bucket = np.minimum(h.q_pos // h.bucket, J - 1)
        order = np.argsort(q_bucket, kind="stable")
        counts = np.bincount(q_bucket, minlength=J)
        doc_ids = np.array([m.docs[0] for m in docs])
        qgroup = group_of[np.searchsorted(doc_ids, h.q_doc[order])]
        pair_bucket = np.repeat(np.arange(1, J), 30)
        pi, pj = rng.integers(0, len(h.k), len(pair_bucket)), rng.integers(0, len(h.k), len(pair_bucket))
        delta = np.subtract(h.k[pi], h.k[pj], dtype=np.float64)
        pair_group = group_of[np.searchsorted(doc_ids, h.k_doc[pi])]
        total = {k[2:]: v[i] for k, v in lm.sums.items() if k.startswith("q_") and k[2:] not in drop}
        groups = {key: np.stack([sum(m.sums[f"q_{key}"][i] for m, g in zip(docs, group_of, strict=True) if g == gg)
                                 for gg in range(G)]) for key in total}
        got = loo_profiles_from_moments(total, groups, h.window, h.bucket, "full", 10, pair_bucket, delta,
                                        pair_group, h.q[order], qgroup, counts)
        want_closed, want_emp = np.full_like(got.closed, np.nan), got.empirical.copy()
        buckets = [j for j in np.unique(pair_bucket) if j < J]
        for g in range(G):
            try:
                model = fit_query_model_from_moments({k: total[k] - groups[k][g] for k in total}, h.window, h.bucket,
                                                     "full", 10)
            except QueryModelError:
                continue
            assert model.lw_intensity == lw
            _closed_refitted(want_closed, want_emp, g, model, buckets, pair_bucket, pair_group, delta)
        assert np.isfinite(want_closed).sum() >= 4
        assert_rel(got.closed, want_closed, f"L{h.layer}H{h.q_head} closed ({lw})")
        assert np.array_equal(np.isnan(got.empirical), np.isnan(want_emp))


def _writer(root: Any, n_docs: int | None, groups: int = 16) -> Any:
    """A capture writer of layer-3 moments (:func:`random_documents`' layout), merging as it commits when
    ``n_docs`` is given."""
    from qk_core.capture.moments import MomentPlan
    from qk_core.capture.store import CaptureWriter

    plan = MomentPlan({3: ([0, 1, 2, 3], [0, 1], [0, 0, 1, 1])}, 16, 4, "float64", "exact", groups)
    manifest = {"fingerprint": "running", "window": 64, "bucket": 16, "moments": plan.manifest(),
                "heads": [{"layer": 3, "q_head": 0, "kv_head": 0, "d": 6}]}
    writer = CaptureWriter(Storage(root), "m", manifest)
    if n_docs is not None:
        writer.merge_while_committing(n_docs)
    return writer


def _commit(writer: Any, doc: LayerMoments) -> None:
    from qk_core.capture.store import HeadRows

    rows = [HeadRows(kind, 3, 0, np.arange(1, dtype=np.int32), np.zeros((1, 6), np.float32)) for kind in "qk"]
    writer.write_document(doc.docs[0], 64, rows, [doc])


@pytest.mark.parametrize("groups", [16, 3])
def test_merge_as_documents_commit_gives_the_bytes_of_the_merge_from_their_files(tmp_path: Any, groups: int) -> None:
    """A writer that merges each document as it commits (sorted ids, as an overlapped capture commits them) writes
    the merged and group files of the merge from the files, byte for byte, with lone and larger groups; it reads no
    document's moments back; out of order it falls back to the files."""
    from qk_core.capture.store import CaptureReader

    docs = sorted(random_documents(7), key=lambda d: d.docs[0])
    summaries, roots = {}, {}
    for how in ("files", "committed", "unsorted"):
        roots[how] = tmp_path / how
        writer = _writer(roots[how], None if how == "files" else len(docs), groups)
        for doc in (docs[::-1] if how == "unsorted" else docs):
            _commit(writer, doc)
        summaries[how] = writer.finalize()
    notes = {how: s["moments"]["note"] for how, s in summaries.items()}
    assert "as they committed" in notes["committed"] and "from their files" in notes["files"] == notes["unsorted"]
    prefix = _writer(tmp_path / "x", None).prefix
    written = {how: {n: (Storage(root).read_bytes(f"{prefix}/{n}"), rec) for n, rec in summaries[how]["files"].items()
                     if n.startswith("moments/")} for how, root in roots.items()}
    # the merged file, and one file per group or (every document its own group) each document's, kept with the
    # SHA-256 of each layer's range
    lone = groups >= len(docs)
    assert sorted(n.split("/")[1] for n in written["files"]) == ["L003.npz", *["docs" if lone else "groups"] * min(
        groups, len(docs))]
    assert all(set(rec.get("layers", {})) == ({"3"} if lone else set()) for n, (_, rec) in written["files"].items()
               if "/docs/" in n or "/groups/" in n)
    assert written["committed"] == written["files"] == written["unsorted"]
    merged = CaptureReader(Storage(roots["committed"]), prefix).read_moments(3)
    for key, arr in merge_documents(docs).sums.items():
        assert np.array_equal(merged.sums[key], arr), key


def test_a_document_redone_by_another_writer_is_merged_from_its_file(tmp_path: Any) -> None:
    """The merge kept while committing is used only if every committed moments file is the one this writer wrote:
    a document committed again meanwhile by another writer (a retried shard) is merged from the files, with the
    other writer's sums."""
    docs = sorted(random_documents(3), key=lambda d: d.docs[0])
    other = random_documents(3, seed=9)[0]
    other = LayerMoments(other.layer, other.q_heads, other.kv_heads, other.kv_index, other.bucket, other.n_buckets,
                         other.sums, [docs[1].docs[0]])
    writer = _writer(tmp_path, len(docs))
    for doc in docs:
        _commit(writer, doc)
    _commit(_writer(tmp_path, None), other)  # the same document, committed again with other sums
    summary = writer.finalize()
    assert "from their files" in summary["moments"]["note"]
    from qk_core.capture.store import CaptureReader

    reader = CaptureReader(Storage(tmp_path), writer.prefix)
    merged, groups = reader.read_moments(3), reader.read_moment_groups(3)
    for key, arr in merge_documents([docs[0], other, docs[2]]).sums.items():
        assert np.array_equal(merged.sums[key], arr), key
    # the redone document's group file (written by the first writer as it committed) holds the other writer's sums
    assert np.array_equal(groups.sums["q_xx"][1], other.sums["q_xx"])


def test_running_merge_stops_at_a_document_it_cannot_add() -> None:
    """Out of order, other sums, or a layout the merge refuses: the running merge stops (its memory freed) instead
    of failing the commit, and covers nothing; finalize() then merges from the files, which names the problem."""
    from qk_core.capture.moments import RunningMerge

    docs = sorted(random_documents(3), key=lambda d: d.docs[0])
    other_heads = LayerMoments(3, np.arange(1, 5), docs[1].kv_heads, docs[1].kv_index, 16, 4, docs[1].sums,
                               docs[1].docs)
    for second, why in ((docs[0], "not in sorted order"), (other_heads, "different layer, head set")):
        merge = RunningMerge(3, 2, "float64")  # groups of the first two documents and of the third
        assert merge.add(docs[0].docs[0], [docs[0]]) is None and merge.docs == [docs[0].docs[0]] and not merge.lone
        assert merge.add(second.docs[0], [second]) is None
        assert why in str(merge.broken) and not merge.mergers and not merge.covers([d.docs[0] for d in docs[:2]])


def test_a_commit_that_fails_stops_the_merge_fed_beside_it(tmp_path: Any) -> None:
    """The running merge adds a document while its commit writes; a commit that fails (its moments file cannot be
    written) stops the merge, so the document is not in it twice when it is committed again: finalize() merges from
    the files, to the sums of the documents."""
    from qk_core.capture.store import CaptureReader

    docs = sorted(random_documents(3), key=lambda d: d.docs[0])
    writer = _writer(tmp_path, len(docs))
    _commit(writer, docs[0])
    real = writer.storage.write_stream

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError("no space left on device (staged)")

    writer.storage.write_stream = full_disk
    with pytest.raises(OSError, match="staged"):
        _commit(writer, docs[1])
    assert "its commit failed" in str(writer.running.broken) and not writer.running.mergers
    writer.storage.write_stream = real
    for doc in docs[1:]:
        _commit(writer, doc)
    summary = writer.finalize()
    assert "from their files" in summary["moments"]["note"]
    merged = CaptureReader(Storage(tmp_path), writer.prefix).read_moments(3)
    for key, arr in merge_documents(docs).sums.items():
        assert np.array_equal(merged.sums[key], arr), key


@pytest.mark.parametrize("groups", [16, 3])
def test_running_merge_on_several_threads_gives_the_bits_of_one(groups: int) -> None:
    """Layers added on several threads (each layer's documents still in order): the same merged sums and group sums,
    bit for bit, as one thread."""
    from qk_core.capture.moments import RunningMerge

    per_layer = {layer: sorted(random_documents(5, seed=layer), key=lambda d: d.docs[0]) for layer in (2, 3, 5, 7)}
    ids = [d.docs[0] for d in per_layer[3]]
    docs = [[replace(per_layer[layer][i], layer=layer, docs=[eid]) for layer in per_layer] for i, eid in enumerate(ids)]
    merges = {threads: RunningMerge(len(docs), groups, "float64", threads=threads) for threads in (1, 4)}
    closed: dict[int, list] = {1: [], 4: []}
    for doc in docs:
        for threads, merge in merges.items():
            out = merge.add(doc[0].docs[0], doc)
            closed[threads].append(None if out is None else
                                   (out[0], {la: list(g.arrays()) for la, g in out[1].items()}))
    assert all(m.broken is None and m.covers(ids) for m in merges.values())
    for layer in per_layer:
        one, four = (dict(merges[t].mergers[layer].arrays()) for t in (1, 4))
        assert one.keys() == four.keys() and all(np.array_equal(one[k], four[k]) for k in one), layer
    for a, b in zip(closed[1], closed[4], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a[0] == b[0] and a[1].keys() == b[1].keys()
            for layer in a[1]:
                assert all(na == nb and np.array_equal(va, vb) for (na, va), (nb, vb) in zip(a[1][layer], b[1][layer],
                                                                                            strict=True))
