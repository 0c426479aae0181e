"""Plasticity values are unchanged by the speed and memory work of issue 18 (SPEC 4).

The pinned numbers were computed by the implementation before that work (main at 4b3f8d1 and again at
af57cdc, identical) on the synthetic capture below, with the same seeds and options. The current code
must reproduce them (float64 values to 1e-9 relative; sums over float32 records to 1e-6), and its
concurrent head loop must give tables identical to a sequential run.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from qk_core.capture.store import HeadData
from qk_core.config.options import PlasticityOptions
from qk_core.plasticity import analyse_model

L, B, D, N_DOCS = 4096, 256, 32, 60
HEADS = [(0, 1), (0, 3), (2, 0)]
OPTS = PlasticityOptions(pairs_per_bucket=64, bootstrap=50, interval="percentile")  # the pinned bootstrap intervals
PINNED = {'ap_overall': [0.9643246945698007, 0.9640761066683171, 0.8842171750938789],
          'ap_overall_lo': [0.9605279906394764, 0.9614184631131074, 0.8761002467208033],
          'ap_overall_hi': [0.9679667682040456, 0.9686032726964178, 0.8961537608176691],
          'ap_drop': [0.052968191940092946, 0.050537670942291335, 0.20095352147877],
          'ap_drop_lo': [0.04466812697390219, 0.03964812997177883, 0.15186912964451268],
          'ap_drop_hi': [0.06705222491036185, 0.05887784866933994, 0.2297155216903573],
          'ap_overall_empirical': [0.9611968171296297, 0.9610326967592592, 0.8799669174382717],
          'gap_mean': [0.0031278774401711637, 0.0030434099090577817, 0.004250257655607344],
          'sigma_pos': [0.9716362114411459, 1.005342402863422, 1.0086956513794967],
          'resid1_skew': [-0.02206992832326637, -0.031455555242219144, 0.02682061739083816],
          'n_pairs': [956.0, 956.0, 956.0],
          'pairs': {'rows': 2868,
                    'valid': 2868,
                    'example_id': 371862,
                    't_i': 1916576,
                    't_j': 3986148,
                    'bucket': 23028,
                    'tau_tokens': 6262272.0,
                    'delta_1': -815.9962861430831,
                    'z': -222.8862898624211,
                    'pp': 2688.281051777303,
                    'pp_empirical': 2678.3319557867944},
          'metrics': {'ap_overall|': [0.937539325443999, 0.9640761066683171, 0.9335307244362004, 0.9413585299524678],
                      'ap_drop|': [0.10148646145371809, 0.052968191940092946, 0.08611977985296987, 0.11298816481094297],
                      'ap_decile|10-20%': [
                       0.9846580864015783, 0.985602395145529, 0.9809609924470049, 0.9875653000197516],
                      'ap_length_bin|0-8k': [
                       0.937539325443999, 0.964076106668317, 0.9335307244362006, 0.9413585299524677]},
          'heatmap': {'cells': 118, 'n_pairs': 2868, 'pp_weighted': 2688.2810511676253},
          'profiles_ap': 42.18926964497995,
          'profiles_ap_lo': 41.42667601286543,
          'bins_value': 59.384061876470085,
          'bins_hi': 60.05068616889274,
          'components_weight': [0.1233482470210194, 0.13564415387082643, 0.16174847796178773]}


def make_heads() -> dict[tuple[int, int], HeadData]:
    """Two stratified positions per document and bucket; queries and keys drift along one axis."""
    out = {}
    for layer, q_head in HEADS:
        rng = np.random.default_rng([11, layer, q_head])
        J = L // B
        pos = (np.arange(J)[None, :, None] * B + rng.integers(0, B, (N_DOCS, J, 2))).reshape(N_DOCS, -1)
        pos = np.sort(pos, axis=1).ravel().astype(np.int32)
        doc = np.repeat(np.arange(100, 100 + N_DOCS, dtype=np.int64), 2 * J)
        u = rng.standard_normal(D)
        u /= np.linalg.norm(u)
        drift = np.outer(pos / L, (1.5 + layer) * u)
        q = (0.4 * u + drift + rng.standard_normal((len(pos), D))).astype(np.float32)
        k = (0.8 * drift + rng.standard_normal((len(pos), D))).astype(np.float32)
        out[(layer, q_head)] = HeadData(layer, q_head, q_head // 2, q, pos, doc, k, pos.copy(), doc.copy(), L, B)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[int, object]:
    heads = make_heads()
    return {w: analyse_model("ref", HEADS, lambda la, h: heads[(la, h)], np.arange(100, 100 + N_DOCS), L, B, OPTS,
                             workers=w) for w in (1, 3)}


def test_values_match_the_pinned_reference(runs: dict) -> None:
    res = runs[1]
    h = res.heads
    for col in ("ap_overall", "ap_overall_lo", "ap_overall_hi", "ap_drop", "ap_drop_lo", "ap_drop_hi",
                "ap_overall_empirical", "gap_mean", "sigma_pos", "resid1_skew", "n_pairs"):
        np.testing.assert_allclose(h[col].to_numpy(float), PINNED[col], rtol=1e-9, atol=1e-12, err_msg=col)
    p, want = res.pairs, PINNED["pairs"]
    assert len(p) == want["rows"] and int(p["valid"].sum()) == want["valid"]
    for col in ("example_id", "t_i", "t_j", "bucket"):
        assert int(p[col].sum()) == want[col], col
    for col in ("tau_tokens", "delta_1", "z", "pp", "pp_empirical"):
        assert np.nansum(p[col].to_numpy(np.float64)) == pytest.approx(want[col], rel=1e-6), col
    m = res.metrics.set_index(["metric", "key"])
    for key, vals in PINNED["metrics"].items():
        metric, bin_key = key.split("|")
        got = [float(m.loc[(metric, bin_key), c]) for c in ("value", "median", "lo", "hi")]
        np.testing.assert_allclose(got, vals, rtol=1e-9, err_msg=key)
    hm = res.heatmap
    assert len(hm) == PINNED["heatmap"]["cells"] and int(hm["n_pairs"].sum()) == PINNED["heatmap"]["n_pairs"]
    assert float((hm["pp_mean"] * hm["n_pairs"]).sum()) == pytest.approx(PINNED["heatmap"]["pp_weighted"], rel=1e-9)
    assert float(np.nansum(res.profiles["ap"])) == pytest.approx(PINNED["profiles_ap"], rel=1e-9)
    assert float(np.nansum(res.profiles["ap_lo"])) == pytest.approx(PINNED["profiles_ap_lo"], rel=1e-9)
    assert float(np.nansum(res.bins["value"])) == pytest.approx(PINNED["bins_value"], rel=1e-9)
    assert float(np.nansum(res.bins["hi"])) == pytest.approx(PINNED["bins_hi"], rel=1e-9)
    np.testing.assert_allclose(res.components.groupby("q_head")["weight"].max(), PINNED["components_weight"],
                               rtol=1e-9)


def test_concurrent_heads_give_identical_tables(runs: dict) -> None:
    a, b = runs[1], runs[3]
    for name in ("heads", "profiles", "bins", "pairs", "components", "heatmap", "metrics"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True, obj=name)


def test_pair_records_are_complete_and_compact(runs: dict) -> None:
    p = runs[1].pairs
    for col in ("model", "layer", "q_head", "example_id", "t_i", "t_j", "bucket", "tau_tokens", "delta_1", "z",
                "pp", "pp_empirical", "valid"):
        assert col in p, col
    assert isinstance(p["model"].dtype, pd.CategoricalDtype)
    per_row = p.memory_usage(deep=True, index=False).sum() / len(p)
    assert per_row <= 52.5, f"{per_row:.1f} bytes per pair record in memory"


def test_pair_records_are_stored_compactly_and_read_back_unchanged(runs: dict, tmp_path) -> None:
    """The IO manager's options: dictionaries for few-valued floats (tau, empirical PP: shares of a bucket's
    queries), byte-stream-split for the others, smaller than pyarrow's defaults, values unchanged."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qk_assets.io_manager import parquet_write_options

    big = runs[1].pairs
    tbl = pa.Table.from_pandas(big, preserve_index=False)
    opts = parquet_write_options(tbl)
    assert set(opts["use_byte_stream_split"]) == {"delta_1", "z", "pp"}
    assert {"tau_tokens", "pp_empirical", "t_i", "example_id"} <= set(opts["use_dictionary"])
    pq.write_table(tbl, tmp_path / "stored.parquet", **opts)
    pq.write_table(tbl, tmp_path / "default.parquet")
    stored, default = (tmp_path / "stored.parquet").stat().st_size, (tmp_path / "default.parquet").stat().st_size
    assert stored < 0.9 * default, (stored, default)
    md = pq.ParquetFile(tmp_path / "stored.parquet").metadata.row_group(0)
    enc = {md.column(i).path_in_schema: md.column(i).encodings for i in range(md.num_columns)}
    assert "BYTE_STREAM_SPLIT" in enc["z"] and "RLE_DICTIONARY" in enc["pp_empirical"]
    pd.testing.assert_frame_equal(pq.read_table(tmp_path / "stored.parquet").to_pandas(), big, check_exact=True)
