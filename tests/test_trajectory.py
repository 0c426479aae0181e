"""Trajectory core (SPEC 6) on synthetic metric tables: planted per-head values, known configs."""

from __future__ import annotations

import csv
import io

import numpy as np
import pandas as pd
import pytest

from qk_core.config.settings import DATA_DIR
from qk_core.io.metrics import metric_row, metrics_frame
from qk_core.plots.trajectory import trajectory_figures
from qk_core.trajectory.series import (
    Checkpoint,
    TrajectoryError,
    checkpoint_config,
    load_reference,
    phase,
    profile_table,
    summary,
    training_step,
    trajectory_table,
)

RNG = np.random.default_rng(7)
N_HEADS = 6
CONFIGS = [  # per revision: own L, B, rope_theta, max_position_embeddings (different on purpose)
    ("stage1-step-100", dict(window=64, bucket=4, rope_theta=10000.0, max_position_embeddings=64)),
    ("stage2-step-300", dict(window=64, bucket=4, rope_theta=50000.0, max_position_embeddings=128)),
    ("lc-step-20", dict(window=256, bucket=16, rope_theta=1.5e6, max_position_embeddings=512)),
]


def per_head(n: int = N_HEADS, loc: float = 0.0, scale: float = 1.0) -> np.ndarray:
    return RNG.normal(loc, scale, n)


def planted_checkpoint(i: int, rev: str, cfg: dict, with_window_metric: bool) -> tuple[Checkpoint, dict]:
    key = f"ser@{rev}"
    truth: dict[str, np.ndarray] = {
        "bias_strength": per_head(loc=0.01 * (i + 1), scale=0.002),
        "abs_alpha_k": np.abs(per_head(loc=0.003, scale=0.001)),
        "mu_q_a": per_head(loc=2.0 + i),
        "abs_r_k_a": np.abs(per_head(loc=0.8, scale=0.05)),
        "separation_strength": np.abs(per_head(loc=0.3, scale=0.02)),
        "plane_var_fraction": np.abs(per_head(loc=0.35, scale=0.02)),
        "ap_overall": per_head(loc=0.55, scale=0.01),
        "ap_first20": per_head(loc=0.6, scale=0.01),
        "ap_last20": per_head(loc=0.5 - 0.02 * i, scale=0.01),
    }
    truth["ap_drop"] = truth["ap_first20"] - truth["ap_last20"]
    opts = {"L": cfg["window"], "B": cfg["bucket"]}
    rot = [metric_row(key, m, truth[m], unit="per token", options=opts)
           for m in ["bias_strength", "abs_alpha_k", "mu_q_a", "abs_r_k_a", "separation_strength",
                     "plane_var_fraction"]]
    # a binned row of the same metric must not be mistaken for the model value
    rot.append(metric_row(key, "bias_strength", [99.0], key="layer-0", unit="per token", options=opts))
    if with_window_metric:
        truth["bias_strength_window"] = truth["bias_strength"] * cfg["window"]
        rot.append(metric_row(key, "bias_strength_window", truth["bias_strength_window"],
                              unit="window-normalised (x L)", options=opts))
    pla = [metric_row(key, m, truth[m], unit="AP", options=opts, lo=truth[m].mean() - 0.01 * (j + 1),
                      hi=truth[m].mean() + 0.02 * (j + 1))
           for j, m in enumerate(["ap_overall", "ap_first20", "ap_last20", "ap_drop"])]
    pla.append(metric_row(key, "ap_quintile", [0.4], key="q1", unit="AP", options=opts))
    classes = ["position-dominated", "q-positional", "k-positional", "content", "mixed"]
    labels = RNG.choice(classes, size=N_HEADS)
    pca = [metric_row(key, f"pca_share_{c}", (labels == c).astype(float), unit="fraction", options=opts)
           for c in classes]
    B, L = cfg["bucket"], cfg["window"]
    J = L // B
    prof = pd.DataFrame([{"layer": h // 2, "q_head": h % 2, "bucket": b, "tau": (b + 0.5) * B,
                          "ap": 0.7 - 0.3 * b / J + 0.01 * h + 0.001 * i}
                         for h in range(N_HEADS) for b in range(1, J)])
    if i == 1:  # the plasticity analysis' own naming: tau_tokens, plus the empirical estimator's AP
        prof = prof.rename(columns={"tau": "tau_tokens"}).assign(ap_empirical=lambda d: d["ap"] - 0.05)
    ck = Checkpoint(key=key, revision=rev, step_index=i, config=dict(cfg),
                    metrics={"rotation_metrics": metrics_frame(rot), "plasticity_metrics": metrics_frame(pla),
                             "pca_metrics": metrics_frame(pca)},
                    profiles=prof)
    truth["labels"] = labels
    truth["profile"] = prof
    return ck, truth


@pytest.fixture
def series() -> tuple[list[Checkpoint], list[dict]]:
    cks, truths = [], []
    for i, (rev, cfg) in enumerate(CONFIGS):
        ck, t = planted_checkpoint(i, rev, cfg, with_window_metric=(i == 0))
        cks.append(ck)
        truths.append(t)
    return cks, truths


