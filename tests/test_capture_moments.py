"""Moments during capture (SPEC 12.1): every eligible head and every position, accumulated inside the read
hook, committed with each document (checksummed, resumable) and merged by finalize; equal to a float64 brute
force over every row, the same for any sampler, and a sharded capture gives the same bits as one worker."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.moments import LW_KEYS
from qk_core.capture.store import CaptureError, CaptureReader, CaptureWriter, moments_file
from qk_core.config.options import PCAOptions, RotationOptions
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.geometry.driver import run_geometry
from qk_core.geometry.from_moments import layer_geometry
from qk_core.geometry.heads import iter_capture_heads
from qk_core.io.storage import Storage

pytestmark = pytest.mark.slow  # three tiny captures, ~20 s on a busy CPU
torch.set_num_threads(1)
N_DOCS = 5


def merged_files(storage: Storage, prefix: str) -> dict[str, tuple[bytes, dict[str, Any]]]:
    """The bytes and committed records of a capture's merged and document-group moment files (documents' own files
    where they serve as their groups'), by name."""
    names = storage.read_json(f"{prefix}/complete.json")["files"]
    return {n: (storage.read_bytes(f"{prefix}/{n}"), rec) for n, rec in names.items() if n.startswith("moments/")}


def _registry(tmp: Path, per_bucket: int, heads: int, exact: bool = True) -> Any:
    """float64 sums with the exact Ledoit-Wolf terms (compared to a brute force), or the defaults."""
    moments = {"moments": True, "moment_dtype": "float64", "lw_intensity": "exact"} if exact else {"moments": True}
    return load_registry(tm.write_registry(tmp / f"registry-{per_bucket}-{heads}-{exact}.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": per_bucket, "heads": heads, **moments}}}, tmp / "corpus.jsonl"))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("capmom")
    tm.build_tiny_model("qwen3", tmp / "model")
    texts = [t[: 40 + 5 * i] for i, t in enumerate(tm.sample_texts(N_DOCS, 80, seed=2))]
    tm.write_corpus_jsonl(tmp / "corpus.jsonl", texts, ids=[7, 3, 12, 5, 9])
    sampled, full = _registry(tmp, 2, 5), _registry(tmp, 16, 100)  # per_bucket = B: every position
    corpus = local_corpus(sampled.corpus("tiny").params)
    s_sampled, s_full = Storage(tmp / "sampled"), Storage(tmp / "full")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QK_HOST_THREADS", "1")  # the reference merge: one layer at a time
        one_worker = capture_model(sampled.model("m"), corpus, s_sampled, device="cpu")
    return {"tmp": tmp, "corpus": corpus, "sampled_reg": sampled, "storage": s_sampled, "sampled": one_worker,
            "full_storage": s_full, "full": capture_model(full.model("m"), corpus, s_full, device="cpu")}


