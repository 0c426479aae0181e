"""CPU smoke run of bench/gpu_capture.py at tiny widths: the GPU benchmark's code path cannot rot.

The same ``run_case`` as on the GPU (capture_model into a storage root, output identity, the model's own
eager logits, pair-norm factors of YaRN / query temperature / NoPE / q-k norm, layer metadata, masks)
on every real architecture at tiny width, fp32 on CPU. A negative control shows the logit check fails
for wrong rows.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_capture

pytestmark = pytest.mark.slow  # every real architecture at tiny width through the benchmark (about 25 s)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    rc = gpu_capture.main(["--device", "cpu", "--tiny", "--repeats", "1", "--lengths", "192", "--out", str(out)])
    data = json.loads((out / "gpu_capture.json").read_text())
    data["rc"] = rc
    data["md"] = (out / "gpu_capture.md").read_text()
    return data


def test_every_shape_runs_and_passes_its_checks(smoke: dict) -> None:
    results = {r["shape"]: r for r in smoke["results"]}
    assert set(results) == set(gpu_capture.SHAPES)
    for name, r in results.items():
        assert r["status"] == "ok", (name, r.get("error"), r.get("failures"), r.get("traceback"))
        assert r["outputs_identical"], name
        assert all(c["logit_ok"] and c["pairs"] > 50 for c in r["head_checks"]), name
        assert all(r["layer_checks"].values()), (name, r["layer_checks"])
        assert r["full_layer_masks"] == ["None (is_causal)"], name  # no L x L mask for full attention
        assert r["tokens_per_s_plain"] > 0 and r["capture_peak_mb"] and r["forward_tflop"] > 0
        # every-head moments (issue 22 item 4): timed beside the plain forward, equal to a float64 brute force
        assert r["moments_wall_ratio"] > 0 and r["moments_peak_mb"] and r["moment_layers"] >= 1, name
        assert r["moments_check"] and all(c["ok"] and 0 <= c["xx_rel_err"] <= c["bound"]
                                          for c in r["moments_check"]), (name, r["moments_check"])
    assert smoke["rc"] == 0
    assert "| qwen3-8b | sdpa | 192 | ok |" in smoke["md"]


def test_family_factors_are_the_expected_ones(smoke: dict) -> None:
    """YaRN attention factor, Ministral's temperature above its original context, NoPE raw projections."""
    r = {x["shape"]: x for x in smoke["results"]}
    yarn = 0.1 * math.log(4.0) + 1.0
    assert all(c["pair_ratio_expected_range"] == [yarn, yarn] and "qk_norm_ok" in c
               for c in r["qwen3-8b"]["head_checks"])
    lo, hi = r["ministral-3-8b"]["head_checks"][0]["pair_ratio_expected_range"]
    assert lo == 1.0 and hi == pytest.approx(1 + 0.1 * math.log(1 + 191 // 64))  # original context 64 (tiny)
    assert any("nope_ok" in c for c in r["smollm3-3b"]["head_checks"])
    assert r["gemma3-4b"]["sliding_layer_masks"] == ["Tensor(1, 1, 192, 192)"]  # sdpa materialises sliding masks


def test_moments_check_fails_for_shifted_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Negative control: the brute force over query rows shifted by one position disagrees with the stored sums.
    The failed case leaves no capture behind (on the device its folder holds gigabytes)."""
    monkeypatch.setattr(gpu_capture.tempfile, "tempdir", str(tmp_path))
    real = gpu_capture.QueryTap.read

    def shifted(self: gpu_capture.QueryTap, *args: object) -> None:
        real(self, *args)
        self.rows = {k: np.roll(v, 1, axis=0) for k, v in self.rows.items()}

    monkeypatch.setattr(gpu_capture.QueryTap, "read", shifted)
    rec = gpu_capture.run_case(gpu_capture.SHAPES["llama-3.2-1b"], "sdpa", 128, "cpu", "float32", True, 1, 2)
    assert rec["status"] == "failed" and any("moments differ" in f for f in rec["failures"])
    assert all(not c["ok"] and c["xx_rel_err"] > 100 * c["bound"] for c in rec["moments_check"])
    assert list(tmp_path.glob("gpu-capture-*")) == []


def test_logit_check_fails_for_wrong_rows() -> None:
    """Negative control: q rows shifted by one position break the logit comparison."""
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(12, 16)), rng.normal(size=(12, 16))
    pos = np.arange(0, 120, 10)
    s = 0.25 * q @ k.T
    w = np.where(pos[None, :] <= pos[:, None], np.exp(s), 0.0)
    w /= w.sum(axis=1, keepdims=True)
    ok, _, n = gpu_capture.logit_error(q, pos, k, pos, 0.25, w, None)
    bad, _, _ = gpu_capture.logit_error(np.roll(q, 1, axis=0), pos, k, pos, 0.25, w, None)
    assert ok < 1e-9 and n == 78 and bad > 0.1


def test_accumulate_bench_smoke_checks_both_paths(tmp_path: Path) -> None:
    """bench/gpu_accumulate.py on the CPU (--tiny): both accumulation paths run on a real head layout and their
    sums stay within float32's bound of one bucket against float64 (the error columns the GPU run reports)."""
    import gpu_accumulate

    rc = gpu_accumulate.main(["--tiny", "--shapes", "llama-3.2-1b", "--lengths", "1024", "--repeats", "1",
                              "--out", str(tmp_path)])
    assert rc == 0
    (row,) = json.loads((tmp_path / "gpu_accumulate.json").read_text())["results"]
    bound = 32 * math.sqrt(1024 // 16) * 2.0**-24
    assert 0 < row["error"] <= bound and 0 < row["error_widened"] <= bound, row
    assert set(row["error_by_key"]) >= {"q_xx", "q_xt", "k_xx", "p_xx"}


def test_several_documents_give_the_steady_state_and_sum_the_moments_check(tmp_path: Path) -> None:
    """``--docs 3``: ratios against three plain forwards, the time between commits per document and finalize apart;
    the moments check sums its float64 brute force over the three documents' forwards (the stored counts n are
    exactly 3 L only if it does)."""
    rc = gpu_capture.main(["--device", "cpu", "--tiny", "--repeats", "1", "--lengths", "128", "--docs", "3",
                           "--shapes", "llama-3.2-1b", "--out", str(tmp_path), "--name", "docs"])
    (r,) = json.loads((tmp_path / "docs.json").read_text())["results"]
    assert rc == 0 and r["status"] == "ok" and r["docs"] == 3, (r.get("error"), r.get("failures"))
    assert [len(x) for x in r["moments_steps"]["per_doc_s"]] == [2]  # documents 2 and 3, after the first commit
    assert r["moments_doc_ratio"] > 0 and r["moments_finalize_s"] > 0 and r["doc_ratio"] > 0
    assert r["moments_check"] and all(c["ok"] for c in r["moments_check"])
    assert r["wall_ratio"] == pytest.approx(min(r["capture_s"]) / (3 * min(r["plain_s"])))
    assert "3 document(s) of" in (tmp_path / "docs.md").read_text()