def test_table_values_order_and_config(series: tuple[list[Checkpoint], list[dict]]) -> None:
    cks, truths = series
    table = trajectory_table("ser", [cks[2], cks[0], cks[1]])  # shuffled input
    assert table["revision"].tolist() == [r for r, _ in CONFIGS]
    assert table["step_index"].tolist() == [0, 1, 2]
    assert table["step"].tolist() == [100.0, 300.0, 20.0]
    for i, (row, truth, (_, cfg)) in enumerate(zip(table.itertuples(), truths, CONFIGS, strict=True)):
        for name in ("window", "bucket", "rope_theta", "max_position_embeddings"):
            assert getattr(row, name) == cfg[name]
        assert row.config_source == "capture" and row.complete and row.missing == ""
        for name in ("bias_strength", "abs_alpha_k", "mu_q_a", "abs_r_k_a", "separation_strength",
                     "plane_var_fraction", "ap_overall", "ap_first20", "ap_last20", "ap_drop"):
            assert getattr(row, name) == pytest.approx(truth[name].mean(), rel=1e-12), name
        # window-normalised: taken from the analysis when given, else x L of *this* checkpoint's L
        assert row.bias_strength_window == pytest.approx(truth["bias_strength"].mean() * cfg["window"])
        assert row.abs_alpha_k_window == pytest.approx(truth["abs_alpha_k"].mean() * cfg["window"])
        for j, name in enumerate(["ap_overall", "ap_first20", "ap_last20", "ap_drop"]):
            assert getattr(row, f"{name}_lo") == pytest.approx(truth[name].mean() - 0.01 * (j + 1))
            assert getattr(row, f"{name}_hi") == pytest.approx(truth[name].mean() + 0.02 * (j + 1))
        for c in ["position-dominated", "q-positional", "k-positional", "content", "mixed"]:
            assert table.loc[i, f"pca_share_{c}"] == pytest.approx(np.mean(truth["labels"] == c))
        assert row.n_heads == N_HEADS
    shares = table[[c for c in table.columns if c.startswith("pca_share_")]].sum(axis=1)
    np.testing.assert_allclose(shares, 1.0)


def test_missing_checkpoints_and_inputs_are_named(series: tuple[list[Checkpoint], list[dict]]) -> None:
    cks, truths = series
    absent = Checkpoint(key="ser@stage2-step-300", revision="stage2-step-300", step_index=1,
                        fallback_config={"window": 64, "bucket": 4})
    partial = cks[2]
    partial.profiles = None
    partial.metrics["plasticity_metrics"] = None
    table = trajectory_table("ser", [cks[0], absent, partial])
    assert table["missing"].tolist() == [
        "", "capture,pca_metrics,rotation_metrics,plasticity_metrics,plasticity_profiles",
        "plasticity_metrics,plasticity_profiles"]
    assert table["complete"].tolist() == [True, False, False]
    assert table.loc[1, "config_source"] == "registry" and table.loc[1, "window"] == 64
    assert np.isnan(table.loc[1, "rope_theta"]) and np.isnan(table.loc[1, "bias_strength"])
    assert np.isnan(table.loc[2, "ap_overall"])
    assert table.loc[2, "bias_strength"] == pytest.approx(truths[2]["bias_strength"].mean())
    s = summary(table)
    assert s["checkpoints"] == 3 and s["complete"] == 1
    assert set(s["missing"]) == {"stage2-step-300", "lc-step-20"}
    prof = profile_table([cks[0], absent, partial])
    assert prof["model"].unique().tolist() == [cks[0].key]


def test_profile_in_absolute_positions(series: tuple[list[Checkpoint], list[dict]]) -> None:
    cks, truths = series
    prof = profile_table(cks)
    for ck, truth, (_, cfg) in zip(cks, truths, CONFIGS, strict=True):
        got = prof[prof["model"] == ck.key].sort_values("bucket")
        exp = truth["profile"].groupby("bucket")["ap"].agg(["mean", "median", "count"])
        assert got["bucket"].tolist() == exp.index.tolist()
        np.testing.assert_allclose(got["ap"], exp["mean"], rtol=1e-12)
        np.testing.assert_allclose(got["ap_median"], exp["median"], rtol=1e-12)
        assert (got["n_heads"] == N_HEADS).all()
        np.testing.assert_allclose(got["tau"], (exp.index.to_numpy() + 0.5) * cfg["bucket"])
        np.testing.assert_allclose(got["tau_norm"], got["tau"] / cfg["window"])
        assert (got["window"] == cfg["window"]).all() and (got["bucket_width"] == cfg["bucket"]).all()
        if "ap_empirical" in truth["profile"]:
            np.testing.assert_allclose(got["ap_empirical"], exp["mean"] - 0.05, rtol=1e-12)
        else:
            assert got["ap_empirical"].isna().all()
    # tau derived from the bucket index when a profile carries only buckets
    ck = cks[2]
    ck.profiles = ck.profiles.drop(columns=["tau"])
    again = profile_table([ck])
    np.testing.assert_allclose(again["tau"], (again["bucket"] + 0.5) * 16)
    ck.profiles = ck.profiles.rename(columns={"ap": "something_else"})
    with pytest.raises(TrajectoryError, match="ser@lc-step-20"):
        profile_table([ck])