@pytest.fixture(scope="module")
def without_moments(setup: dict[str, Any]) -> tuple[Storage, Any]:
    """(storage, result) of the sampled capture taken again with ``capture.moments = false``."""
    tmp = setup["tmp"]
    reg = load_registry(tm.write_registry(tmp / "registry-nomoments.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 5, "moments": False}}}, tmp / "corpus.jsonl"))
    storage = Storage(tmp / "nomoments")
    return storage, capture_model(reg.model("m"), setup["corpus"], storage, device="cpu")


def test_moments_of_every_head_equal_a_float64_brute_force_over_every_row(setup: dict[str, Any]) -> None:
    full = CaptureReader(setup["full_storage"], setup["full"].prefix)
    sampled = CaptureReader(setup["storage"], setup["sampled"].prefix)
    assert full.manifest["moments"]["dtype"] == "float64"
    layers = full.moment_layers()
    assert layers == sampled.moment_layers() == sorted({int(h["layer"]) for h in full.manifest["heads"]})
    n_tokens = setup["full"].doc_tokens.set_index("example_id")["n_tokens"]
    for layer in layers:
        lm = full.read_moments(layer)
        assert lm.docs == sorted(n_tokens.index)
        # a capture of 5 sampled heads holds the moments of every head of every eligible layer, the same bits
        other = sampled.read_moments(layer)
        for key, arr in lm.sums.items():
            assert np.array_equal(arr, other.sums[key]), (layer, key)
        # brute force: every position's rows of every head (per_bucket = B captured them all), float64
        for i, q_head in enumerate(lm.q_heads):
            h = full.read_head(layer, int(q_head))
            assert len(h.q) == int(n_tokens.sum())
            q, k, t = h.q.astype(np.float64), h.k.astype(np.float64), h.q_pos.astype(np.float64)
            assert np.array_equal(h.q_pos, h.k_pos) and np.array_equal(h.q_doc, h.k_doc)
            b = np.minimum(h.q_pos // h.bucket, lm.n_buckets - 1)
            s = t - (b + 0.5) * h.bucket
            kv = lm.kv_index[i]
            assert lm.kv_heads[kv] == h.kv_head
            for j in range(lm.n_buckets):
                sel = b == j
                for key, want in (("q_n", sel.sum()), ("q_t", t[sel].sum()), ("q_x", q[sel].sum(0)),
                                  ("q_xt", t[sel] @ q[sel]), ("q_xx", q[sel].T @ q[sel]),
                                  ("q_xxs2", (q[sel] * s[sel, None] ** 2).T @ q[sel]),
                                  ("q_r4", ((q[sel] ** 2).sum(1) ** 2).sum())):
                    np.testing.assert_allclose(lm.sums[key][i, j], want, rtol=1e-12, atol=1e-12 * np.abs(want).max(),
                                               err_msg=f"L{layer} H{q_head} b{j} {key}")
            for key, want in (("k_x", k.sum(0)), ("k_xx", k.T @ k), ("k_xt", t @ k)):
                np.testing.assert_allclose(lm.sums[key][kv], want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
            np.testing.assert_allclose(lm.sums["p_xx"][i], (q - k).T @ (q - k), rtol=1e-12,
                                       atol=1e-12 * np.abs((q - k).T @ (q - k)).max())
            ids = sorted(n_tokens.index)
            odd = np.isin(h.q_doc, ids[1::2])
            np.testing.assert_allclose(lm.sums["qh_xt"][1, i], t[odd] @ q[odd], rtol=1e-12,
                                       atol=1e-12 * np.abs(t[odd] @ q[odd]).max())


def test_default_moments_are_float32_gaussian_within_their_bound_and_a_third_of_the_bytes(
        setup: dict[str, Any]) -> None:
    """The capture's defaults (SPEC 12.1, issue 22.4): per-bucket sums accumulated in float32 and stored as such
    (exactly those numbers), no exact Ledoit-Wolf terms; every sum within the float32 bound of the float64
    capture's, in the fingerprint's place (the same capture prefix), and the per-document files far smaller."""
    reg = _registry(setup["tmp"], 2, 5, exact=False)
    entry = reg.model("m")
    assert (entry.capture.moment_dtype, entry.capture.lw_intensity) == ("float32", "gaussian")
    storage = Storage(setup["tmp"] / "defaults")
    ids = [int(e) for e in setup["corpus"]["example_id"]]
    res = capture_model(entry, setup["corpus"], storage, device="cpu", only_docs=ids[:1], finalize=False)
    assert res.prefix == setup["sampled"].prefix
    with np.load(Path(storage.full(f"{res.prefix}/moments/docs/doc-{ids[0]}.npz"))) as z:
        stored = {name.split(".", 1)[1]: z[name].dtype for name in z.files}
    assert stored["q_xx"] == stored["q_x"] == np.float32 and stored["k_xx"] == stored["q_n"] == np.float64
    assert not set(LW_KEYS) & set(stored)
    exact = setup["tmp"] / "exact-docs"
    capture_model(setup["sampled_reg"].model("m"), setup["corpus"], Storage(exact), device="cpu",
                  only_docs=ids[:1], finalize=False)
    size = {name: Path(root / res.prefix / "moments/docs" / f"doc-{ids[0]}.npz").stat().st_size
            for name, root in (("default", Path(storage.full(""))), ("exact", exact))}
    assert size["default"] < size["exact"] / 3
    res = capture_model(entry, setup["corpus"], storage, device="cpu")
    reader, want = CaptureReader(storage, res.prefix), CaptureReader(setup["storage"], setup["sampled"].prefix)
    assert reader.manifest["moments"]["dtype"] == "float32"
    assert reader.manifest["moments"]["lw_intensity"] == "gaussian"
    for layer in reader.moment_layers():
        got, ref = reader.read_moments(layer), want.read_moments(layer)
        assert set(ref.sums) - set(got.sums) == set(LW_KEYS)
        for key, arr in got.sums.items():
            bound = 32 * np.sqrt(got.bucket) * 2.0**-24 * max(np.abs(ref.sums[key]).max(), 1e-30)
            assert arr.dtype == np.float64 and np.abs(arr - ref.sums[key]).max() <= bound, (layer, key)


def test_every_head_geometry_from_capture_moments_equals_the_rows_of_every_position(setup: dict[str, Any]) -> None:
    storage, res = setup["full_storage"], setup["full"]
    reader = CaptureReader(storage, res.prefix)
    pca_o, rot_o = PCAOptions(), RotationOptions(capture_floor="beta")
    rows = run_geometry("m", iter_capture_heads(storage, res.heads), pca_o, rot_o)
    pca_t, rot_t = rows["pca"][0].set_index(["layer", "q_head"]), rows["rotation"][0].set_index(["layer", "q_head"])
    n = 0
    for layer in reader.moment_layers():
        for rec in layer_geometry(reader.read_moments(layer), reader.window, pca_o, rot_o):
            key = (layer, rec["q_head"])
            for col in ("pc0_evr", "pc0_r_q", "pc0_r_k", "pos_budget_q"):
                np.testing.assert_allclose(rec["pca"][col], pca_t.loc[key, col], rtol=1e-9)
            for col in ("alpha_k", "bias_strength", "var_frac_b", "separation_strength", "split_half_cos", "r2_full"):
                np.testing.assert_allclose(rec["rotation"][col], rot_t.loc[key, col], rtol=1e-9)
            n += 1
    assert n == len(res.heads)


def test_sharded_capture_merges_to_the_bits_of_one_worker(setup: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two shards committed in either order, finalized merging three layers at once (``QK_HOST_THREADS``): the
    merged and group files are the bytes of one worker's capture merged one layer at a time."""
    entry, corpus = setup["sampled_reg"].model("m"), setup["corpus"]
    storage = Storage(setup["tmp"] / "sharded")
    ids = [int(e) for e in corpus["example_id"]]
    for part in (ids[3:], ids[:3]):
        res = capture_model(entry, corpus, storage, device="cpu", only_docs=part, finalize=False)
    monkeypatch.setenv("QK_HOST_THREADS", "3")
    summary = CaptureWriter(storage, entry.key, storage.read_json(f"{res.prefix}/manifest.json")).finalize()
    assert summary["verification"]["passed"]
    one = setup["storage"]
    assert res.prefix == setup["sampled"].prefix
    assert len(CaptureReader(one, res.prefix).moment_layers()) >= 3
    got, want = merged_files(storage, res.prefix), merged_files(one, res.prefix)
    assert got == want and sum("/docs/" in n for n in want) == N_DOCS  # every document its own group


def test_overlapped_capture_merges_as_it_commits_to_the_bits_of_one_worker(setup: dict[str, Any]) -> None:
    """With overlapped commits (an accelerator's default) the commit thread merges each document's moments as it
    commits, in sorted id order whatever the corpus order (7, 3, 12, 5, 9): finalize writes that merge without
    reading the documents back, and its merged and group files are the bytes of the serial capture's."""
    entry, corpus = setup["sampled_reg"].model("m"), setup["corpus"]
    storage = Storage(setup["tmp"] / "overlapped")
    res = capture_model(entry, corpus, storage, device="cpu", overlap_commits=True)
    assert res.prefix == setup["sampled"].prefix
    assert "as they committed" in storage.read_json(f"{res.prefix}/complete.json")["moments"]["note"]
    one = setup["storage"]
    assert "from their files" in one.read_json(f"{res.prefix}/complete.json")["moments"]["note"]
    got, want = merged_files(storage, res.prefix), merged_files(one, res.prefix)
    assert got == want and sum("/docs/" in n for n in want) == N_DOCS  # every document its own group


def test_moments_are_committed_with_their_document_and_checked(setup: dict[str, Any]) -> None:
    """A document's moments file is checksummed in its document file's footer; finalize refuses an altered one,
    and the merged files are verified like every other committed file."""
    entry, corpus = setup["sampled_reg"].model("m"), setup["corpus"]
    storage = Storage(setup["tmp"] / "altered")
    res = capture_model(entry, corpus, storage, device="cpu", only_docs=[7, 3], finalize=False)
    rel = f"{res.prefix}/moments/docs/doc-3.npz"
    data = bytearray(storage.read_bytes(rel))
    data[-100] ^= 1
    storage.write_bytes(rel, bytes(data))
    writer = CaptureWriter(storage, entry.key, storage.read_json(f"{res.prefix}/manifest.json"))
    with pytest.raises(CaptureError, match=r"doc-3\.npz"):
        writer.finalize()
    reader = CaptureReader(setup["storage"], setup["sampled"].prefix)
    assert any(name.startswith("moments/L") for name in reader.files)
    path = Path(setup["storage"].full(moments_file(setup["sampled"].prefix, reader.moment_layers()[0])))
    original = path.read_bytes()
    try:
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(CaptureError, match="SHA-256"):
            CaptureReader(setup["storage"], setup["sampled"].prefix).read_moments(reader.moment_layers()[0])
    finally:
        path.write_bytes(original)


def test_driver_coverage_all_tables_every_head_and_sampled_stays_the_row_path(setup: dict[str, Any]) -> None:
    """SPEC 12.1/12.3 through the geometry driver: ``coverage = "all"`` gives every eligible head (the capture
    sampled 5 of 16) with its coverage, positions and documents; ``"sampled"`` is today's row path exactly."""
    import pandas.testing as pd_testing

    from qk_core.geometry.driver import geometry_of_capture

    storage, res = setup["storage"], setup["sampled"]
    n_tokens = int(res.doc_tokens["n_tokens"].sum())
    every = geometry_of_capture("m", storage, res.heads, PCAOptions(coverage="all"),
                                RotationOptions(coverage="all", capture_floor="beta"))
    chosen = set(zip(res.heads["layer"], res.heads["q_head"], strict=True))
    for table in (every["pca"][0], every["rotation"][0]):
        assert len(table) == 16 and set(table["coverage"]) == {"all"} and set(table["status"]) == {"ok"}
        assert set(table["n_q"]) == set(table["n_k"]) == {n_tokens} and set(table["n_docs"]) == {N_DOCS}
        # the capture's 5 sampled heads are marked (SPEC 12.3: the sampled protocol's heads among every head)
        marked = table[table["sampled"].astype(bool)]
        assert set(zip(marked["layer"], marked["q_head"], strict=True)) == chosen and len(marked) == 5
    assert '"coverage": "all"' in every["pca"][0]["options"].iloc[0]
    full = CaptureReader(setup["full_storage"], setup["full"].prefix)
    want = {(layer, r["q_head"]): r for layer in full.moment_layers()
            for r in layer_geometry(full.read_moments(layer), full.window, PCAOptions(),
                                    RotationOptions(capture_floor="beta"))}
    for row in every["rotation"][0].itertuples():
        assert row.bias_strength == want[(row.layer, row.q_head)]["rotation"]["bias_strength"]
    pca_s, rot_s = PCAOptions(coverage="sampled"), RotationOptions(coverage="sampled")
    sampled = geometry_of_capture("m", storage, res.heads, pca_s, rot_s)
    rows = run_geometry("m", iter_capture_heads(storage, res.heads), pca_s, rot_s)
    for a, b in ((sampled["pca"], rows["pca"]), (sampled["rotation"][:3], rows["rotation"][:3])):
        for x, y in zip(a, b, strict=True):
            pd_testing.assert_frame_equal(x, y)
    assert set(sampled["pca"][0]["coverage"]) == {"sampled"} and len(sampled["pca"][0]) == 5
    assert set(sampled["pca"][0]["sampled"]) == set(sampled["rotation"][0]["sampled"]) == {True}
    assert set(sampled["pca"][0]["n_docs"]) == {N_DOCS}


def test_coverage_gap_vanishes_where_every_head_and_position_is_sampled(setup: dict[str, Any]) -> None:
    """SPEC 12.3 on the capture that sampled every head (100 >= 16) at every position (per_bucket = B): the two
    coverages rest on the same rows, so every metric's gap and both parts are zero (SPEC 12.2: 1e-10 relative), and
    the head part's standard error is 0 (the finite-population factor)."""
    from qk_core.geometry.coverage import geometry_coverage_gap
    from qk_core.geometry.driver import geometry_of_capture

    storage, res = setup["full_storage"], setup["full"]
    every = geometry_of_capture("m", storage, res.heads, PCAOptions(), RotationOptions(capture_floor="beta"))
    gap, note = geometry_coverage_gap("m", storage, res.heads, every["pca"][0], every["rotation"][0])
    assert "published with coverage 'all'" in note and set(gap["published"]) == {"all"}
    assert set(gap["analysis"]) == {"pca", "rotation"} and len(gap) >= 15
    assert (gap["heads_sampled"] == gap["heads_all"]).all() and (gap["heads_both"] == gap["heads_all"]).all()
    scale = np.maximum(gap["mean_all"].abs(), 1e-3)
    for col in ("gap", "gap_heads", "gap_positions", "median_abs_diff", "p90_abs_diff"):
        assert (gap[col].abs() <= 1e-8 * scale).all(), gap.loc[gap[col].abs() > 1e-8 * scale, ["metric", col]]
    assert (gap["se_heads"] == 0).all() and not gap["heads_beyond_95"].any()
    assert set(gap["q_positions_sampled"]) == set(gap["q_positions_all"])  # every position under both


def test_coverage_gap_splits_the_sampled_heads_gap_either_way_round(setup: dict[str, Any],
                                                                    without_moments: tuple[Storage, Any]) -> None:
    """5 of 16 heads sampled at 2 positions per bucket: the head part is the 5 heads' every-position mean less the
    16 heads' mean, with the finite-population standard error sqrt(S^2/5 (1 - 5/16)); the position part is the same
    heads' sampled-row values less their every-position values. Published as either coverage, the other computed
    from the capture: the same table. A capture without moments gives an empty table saying why."""
    from qk_core.geometry.coverage import geometry_coverage_gap
    from qk_core.geometry.driver import geometry_of_capture

    storage, res = setup["storage"], setup["sampled"]
    pca_o, rot_o = PCAOptions(), RotationOptions(capture_floor="beta")
    every = geometry_of_capture("m", storage, res.heads, pca_o, rot_o)
    rows = geometry_of_capture("m", storage, res.heads, dataclasses.replace(pca_o, coverage="sampled"),
                               dataclasses.replace(rot_o, coverage="sampled"))
    gap, _ = geometry_coverage_gap("m", storage, res.heads, every["pca"][0], every["rotation"][0])
    back, note = geometry_coverage_gap("m", storage, res.heads, rows["pca"][0], rows["rotation"][0])
    assert "coverage 'sampled'" in note
    cols = [c for c in gap.columns if c != "published"]
    pd.testing.assert_frame_equal(gap[cols], back[cols])
    got = gap.set_index(["analysis", "metric"])
    for analysis, col in (("pca", "pc0_r_k"), ("pca", "pos_budget_q"), ("rotation", "bias_strength"),
                          ("rotation", "split_half_cos")):
        a = every[analysis][0].set_index(["layer", "q_head"])[col].astype(float)
        s = rows[analysis][0].set_index(["layer", "q_head"])[col].astype(float)
        assert len(a) == 16 and len(s) == 5
        row = got.loc[(analysis, col)]
        assert np.isclose(row["gap_heads"], a[s.index].mean() - a.mean(), rtol=1e-12, atol=1e-15)
        assert np.isclose(row["se_heads"], np.sqrt(a.var(ddof=1) / 5 * (1 - 5 / 16)), rtol=1e-12)
        assert np.isclose(row["gap_positions"], (s - a[s.index]).mean(), rtol=1e-12, atol=1e-15)
        assert np.isclose(row["gap"], s.mean() - a.mean(), rtol=1e-12, atol=1e-15)
        assert row["heads_beyond_95"] == (abs(row["gap_heads"] / row["se_heads"]) > 1.96)
    assert (gap["q_positions_sampled"] < gap["q_positions_all"]).all() and set(gap["n_docs"]) == {N_DOCS}

    bare, plain = without_moments
    alone = geometry_of_capture("m", bare, plain.heads, dataclasses.replace(pca_o, coverage="sampled"), None)
    empty, why = geometry_coverage_gap("m", bare, plain.heads, alone["pca"][0], pd.DataFrame())
    assert empty.empty and "no moments" in why


def _drift_axis(head: Any, docs: list[int]) -> np.ndarray:
    """The unit drift axis Cov(x, t) of a head's pooled Q and K rows of ``docs`` (SPEC 3), by hand."""
    mq, mk = np.isin(head.q_doc, docs), np.isin(head.k_doc, docs)
    x = np.vstack([head.q[mq], head.k[mk]]).astype(np.float64)
    t = np.concatenate([head.q_pos[mq], head.k_pos[mk]]).astype(np.float64)
    c = (t - t.mean()) @ (x - x.mean(axis=0))
    return c / np.linalg.norm(c)


def test_geometry_position_part_is_jackknifed_over_documents_each_refit_a_capture_without_it(
        setup: dict[str, Any]) -> None:
    """The geometry gap's position error (SPEC 12.3 with SPEC 4.6's delete-a-document jackknife): each refit without
    document 12 equals the analysis of a capture of the corpus without it, taken anew, under both coverages (rows
    without its rows; every other document's moments merged again); every other document keeps its split-half; with
    every position sampled the two coverages' refits agree to rounding, so the error is 0 and nothing is flagged; 5
    of 16 heads at 2 positions: the error is the jackknife of the mean over heads of the refits' difference."""
    from qk_core.geometry.coverage import PCA_GAP_METRICS, ROTATION_GAP_METRICS, geometry_coverage_gap
    from qk_core.geometry.driver import geometry_of_capture
    from qk_core.geometry.jackknife import loo_of_moments, loo_of_rows
    from qk_core.stats.jackknife import jackknife

    metrics = {"pca": PCA_GAP_METRICS, "rotation": ROTATION_GAP_METRICS}
    pca_o, rot_o = PCAOptions(), RotationOptions(capture_floor="beta")
    opts = {c: (dataclasses.replace(pca_o, coverage=c), dataclasses.replace(rot_o, coverage=c))
            for c in ("sampled", "all")}
    corpus = setup["corpus"]
    for name, reg in (("full", _registry(setup["tmp"], 16, 100)), ("sampled", setup["sampled_reg"])):
        storage = setup["full_storage"] if name == "full" else setup["storage"]
        res = setup[name]
        reader = CaptureReader(storage, res.prefix)
        units, every = loo_of_moments(reader, *opts["all"], metrics)
        rows = loo_of_rows(storage, res.heads, units, *opts["sampled"], metrics)
        assert units == [[3], [5], [7], [9], [12]] and reader.documents_kept()
        # independent: the corpus without document 12, captured again (the sampler draws per document and bucket)
        without = Storage(setup["tmp"] / f"without-12-{name}")
        again = capture_model(reg.model("m"), corpus[corpus["example_id"] != 12], without, device="cpu")
        for coverage, loo in (("all", every), ("sampled", rows)):
            fresh = geometry_of_capture("m", without, again.heads, *opts[coverage])
            for analysis, cols in metrics.items():
                table = fresh[analysis][0]
                table = table[table["status"] == "ok"].set_index(["layer", "q_head"])
                assert len(table) == (16 if coverage == "all" else len(res.heads))
                for col in cols:
                    want = pd.to_numeric(table[col], errors="coerce").astype(float).dropna()
                    got = loo[analysis][col][units.index([12])].dropna()
                    assert got.index.equals(want.sort_index().index), (coverage, col)
                    np.testing.assert_allclose(got, want.sort_index(), rtol=1e-9, atol=1e-12,
                                               err_msg=f"{coverage} {col}")
        every_tables = geometry_of_capture("m", storage, res.heads, *opts["all"])
        gap, note = geometry_coverage_gap("m", storage, res.heads, every_tables["pca"][0],
                                          every_tables["rotation"][0])
        assert "jackknife error over the 5 documents" in note
        gap = gap.set_index(["analysis", "metric"])
        assert (gap["units_positions"].isin([0, 5])).all() and (gap["units_positions"] == 5).sum() >= 15
        if name == "full":
            scale = np.maximum(gap["mean_all"].abs(), 1e-3)
            assert (gap["se_positions"].fillna(0) <= 1e-9 * scale).all()
            assert not gap["positions_beyond_95"].fillna(False).astype(bool).any()  # rounding is not a part
            # without document 7 (rank 2) the others keep their halves, {3, 12} and {5, 9} (ranked anew they would be
            # {3, 9} and {5, 12}): |cos| of the halves' drift axes, by hand from the rows
            layer, q_head = 1, 2
            head = reader.read_head(layer, q_head)
            cos = abs(_drift_axis(head, [3, 12]) @ _drift_axis(head, [5, 9]))
            for loo in (rows, every):
                assert np.isclose(loo["rotation"]["split_half_cos"].loc[(layer, q_head), units.index([7])], cos,
                                  rtol=1e-9)
            continue
        for analysis, col in (("pca", "pc1_evr"), ("rotation", "separation_strength"), ("rotation", "r2_full")):
            heads = rows[analysis][col].index.intersection(every[analysis][col].index)
            per_doc = (rows[analysis][col].loc[heads] - every[analysis][col].loc[heads]).mean(axis=0)
            want = jackknife(gap.loc[(analysis, col), "gap_positions"], per_doc.to_numpy())
            assert np.isclose(gap.loc[(analysis, col), "se_positions"], want.se, rtol=1e-10), (analysis, col)
        assert gap["positions_beyond_95"].dropna().astype(bool).any()  # a sample of 2 positions per bucket shows


def test_plasticity_coverage_all_fits_the_query_model_on_every_position(setup: dict[str, Any]) -> None:
    """SPEC 4.6 / 12.2: with coverage 'all' (the default) the query model rests on every position of every
    document, while key pairs stay the sampled ones; the jackknife leaves out one document at a time (5 documents,
    at most 16 groups kept), its refits from the merged sums less the document's."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity.analysis import analyse_capture

    storage, res = setup["storage"], setup["sampled"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    opts = PlasticityOptions(bootstrap=10, pairs_per_bucket=32, min_queries_per_bucket=5)
    assert opts.coverage == "all" and opts.interval == "jackknife_t"
    every = analyse_capture("m", storage, res.prefix, heads, opts)
    sampled = analyse_capture("m", storage, res.prefix, heads, dataclasses.replace(opts, coverage="sampled"))
    n_tokens = int(res.doc_tokens["n_tokens"].sum())
    assert set(every.heads["coverage"]) == {"all"} and set(every.heads["n_queries_model"]) == {n_tokens}
    assert set(sampled.heads["coverage"]) == {"sampled"}
    assert (sampled.heads["n_queries_model"] < n_tokens).all()
    assert set(every.heads["jackknife_units"]) == set(sampled.heads["jackknife_units"]) == {N_DOCS}
    for name in ("ap_overall", "ap_overall_lo", "ap_overall_hi", "ap_overall_corrected"):
        assert np.isfinite(every.heads[name]).all(), name
    assert (every.heads["ap_overall_lo"] <= every.heads["ap_overall"]).all()
    assert (every.heads["ap_overall"] <= every.heads["ap_overall_hi"]).all()
    assert len(every.pairs) == len(sampled.pairs)  # the same sampled key pairs
    percentile = analyse_capture("m", storage, res.prefix, heads, dataclasses.replace(opts, interval="percentile"))
    np.testing.assert_array_equal(percentile.heads["ap_overall"], every.heads["ap_overall"])


def test_plasticity_coverage_gap_vanishes_at_every_position_and_splits_the_query_model(setup: dict[str, Any]) -> None:
    """SPEC 12.3 for plasticity. Every head at every position: the sampled protocol's AP and query model are those of
    every position (gaps 0, standard errors 0, AP's position jackknife too). 5 of 16 heads at 2 positions per bucket: AP
    exists for the 5 heads under both coverages (same key pairs), so its gap is the position part alone, the AP
    difference of the two analyses, whose jackknife standard error is that of the mean over heads of the two analyses'
    leave-one-document-out AP; the query model's head part compares the 5 heads with all 16; published either way
    round, the same table. Without leave-one-out values (interval percentile, or a capture from before the document
    groups) no error, and the note says why."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity import aggregates as agg
    from qk_core.plasticity.analysis import analyse_capture
    from qk_core.plasticity.coverage import QUERY_GAP_METRICS as QUERY_GAP
    from qk_core.plasticity.coverage import plasticity_coverage_gap

    opts = PlasticityOptions(bootstrap=10, pairs_per_bucket=32, min_queries_per_bucket=5)
    storage, res = setup["full_storage"], setup["full"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    every = analyse_capture("m", storage, res.prefix, heads, opts)
    gap, note = plasticity_coverage_gap("m", storage, res.prefix, heads, every.heads, every.query_heads,
                                        every.profiles)
    assert "published with coverage 'all'" in note and set(gap["analysis"]) == {"plasticity", "query model"}
    assert f"jackknife error over the {res.doc_tokens.shape[0]} documents" in note
    gap = gap[gap["heads_both"] > 0]  # a 64-token window of 16-token buckets has no AP of the first or last 20%
    assert set(gap["metric"]) >= {"ap_overall", *QUERY_GAP}
    scale = np.maximum(gap["mean_all"].abs(), 1e-3)
    for col in ("gap", "gap_heads", "gap_positions"):
        assert (gap[col].abs() <= 1e-8 * scale).all(), gap.loc[gap[col].abs() > 1e-8 * scale, ["metric", col]]
    assert (gap["se_heads"] == 0).all()
    ap_rows = gap[gap["analysis"] == "plasticity"]
    assert (ap_rows["units_positions"] == res.doc_tokens.shape[0]).all()
    assert (ap_rows["se_positions"] <= 1e-8 * scale[ap_rows.index]).all()
    assert (gap["units_positions"] == res.doc_tokens.shape[0]).all()  # the query model's drift too
    assert (gap["se_positions"] <= 1e-8 * scale).all() and not gap["positions_beyond_95"].astype(bool).any()

    storage, res = setup["storage"], setup["sampled"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    every = analyse_capture("m", storage, res.prefix, heads, opts)
    rows = analyse_capture("m", storage, res.prefix, heads, dataclasses.replace(opts, coverage="sampled"))
    gap, _ = plasticity_coverage_gap("m", storage, res.prefix, heads, every.heads, every.query_heads, every.profiles)
    back, note = plasticity_coverage_gap("m", storage, res.prefix, heads, rows.heads, rows.query_heads, rows.profiles)
    assert "published with coverage 'sampled'" in note
    cols = [c for c in gap.columns if c != "published"]
    pd.testing.assert_frame_equal(gap[cols], back[cols])
    got = gap.set_index(["analysis", "metric"])
    ap_all = every.heads.set_index(["layer", "q_head"])["ap_overall"]
    ap_rows = rows.heads.set_index(["layer", "q_head"])["ap_overall"]
    row = got.loc[("plasticity", "ap_overall")]
    assert row["heads_all"] == row["heads_sampled"] == 5 and row["gap_heads"] == 0 and row["se_heads"] == 0
    assert np.isclose(row["gap_positions"], (ap_rows - ap_all).mean(), rtol=1e-12, atol=1e-15)
    assert row["gap_positions"] != 0  # two positions per bucket are not every position
    L, B = int(every.heads["L"].iloc[0]), int(every.heads["B"].iloc[0])

    def loo_overall(result: Any) -> np.ndarray:  # (heads, documents) AP_overall with each document left out
        prof = result.profiles.sort_values(["layer", "q_head", "bucket"])
        return np.stack([agg.headline(np.stack(list(g["ap_loo"]), axis=1), L, B)["ap_overall"]
                         for _, g in prof.groupby(["layer", "q_head"])])

    per_doc = np.nanmean(loo_overall(rows) - loo_overall(every), axis=0)
    n = len(per_doc)
    assert n == res.doc_tokens.shape[0] == row["units_positions"]
    assert np.isclose(row["se_positions"], np.sqrt((n - 1) / n * ((per_doc - per_doc.mean()) ** 2).sum()), rtol=1e-10)
    assert row["se_positions"] > 0 and np.isclose(row["t_positions"], row["gap_positions"] / row["se_positions"])
    plain = dataclasses.replace(opts, interval="percentile")
    flat = analyse_capture("m", storage, res.prefix, heads, plain)
    none, why = plasticity_coverage_gap("m", storage, res.prefix, heads, flat.heads, flat.query_heads, flat.profiles)
    ap_none = none[none["analysis"] == "plasticity"]
    assert "no leave-one-out values" in why and ap_none["se_positions"].isna().all()
    assert ap_none["positions_beyond_95"].isna().all()
    # the query model's refits do not depend on AP's interval
    pd.testing.assert_series_equal(none.loc[none["analysis"] == "query model", "se_positions"],
                                   back.loc[back["analysis"] == "query model", "se_positions"])
    # a capture from before the document groups: coverage 'all' cannot be refitted without a group, so no error
    import shutil

    old = Storage(setup["tmp"] / "before-groups")
    shutil.copytree(storage.full(res.prefix), old.full(res.prefix))
    complete = old.read_json(f"{res.prefix}/complete.json")
    complete["moments"]["groups"] = 0
    del complete["moments"]["groups_in"]
    old.write_json(f"{res.prefix}/complete.json", complete)
    assert CaptureReader(old, res.prefix).moment_groups() == 0
    legacy, why = plasticity_coverage_gap("m", old, res.prefix, heads, rows.heads, rows.query_heads, rows.profiles)
    assert "no leave-one-out values" in why and legacy["se_positions"].isna().all()
    assert "the query model's position part has no error" in why and "no document-group moments" in why
    pd.testing.assert_series_equal(legacy["gap_positions"], back["gap_positions"])
    beta = every.query_heads.set_index(["layer", "q_head"])["beta_norm_per_token"]
    row = got.loc[("query model", "beta_norm_per_token")]
    assert row["heads_all"] == 16 and row["heads_sampled"] == 5
    assert np.isclose(row["gap_heads"], beta[ap_all.index].mean() - beta.mean(), rtol=1e-12, atol=1e-15)
    assert np.isclose(row["se_heads"], np.sqrt(beta.var(ddof=1) / 5 * (1 - 5 / 16)), rtol=1e-12)


def test_query_model_position_part_is_jackknifed_over_documents_each_refit_a_capture_without_it(
        setup: dict[str, Any]) -> None:
    """The query model's drift (SPEC 4.1) in the plasticity gap gets its position error as AP's does (SPEC 12.3, 4.6):
    each refit without document 12 equals the query model of a capture of the corpus without it, taken anew, under
    both coverages (every eligible head's from the merged moments, the sampled heads' from their rows); with nothing
    left out the refit's regression gives the published values; the error is the jackknife of the mean over the sampled
    heads of the refits' difference."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity.analysis import analyse_capture
    from qk_core.plasticity.coverage import (
        QUERY_GAP_METRICS,
        loo_drift_of_moments,
        loo_drift_of_rows,
        plasticity_coverage_gap,
    )
    from qk_core.stats.jackknife import jackknife

    opts = PlasticityOptions(bootstrap=10, pairs_per_bucket=32, min_queries_per_bucket=5)
    storage, res = setup["storage"], setup["sampled"]
    reader = CaptureReader(storage, res.prefix)
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    units, every = loo_drift_of_moments(reader)
    rows = loo_drift_of_rows(reader, heads, units)
    assert units == [[3], [5], [7], [9], [12]]
    assert all(len(every[m]) == 16 and len(rows[m]) == len(heads) for m in QUERY_GAP_METRICS)
    without = Storage(setup["tmp"] / "without-12-query")
    corpus = setup["corpus"]
    again = capture_model(setup["sampled_reg"].model("m"), corpus[corpus["example_id"] != 12], without, device="cpu")
    fresh_heads = [(int(r.layer), int(r.q_head)) for r in again.heads.itertuples()]
    assert fresh_heads == heads
    fresh_all = analyse_capture("m", without, again.prefix, heads, opts).query_heads.set_index(["layer", "q_head"])
    fresh_rows = analyse_capture("m", without, again.prefix, heads, dataclasses.replace(opts, coverage="sampled"))
    fresh_rows = fresh_rows.heads.set_index(["layer", "q_head"])
    for m in QUERY_GAP_METRICS:
        for loo, fresh in ((every[m], fresh_all), (rows[m], fresh_rows)):
            want = fresh[m].astype(float).sort_index()
            assert loo.index.equals(want.index), m
            np.testing.assert_allclose(loo[units.index([12])], want, rtol=1e-9, atol=1e-12, err_msg=m)
    published = analyse_capture("m", storage, res.prefix, heads, opts)
    gap, note = plasticity_coverage_gap("m", storage, res.prefix, heads, published.heads, published.query_heads,
                                        published.profiles)
    assert "the query model's position part with its jackknife error over the 5 documents" in note
    gap = gap.set_index(["analysis", "metric"])
    for m in QUERY_GAP_METRICS:
        row = gap.loc[("query model", m)]
        index = pd.MultiIndex.from_tuples(heads, names=["layer", "q_head"])
        per_doc = (rows[m].loc[index] - every[m].loc[index]).mean(axis=0).to_numpy()
        want = jackknife(row["gap_positions"], per_doc)
        assert row["units_positions"] == 5 and np.isclose(row["se_positions"], want.se, rtol=1e-10), m
        assert row["se_positions"] > 0


def test_plasticity_query_model_of_every_eligible_head_equals_the_rows_of_every_position(
        setup: dict[str, Any]) -> None:
    """SPEC 12.2 (issue 22, item 2): with coverage 'all' the query model (4.1) of every eligible head, the 11 the
    capture did not sample as well, comes from the moments alone; each equals the row-based fit over the rows of
    every position (a capture with per_bucket = B), and a sampled head's equals its ``plasticity_heads`` row."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity.analysis import QUERY_HEAD_COLUMNS, analyse_capture
    from qk_core.plasticity.query_model import fit_query_model

    storage, res = setup["storage"], setup["sampled"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    opts = PlasticityOptions(bootstrap=0, pairs_per_bucket=16, min_queries_per_bucket=5)
    every = analyse_capture("m", storage, res.prefix, heads, opts)
    qh = every.query_heads
    n_tokens = int(res.doc_tokens["n_tokens"].sum())
    assert list(qh.columns) == QUERY_HEAD_COLUMNS and len(qh) == 16
    assert set(qh["coverage"]) == {"all"} and set(qh["status"]) == {"ok"} and set(qh["n_docs"]) == {N_DOCS}
    assert set(qh["n_queries_model"]) == {n_tokens}
    assert sorted(map(tuple, qh.loc[qh["sampled"], ["layer", "q_head"]].to_numpy().tolist())) == sorted(heads)
    drift = ["beta_norm_per_token", "beta_norm_window", "alpha_pos", "sigma_pos", "mean_coord_r2"]
    mine = qh[qh["sampled"]].set_index(["layer", "q_head"])[drift].sort_index()
    pd.testing.assert_frame_equal(mine, every.heads.set_index(["layer", "q_head"])[drift].sort_index())
    full = CaptureReader(setup["full_storage"], setup["full"].prefix)
    for row in qh.itertuples():
        h = full.read_head(row.layer, row.q_head)
        assert len(h.q) == n_tokens
        model = fit_query_model(h.q.astype(np.float64), h.q_pos, h.window, h.bucket, opts.covariance, 5)
        want = {"beta_norm_per_token": np.linalg.norm(model.beta), "alpha_pos": model.alpha_pos,
                "sigma_pos": np.sqrt(model.sigma_pos2), "mean_coord_r2": model.r2.mean()}
        for col, value in want.items():
            np.testing.assert_allclose(getattr(row, col), value, rtol=1e-9, atol=1e-12, err_msg=f"{row} {col}")
    # the model-level query-model values rest on every eligible head too
    row = every.metrics.set_index("metric").loc["query_drift_norm_window"]
    assert row["n_heads"] == 16 and np.isclose(row["value"], qh["beta_norm_window"].mean(), rtol=1e-12)
    sampled = analyse_capture("m", storage, res.prefix, heads, dataclasses.replace(opts, coverage="sampled"))
    assert len(sampled.query_heads) == 5 and set(sampled.query_heads["coverage"]) == {"sampled"}
    assert sampled.query_heads["sampled"].all() and (sampled.query_heads["n_queries_model"] < n_tokens).all()
    assert sampled.metrics.set_index("metric").loc["query_drift_norm_window", "n_heads"] == 5


def test_document_groups_keep_the_query_sums_the_jackknife_leaves_out(setup: dict[str, Any]) -> None:
    """``capture.moment_groups = 2`` over 5 documents: groups of the sorted ids {3, 5, 7} and {9, 12}; their
    query sums add up to the merged sums and the plasticity jackknife leaves out 2 groups (SPEC 4.6); the coverage
    gap's AP position part is then jackknifed over the same 2 groups under both coverages (SPEC 12.3)."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.plasticity.analysis import analyse_capture

    tmp = setup["tmp"]
    reg = load_registry(tm.write_registry(tmp / "registry-groups.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 5, "moment_dtype": "float64", "moment_groups": 2}}},
        tmp / "corpus.jsonl"))
    storage = Storage(tmp / "groups")
    res = capture_model(reg.model("m"), setup["corpus"], storage, device="cpu")
    reader = CaptureReader(storage, res.prefix)
    assert reader.moment_groups() == 2 and reader.manifest["moments"]["groups"] == 2
    for layer in reader.moment_layers():
        merged, groups = reader.read_moments(layer), reader.read_moment_groups(layer)
        assert groups.docs == [3, 5, 7, 9, 12] and groups.sums["q_n"].shape[0] == 2
        assert groups.sums["q_n"][0].sum() == sum(res.doc_tokens.set_index("example_id")["n_tokens"][[3, 5, 7]]) \
            * len(merged.q_heads)
        assert not any(k.startswith(("k_", "p_", "qh_")) for k in groups.sums)
        for key, arr in groups.sums.items():
            np.testing.assert_allclose(arr.sum(axis=0), merged.sums[key], rtol=1e-12, atol=1e-12, err_msg=key)
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    out = analyse_capture("m", storage, res.prefix, heads,
                          PlasticityOptions(bootstrap=10, pairs_per_bucket=32, min_queries_per_bucket=5))
    assert set(out.heads["jackknife_units"]) == {2}
    assert np.isfinite(out.heads["ap_overall_lo"]).all()

    # SPEC 12.3 past moment_groups documents: the sampled protocol's refits leave the same 2 groups out, so AP's
    # position part keeps its jackknife error, published either way round
    from qk_core.plasticity.coverage import loo_headlines, plasticity_coverage_gap

    # (2 queries a bucket of a document: without 3 of the 5 documents a bucket keeps 4, so fits need no more)
    opts = PlasticityOptions(bootstrap=10, pairs_per_bucket=32, min_queries_per_bucket=2, coverage="sampled")
    every = analyse_capture("m", storage, res.prefix, heads, dataclasses.replace(opts, coverage="all"))
    rows = analyse_capture("m", storage, res.prefix, heads, opts)
    grouped = analyse_capture("m", storage, res.prefix, heads, opts, loo_groups=True)
    assert set(rows.heads["jackknife_units"]) == {5} and set(grouped.heads["jackknife_units"]) == {2}
    pd.testing.assert_frame_equal(rows.heads.drop(columns=[c for c in rows.heads if "_lo" in c or "_hi" in c
                                                            or "corrected" in c or "_se" in c or "jackknife" in c]),
                                  grouped.heads.drop(columns=[c for c in rows.heads if "_lo" in c or "_hi" in c
                                                              or "corrected" in c or "_se" in c
                                                              or "jackknife" in c]))  # point values alike
    gap, note = plasticity_coverage_gap("m", storage, res.prefix, heads, every.heads, every.query_heads,
                                        every.profiles)
    back, back_note = plasticity_coverage_gap("m", storage, res.prefix, heads, rows.heads, rows.query_heads,
                                              rows.profiles)
    assert "over the 2 groups of the 5 documents" in note and "over the 2 groups of the 5 documents" in back_note
    cols = [c for c in gap.columns if c != "published"]
    pd.testing.assert_frame_equal(gap[cols], back[cols])
    row = gap.set_index(["analysis", "metric"]).loc[("plasticity", "ap_overall")]
    per_group = (loo_headlines(grouped.heads, grouped.profiles)["ap_overall"]
                 - loo_headlines(every.heads, every.profiles)["ap_overall"]).mean(axis=0).to_numpy()
    assert row["units_positions"] == 2 and np.isclose(row["se_positions"], abs(per_group[0] - per_group[1]) / 2,
                                                      rtol=1e-10)
    # geometry leaves out the same 2 groups (their files keep the key and pair sums and their split-half shares): each
    # refit without a group equals the analysis of the corpus without its documents, captured anew, both coverages
    from qk_core.geometry.coverage import PCA_GAP_METRICS, ROTATION_GAP_METRICS, geometry_coverage_gap
    from qk_core.geometry.driver import geometry_of_capture
    from qk_core.geometry.jackknife import loo_of_moments, loo_of_rows

    reader = CaptureReader(storage, res.prefix)
    assert not reader.documents_kept()
    with pytest.raises(CaptureError, match="no per-document moments"):
        reader.read_document_moments(0)
    metrics = {"pca": PCA_GAP_METRICS, "rotation": ROTATION_GAP_METRICS}
    geo_opts = {c: (PCAOptions(coverage=c), RotationOptions(coverage=c, capture_floor="beta"))
                for c in ("sampled", "all")}
    units, by_sums = loo_of_moments(reader, *geo_opts["all"], metrics)
    by_rows = loo_of_rows(storage, res.heads, units, *geo_opts["sampled"], metrics)
    assert units == [[3, 5, 7], [9, 12]]
    corpus = setup["corpus"]
    without = Storage(tmp / "groups-without-9-12")
    again = capture_model(reg.model("m"), corpus[~corpus["example_id"].isin([9, 12])], without, device="cpu")
    for coverage, loo in (("all", by_sums), ("sampled", by_rows)):
        fresh = geometry_of_capture("m", without, again.heads, *geo_opts[coverage])
        for analysis, cols in metrics.items():
            table = fresh[analysis][0]
            table = table[table["status"] == "ok"].set_index(["layer", "q_head"]).sort_index()
            for col in cols:
                want = pd.to_numeric(table[col], errors="coerce").astype(float).dropna()
                got = loo[analysis][col][1].dropna()
                assert got.index.equals(want.index), (coverage, col)
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"{coverage} {col}")
    # and so does the query model's drift (the merge's pooled query sums less a group file's; the rows without it)
    from qk_core.plasticity.coverage import QUERY_GAP_METRICS, loo_drift_of_moments, loo_drift_of_rows

    q_units, q_sums = loo_drift_of_moments(reader)
    q_rows = loo_drift_of_rows(reader, heads, q_units)
    assert q_units == units and "query model's position part with its jackknife error over the 2 groups" in note
    fresh_all = analyse_capture("m", without, again.prefix, heads, dataclasses.replace(opts, coverage="all"))
    fresh_rows = analyse_capture("m", without, again.prefix, heads, dataclasses.replace(opts, coverage="sampled"))
    for m in QUERY_GAP_METRICS:
        for loo, fresh in ((q_sums, fresh_all.query_heads), (q_rows, fresh_rows.heads)):
            want = fresh.set_index(["layer", "q_head"])[m].astype(float).sort_index()
            np.testing.assert_allclose(loo[m][1], want, rtol=1e-9, atol=1e-12, err_msg=m)
    geo = geometry_of_capture("m", storage, res.heads, *geo_opts["all"])
    geo_gap, geo_note = geometry_coverage_gap("m", storage, res.heads, geo["pca"][0], geo["rotation"][0])
    assert "jackknife error over the 2 groups of the 5 documents" in geo_note and len(geo_gap) >= 15
    assert set(geo_gap["units_positions"]) <= {0, 2} and (geo_gap["units_positions"] == 2).sum() >= 15
    # with every position sampled, the rows' refits without a group are every position's without it (the group's sums
    # subtracted from the merged ones): the same leave-one-group-out AP, two implementations
    reg = load_registry(tm.write_registry(tmp / "registry-groups-full.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 16, "heads": 100, "moment_dtype": "float64", "lw_intensity": "exact",
                    "moment_groups": 2}}}, tmp / "corpus.jsonl"))
    storage = Storage(tmp / "groups-full")
    full = capture_model(reg.model("m"), setup["corpus"], storage, device="cpu")
    heads = [(int(r.layer), int(r.q_head)) for r in full.heads.itertuples()]
    by_rows = loo_headlines(*(lambda r: (r.heads, r.profiles))(
        analyse_capture("m", storage, full.prefix, heads, opts, loo_groups=True)))
    by_sums = loo_headlines(*(lambda r: (r.heads, r.profiles))(
        analyse_capture("m", storage, full.prefix, heads, dataclasses.replace(opts, coverage="all"))))
    assert by_rows["ap_overall"].shape == (len(heads), 2)
    for name, values in by_rows.items():
        np.testing.assert_allclose(values.to_numpy(), by_sums[name].to_numpy(), rtol=1e-8, atol=1e-10, err_msg=name)
    # and so are geometry's group refits (the merge less a group's file; the rows without its documents)
    units, geo_sums = loo_of_moments(CaptureReader(storage, full.prefix), *geo_opts["all"], metrics)
    geo_rows = loo_of_rows(storage, full.heads, units, *geo_opts["sampled"], metrics)
    for analysis, cols in metrics.items():
        for col in cols:
            assert geo_rows[analysis][col].shape == (16, 2), col
            np.testing.assert_allclose(geo_rows[analysis][col].to_numpy(), geo_sums[analysis][col].to_numpy(),
                                       rtol=1e-8, atol=1e-10, err_msg=col)
    q_units, q_sums = loo_drift_of_moments(CaptureReader(storage, full.prefix))
    q_rows = loo_drift_of_rows(CaptureReader(storage, full.prefix), heads, q_units)
    for m in QUERY_GAP_METRICS:
        assert q_rows[m].shape == (16, 2), m
        np.testing.assert_allclose(q_rows[m].to_numpy(), q_sums[m].to_numpy(), rtol=1e-8, atol=1e-10, err_msg=m)
    with pytest.raises(ValueError, match="moment_groups"):
        load_registry(tm.write_registry(tmp / "registry-groups1.toml", {"m": {
            "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
            "capture": {"moment_groups": 1}}}, tmp / "corpus.jsonl"))


def test_group_files_hold_each_groups_query_sums_in_the_accumulation_dtype(setup: dict[str, Any]) -> None:
    """``capture.moment_groups = 4`` over 5 documents (float32 sums): groups {3, 5}, {7}, {9}, {12}. A group of one
    document keeps exactly that document's query sums (its file is the group's, other sums left out); a larger
    group the float64 sum of its documents' in sorted order, rounded once to the accumulation dtype."""
    from qk_core.capture.moments import POSITION_KEYS, moments_from_bytes

    tmp = setup["tmp"]
    reg = load_registry(tm.write_registry(tmp / "registry-groups4.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 5, "moment_groups": 4, "keep_doc_files": True}}},
        tmp / "corpus.jsonl"))
    storage = Storage(tmp / "groups4")
    res = capture_model(reg.model("m"), setup["corpus"], storage, device="cpu")
    reader = CaptureReader(storage, res.prefix)
    docs = {eid: moments_from_bytes(storage.read_bytes(f"{res.prefix}/moments/docs/doc-{eid}.npz"))
            for eid in (3, 5, 7, 9, 12)}
    for layer in reader.moment_layers():
        groups = reader.read_moment_groups(layer)
        assert groups.docs == [3, 5, 7, 9, 12] and groups.sums["q_n"].shape[0] == 4
        assert set(groups.sums) == {k for k in docs[3][layer].sums if k.startswith("q_")}
        for g, members in enumerate([(3, 5), (7,), (9,), (12,)]):
            for key, arr in groups.sums.items():
                total = sum(docs[e][layer].sums[key] for e in members)
                want = total if key in POSITION_KEYS else total.astype(np.float32).astype(np.float64)
                assert np.array_equal(arr[g], want), (layer, g, key)
    # the default 16 groups: every document alone, every group file made of the documents' own files
    reg = load_registry(tm.write_registry(tmp / "registry-groups16.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 5, "keep_doc_files": True}}}, tmp / "corpus.jsonl"))
    res = capture_model(reg.model("m"), setup["corpus"], Storage(tmp / "groups16"), device="cpu")
    reader = CaptureReader(Storage(tmp / "groups16"), res.prefix)
    for layer in reader.moment_layers():
        groups = reader.read_moment_groups(layer)
        assert set(groups.sums) == {k for k in docs[3][layer].sums if k.startswith("q_")}
        for g, e in enumerate((3, 5, 7, 9, 12)):
            assert all(np.array_equal(arr[g], docs[e][layer].sums[key]) for key, arr in groups.sums.items())


def test_group_sums_of_a_capture_finalized_before_group_files_are_still_read(setup: dict[str, Any]) -> None:
    """Captures finalized before 2026-11-29 hold every group of a layer in one file (each sum on a leading group
    axis): the reader still reads them, to the values of the one-file-per-group layout."""
    import shutil

    from qk_core.capture.moments import stored_layer
    from qk_core.capture.store import legacy_moment_groups_file, moment_group_file
    from qk_core.io.npz import NpzReader, write_npz
    from qk_core.io.storage import file_record

    tmp = setup["tmp"]
    reg = load_registry(tm.write_registry(tmp / "registry-legacy.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 5, "moment_groups": 3}}}, tmp / "corpus.jsonl"))
    src = Storage(tmp / "legacy-src")
    prefix = capture_model(reg.model("m"), setup["corpus"], src, device="cpu").prefix
    old = Storage(tmp / "legacy")
    shutil.copytree(src.full(prefix), old.full(prefix))
    complete = old.read_json(f"{prefix}/complete.json")
    reader = CaptureReader(src, prefix)
    for layer in reader.moment_layers():
        parts = []
        for g in range(reader.moment_groups()):
            rel = moment_group_file(prefix, layer, g)
            with old.open_read(rel) as fh:
                parts.append({k: np.array(v) for k, v in stored_layer(NpzReader(fh), layer).items()})
            old.delete(rel)
            del complete["files"][rel[len(prefix) + 1:]]
        p = f"L{layer}."
        arrays = [(p + k, parts[0][k]) for k in ("q_heads", "kv_heads", "kv_index", "layout")]
        arrays.append((p + "docs", np.concatenate([x["docs"] for x in parts])))
        arrays += [(p + k, np.stack([x[k] for x in parts])) for k in parts[0] if k.startswith("q_") and k != "q_heads"]
        rel = legacy_moment_groups_file(prefix, layer)
        old.write_stream(rel, lambda fh, arrays=arrays: write_npz(fh, arrays))
        complete["files"][rel[len(prefix) + 1:]] = file_record(old.read_bytes(rel))
    old.write_json(f"{prefix}/complete.json", complete)
    legacy = CaptureReader(old, prefix)
    assert legacy.verify()["files"] == len(complete["files"])
    for layer in reader.moment_layers():
        a, b = legacy.read_moment_groups(layer), reader.read_moment_groups(layer)
        assert a.docs == b.docs and set(a.sums) == set(b.sums) and a.sums["q_n"].shape[0] == reader.moment_groups() == 3
        assert all(np.array_equal(a.sums[k], b.sums[k]) for k in b.sums), layer

    # geometry's group refits need the key and pair sums the group files keep now: without them its position part has
    # no error, and the note says why; a damaged group file is no such case, it fails
    from qk_core.geometry.coverage import geometry_coverage_gap
    from qk_core.geometry.driver import geometry_of_capture

    heads = capture_model(reg.model("m"), setup["corpus"], src, device="cpu").heads  # committed: read back as it is
    geo = geometry_of_capture("m", src, heads, PCAOptions(), RotationOptions(capture_floor="beta"))
    tables = (geo["pca"][0], geo["rotation"][0])
    gap, note = geometry_coverage_gap("m", src, heads, *tables)
    assert "jackknife error over the 3 groups of the 5 documents" in note and (gap["units_positions"] == 3).sum() >= 15
    gap, note = geometry_coverage_gap("m", old, heads, *tables)
    assert "the position part has no error" in note and "no document-group files" in note
    assert (gap["units_positions"] == 0).all() and len(gap) >= 15
    rel = moment_group_file(prefix, reader.moment_layers()[0], 1)
    data = bytearray(src.read_bytes(rel))
    data[len(data) // 2] ^= 0xFF
    src.write_bytes(rel, bytes(data))
    with pytest.raises(CaptureError, match="G001"):
        geometry_coverage_gap("m", src, heads, *tables)


def test_documents_that_are_their_own_groups_serve_as_the_group_files_layer_by_layer(setup: dict[str, Any]) -> None:
    """At most ``capture.moment_groups`` documents: every document is its own group and its moments file, kept, is
    the group's (no copy); the groups of a layer are read from each file's range of that layer, checked against the
    range's committed SHA-256, so a damaged layer is refused naming the file, and verification fails too."""
    import shutil

    src, prefix = setup["storage"], setup["sampled"].prefix
    complete = src.read_json(f"{prefix}/complete.json")
    assert complete["moments"]["groups_in"] == "documents" and not src.ls(f"{prefix}/moments/groups")
    reader = CaptureReader(src, prefix)
    layer = reader.moment_layers()[-1]
    groups = reader.read_moment_groups(layer)
    assert groups.docs == [3, 5, 7, 9, 12] and groups.sums["q_n"].shape[0] == 5
    assert not any(k.startswith(("k_", "p_")) for k in groups.sums)
    merged = reader.read_moments(layer)
    for key, arr in groups.sums.items():
        np.testing.assert_allclose(arr.sum(axis=0), merged.sums[key], rtol=1e-12, atol=1e-12, err_msg=key)
    damaged = Storage(setup["tmp"] / "damaged-layer")
    shutil.copytree(src.full(prefix), damaged.full(prefix))
    name = "moments/docs/doc-9.npz"
    lo, hi, _ = complete["files"][name]["layers"][str(layer)]
    path = Path(damaged.full(f"{prefix}/{name}"))
    data = bytearray(path.read_bytes())
    data[(lo + hi) // 2] ^= 1
    path.write_bytes(bytes(data))
    bad = CaptureReader(damaged, prefix)
    with pytest.raises(CaptureError, match=rf"doc-9\.npz: layer {layer}'s bytes"):
        bad.read_moment_groups(layer)
    bad.read_moment_groups(reader.moment_layers()[0])  # another layer's range is intact
    with pytest.raises(CaptureError, match=r"doc-9\.npz"):
        bad.verify()
    # a reader parses a file's zip directory once; a file swapped after its first read is still refused
    first = reader.moment_layers()[0]
    bad.read_moment_groups(first)
    shutil.copyfile(damaged.full(f"{prefix}/moments/docs/doc-5.npz"), path)
    with pytest.raises(CaptureError, match=rf"doc-9\.npz: layer {first}'s bytes .* \(altered or swapped\)"):
        bad.read_moment_groups(first)


def test_finalize_hashes_the_documents_moments_files_its_merge_checked_once(
        setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge reads each kept document moments file back and checks it against its committed SHA-256; the
    verification that follows checks only their sizes (every other file is hashed). A file truncated after the merge's
    check fails the finalize naming it; one altered then is refused when a layer of it is read, and by
    ``verify_capture``."""
    from qk_core.capture import store as capture_store

    res = setup["sampled"]
    kept = [n for n in CaptureReader(setup["storage"], res.prefix).files if n.startswith("moments/docs/")]
    assert len(kept) == N_DOCS and res.verification is not None
    assert res.verification["files_hashed"] == res.verification["files"] - N_DOCS
    entry, corpus = setup["sampled_reg"].model("m"), setup["corpus"]
    orig = capture_store.CaptureReader.verify
    for how, name in (("truncate", "doc-3.npz"), ("flip", "doc-7.npz")):
        storage = Storage(setup["tmp"] / f"after-merge-{how}")
        part = capture_model(entry, corpus, storage, device="cpu", only_docs=[7, 3], finalize=False)
        rel = f"{part.prefix}/moments/docs/{name}"

        def damage_then_verify(self: CaptureReader, rel: str = rel, name: str = name, how: str = how,
                               **kwargs: Any) -> dict:
            data = bytearray(self.storage.read_bytes(rel))
            if how == "truncate":
                del data[-1]
            else:  # a byte in the middle of the last layer's range
                ranges = self.files[f"moments/docs/{name}"]["layers"]
                lo, hi, _ = ranges[max(ranges, key=int)]
                data[(lo + hi) // 2] ^= 1
            self.storage.write_bytes(rel, bytes(data))
            return orig(self, **kwargs)

        monkeypatch.setattr(capture_store.CaptureReader, "verify", damage_then_verify)
        writer = CaptureWriter(storage, entry.key, storage.read_json(f"{part.prefix}/manifest.json"))
        if how == "truncate":
            with pytest.raises(CaptureError, match=rf"{name}: .*bytes, committed"):
                writer.finalize()
            assert not storage.exists(f"{part.prefix}/complete.json")
            continue
        writer.finalize()
        monkeypatch.undo()
        reader = CaptureReader(storage, part.prefix)
        reader.read_moment_groups(reader.moment_layers()[0])  # another layer's range is intact
        with pytest.raises(CaptureError, match=rf"{name}: layer {reader.moment_layers()[-1]}'s bytes"):
            reader.read_moment_groups(reader.moment_layers()[-1])
        report = capture_store.verify_capture(storage, part.prefix)
        assert not report["passed"] and name in report["error"]


def test_a_capture_without_moments_says_coverage_all_needs_them(setup: dict[str, Any],
                                                                without_moments: tuple[Storage, Any]) -> None:
    """``capture.moments = false`` (not in the fingerprint: it adds files, not rows) stores no moments, and
    coverage 'all' then fails naming the capture instead of silently falling back."""
    from qk_core.geometry.driver import geometry_of_capture

    storage, res = without_moments
    assert res.prefix == setup["sampled"].prefix  # the same fingerprint as the capture with moments
    reader = CaptureReader(storage, res.prefix)
    assert reader.moment_layers() == [] and not storage.ls(f"{res.prefix}/moments")
    assert "none merged" in reader.complete["moments"]["note"]
    with pytest.raises(CaptureError, match="no moments"):
        geometry_of_capture("m", storage, res.heads, PCAOptions(coverage="all"), None)


def test_cross_corpus_refits_follow_plasticity_coverage_all(setup: dict[str, Any]) -> None:
    """SPEC 4.6 / 10 with coverage 'all': the cross-corpus jackknife of AP leaves out the same document groups of
    every position's query model as plasticity's did, so a corpus's AP interval equals plasticity_metrics'."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.cross_corpus.compare import CorpusInputs, CrossCorpusOptions, corpus_values
    from qk_core.geometry.driver import geometry_of_capture
    from qk_core.plasticity.analysis import CaptureQuerySums, analyse_capture

    storage, res = setup["storage"], setup["sampled"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    opts = PlasticityOptions(pairs_per_bucket=32, min_queries_per_bucket=5)
    plast = analyse_capture("m", storage, res.prefix, heads, opts)
    rot = geometry_of_capture("m", storage, res.heads, None, RotationOptions(capture_floor="beta"))["rotation"][0]
    reader = CaptureReader(storage, res.prefix)
    rot = rot.merge(reader.heads()[["layer", "q_head"]], on=["layer", "q_head"])  # as load_corpus: rows' heads
    inp = CorpusInputs("tiny", reader.doc_tokens()["example_id"].to_numpy(), plast.pairs, rot, reader.window,
                       reader.bucket, reader.read_head, CaptureQuerySums(reader))
    got = corpus_values(inp, 0, CrossCorpusOptions(min_queries_per_bucket=5), "m")
    want = plast.metrics.set_index("metric")
    assert got.query_model == "refitted" and got.loo["ap_overall"].shape == (N_DOCS,)
    jk = got.jack("ap_overall")
    assert float(jk.point) == pytest.approx(want.loc["ap_overall", "value"], abs=1e-6)  # pairs keep float32 PP
    from qk_core.stats.jackknife import jackknife_interval

    lo, hi = jackknife_interval(jk, 0.95, CrossCorpusOptions().inflation)
    assert (float(lo), float(hi)) == pytest.approx((want.loc["ap_overall", "lo"], want.loc["ap_overall", "hi"]),
                                                   abs=1e-6)
    rows = corpus_values(dataclasses.replace(inp, query_sums=None), 0, CrossCorpusOptions(min_queries_per_bucket=5),
                         "m")  # the rows' refits around every position's values: not the same interval
    assert not np.allclose(rows.loo["ap_overall"], got.loo["ap_overall"], rtol=0, atol=1e-6)


def test_cross_corpus_reads_plasticity_refits_instead_of_refitting(setup: dict[str, Any]) -> None:
    """The leave-one-group-out AP that plasticity_profiles stores (ap_loo) is what the cross-corpus comparison would
    refit from the capture: reading it gives the same jackknife, and a damaged table is an error naming the head."""
    from qk_core.config.options import PlasticityOptions
    from qk_core.cross_corpus.compare import CorpusInputs, CrossCorpusError, CrossCorpusOptions, corpus_values
    from qk_core.plasticity.analysis import CaptureQuerySums, analyse_capture

    storage, res = setup["storage"], setup["sampled"]
    heads = [(int(r.layer), int(r.q_head)) for r in res.heads.itertuples()]
    opts = PlasticityOptions(pairs_per_bucket=32, min_queries_per_bucket=5)
    plast = analyse_capture("m", storage, res.prefix, heads, opts)
    reader = CaptureReader(storage, res.prefix)
    rot = pd.DataFrame({"layer": [h[0] for h in heads], "q_head": [h[1] for h in heads], "status": "skipped",
                        "bias_strength": np.nan})
    inp = CorpusInputs("tiny", reader.doc_tokens()["example_id"].to_numpy(), plast.pairs, rot, reader.window,
                       reader.bucket, reader.read_head, CaptureQuerySums(reader))
    copts = CrossCorpusOptions(min_queries_per_bucket=5)
    refit = corpus_values(inp, 0, copts, "m")
    stored = dataclasses.replace(inp, loo_profiles=plast.profiles[["layer", "q_head", "bucket", "ap_loo"]])
    read = corpus_values(dataclasses.replace(stored, read_head=None), 0, copts, "m")  # no capture rows needed
    assert read.query_model == "refitted" and np.isfinite(read.loo["ap_overall"]).all()
    for key in ("ap_overall", "ap_drop", "profile"):
        np.testing.assert_allclose(read.loo[key], refit.loo[key], rtol=1e-9, atol=1e-12)
    damaged = plast.profiles[["layer", "q_head", "bucket", "ap_loo"]].iloc[1:]  # head 0 lost its bucket 0
    with pytest.raises(CrossCorpusError, match=r"head \(.*\) has ap_loo for buckets"):
        corpus_values(dataclasses.replace(inp, loo_profiles=damaged), 0, copts, "m")