def test_reference_columns_match_the_thesis_csv() -> None:
    text = (DATA_DIR / "reference" / "thesis_metrics.csv").read_text()
    expected = {(r["model"], r["metric"]): float(r["value"]) for r in csv.DictReader(io.StringIO(text))
                if r["model"].startswith("smollm3-3b@") and not r["key"]}
    revs = ["stage1-step-40000", "lc-4k-to-32k-step-4000"]
    cks = [Checkpoint(key=f"smollm3-3b@{r}", revision=r, step_index=i, fallback_config={"window": 4096,
                                                                                       "bucket": 256})
           for i, r in enumerate(revs)]
    table = trajectory_table("smollm3-3b", cks, load_reference())
    for i, r in enumerate(revs):
        for metric in ("bias_strength", "abs_alpha_k", "ap_first20", "ap_last20", "plane_var_fraction"):
            assert table.loc[i, f"ref_{metric}"] == expected[(f"smollm3-3b@{r}", metric)]
    assert table.loc[0, "ref_bias_strength"] == 0.0092


def test_checkpoint_config_reads_nested_manifest() -> None:
    manifest = {"fingerprint": "x", "window": 256, "bucket": 16, "heads": [],
                "model": {"config": {"rope_theta": 1.5e6, "max_position_embeddings": 512}}}
    assert checkpoint_config(manifest) == {"window": 256, "bucket": 16, "rope_theta": 1.5e6,
                                           "max_position_embeddings": 512.0}
    # layer metadata as the capture records it (SPEC 1.8): a NoPE layer, a sliding layer with its own
    # theta, and the captured full-attention layer whose theta is the one that counts
    layers = [
        {"layer": 0, "rope_applied": False, "rope_theta": None, "eligible": True},
        {"layer": 1, "rope_applied": True, "rope_theta": 1e4, "eligible": False, "attention_type": "sliding"},
        {"layer": 2, "rope_applied": True, "rope_theta": 1e6, "eligible": True, "attention_type": "full"},
    ]
    cfg = checkpoint_config({"window": 128, "bucket": 8, "layers": layers, "model": {"text_config": {
        "max_position_embeddings": 4096, "rope_theta": 5.0}}})
    assert cfg == {"window": 128, "bucket": 8, "rope_theta": 1e6, "max_position_embeddings": 4096.0}
    cfg = checkpoint_config({"window": 128, "bucket": 8, "layers": layers[:1]})
    assert np.isnan(cfg["rope_theta"]) and np.isnan(cfg["max_position_embeddings"])
    with pytest.raises(TrajectoryError, match="window"):
        checkpoint_config({"bucket": 4})


def test_step_and_phase() -> None:
    assert training_step("stage1-step-1200000") == 1200000
    assert training_step("lc-32k-to-64k-step-4000") == 4000
    assert np.isnan(training_step("main"))
    assert phase("lc-4k-to-32k-step-20000") == "lc-4k-to-32k"
    assert phase("main") == "main"


def test_figures_plot_the_table(series: tuple[list[Checkpoint], list[dict]]) -> None:
    cks, _ = series
    table = trajectory_table("ser", cks)
    prof = profile_table(cks)
    figs = trajectory_figures(table, prof, "ser")
    assert set(figs) == {"ap_bias", "bias_decomposition", "profiles"}
    ap_ax = figs["ap_bias"].axes[0]
    lines = {ln.get_label(): ln.get_ydata() for ln in ap_ax.get_lines()}
    np.testing.assert_allclose(lines["AP_first20"], table["ap_first20"])
    np.testing.assert_allclose(lines["AP_last20"], table["ap_last20"])
    raw_bars, win_bars = (figs["ap_bias"].axes[k].patches for k in (1, 2))
    np.testing.assert_allclose([p.get_height() for p in raw_bars], table["bias_strength"])
    np.testing.assert_allclose([p.get_height() for p in win_bars], table["bias_strength_window"])
    dec = figs["bias_decomposition"].axes
    assert len(dec) == 6
    np.testing.assert_allclose(dec[5].get_lines()[0].get_ydata(), table["bias_strength_window"])
    abs_ax, norm_ax = figs["profiles"].axes
    assert len(abs_ax.get_lines()) == 3
    last = prof[prof["model"] == cks[2].key]
    np.testing.assert_allclose(abs_ax.get_lines()[2].get_xdata(), last["tau"])
    np.testing.assert_allclose(norm_ax.get_lines()[2].get_xdata(), last["tau"] / 256)
    for fig in figs.values():
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        assert buf.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"

