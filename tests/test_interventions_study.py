"""The whole SPEC 11 study on a tiny model: capture, rotation, plasticity, then probe x conditions,
summaries, contrast, debias re-measurement and verdicts, with the real code at every step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.store import CaptureReader
from qk_core.config.options import InterventionOptions, PlasticityOptions
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.geometry.driver import run_rotation
from qk_core.geometry.heads import iter_capture_heads
from qk_core.interventions.study import run_study
from qk_core.io.storage import Storage
from qk_core.models.loading import load_model
from qk_core.plasticity import analyse_model
from qk_core.plots.interventions import fig_accuracy, fig_contrast, fig_debias_profile

pytestmark = pytest.mark.slow  # the whole SPEC 11 study per family (about a minute)

torch.set_num_threads(min(2, torch.get_num_threads()))


def prose(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "state", "of", "our", "union", "is", "sound", "and", "we", "shall", "prosper"]
    return " ".join(" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(n))


@pytest.mark.parametrize("fam", ["gemma3"])
def test_study_end_to_end(fam: str, tmp_path: Path) -> None:
    corpus_file = tm.write_corpus_jsonl(tmp_path / "c.jsonl", [prose(80, s) for s in range(3)])
    tm.build_tiny_model(fam, tmp_path / fam)
    model = {"family": fam, "source": {"local": str(tmp_path / fam)}, "window": 256, "bucket": 32,
             "capture": {"per_bucket": 4}}
    entry = load_registry(tm.write_registry(tmp_path / "r.toml", {"t": model}, corpus_file)).model("t")
    docs = local_corpus({"path": str(corpus_file)})
    storage = Storage(tmp_path / "storage")
    loaded = load_model(entry, "cpu", with_head=True)
    assert type(loaded.model).__name__.endswith("ForCausalLM")
    cap = capture_model(entry, docs, storage, loaded=loaded)
    reader = CaptureReader(storage, cap.prefix)
    rot_heads = run_rotation("t", iter_capture_heads(storage, cap.heads))[0]
    popts = PlasticityOptions(bootstrap=40, pairs_per_bucket=64)
    pl = analyse_model("t", [(int(r.layer), int(r.q_head)) for r in cap.heads.itertuples()], reader.read_head,
                       reader.doc_tokens()["example_id"].to_numpy(), 256, 32, popts)
    opts = InterventionOptions(window=240, depths=(0.1, 0.8), n_docs=2, k_fractions=(0.25,), random_sets=1,
                               bootstrap=50)
    res = run_study(entry, docs, storage, cap.prefix, pl.heads, rot_heads, opts, popts, loaded)

    n_heads = len(cap.heads)
    k = max(1, round(0.25 * n_heads))
    n_conds = 1 + 2 * (2 + 1)  # baseline + (ablate, debias) x (lowest, highest, 1 random)
    assert len(res.trials) == 2 * 2 * n_conds
    assert set(res.trials["k"]) == {0, k}
    assert (res.trials["n_tokens"] <= 240).all()
    low = res.head_sets[res.head_sets["head_set"] == "lowest"]
    assert len(low) == k and low["ap_last20"].max() <= pl.heads["ap_last20"].dropna().sort_values().iloc[k - 1]
    s = res.summary
    assert set(s["head_set"]) == {"baseline", "lowest", "highest", "random"}
    assert ((s["accuracy_lo"] <= s["accuracy"]) & (s["accuracy"] <= s["accuracy_hi"])).all()
    assert len(res.contrast) == 2 * 2 * 2  # (ablate, debias) x depths x (lowest, highest)
    # recaptured on the documents the rotation was fitted on: the debiased heads' bias is gone
    m = res.remeasured.set_index(["condition", "metric"])["value"]
    assert abs(m[("debias", "bias_strength")]) < 1e-4 * abs(m[("baseline", "bias_strength")])
    assert set(res.profiles["condition"]) == {"baseline", "debias"}
    assert len(res.verdicts) >= 2 and set(res.verdicts["verdict"]) <= {"supported", "contradicted",
                                                                        "inconclusive", "not testable"}
    for fig in (fig_accuracy(s, "t", res.options), fig_contrast(res.contrast, "t", res.options),
                fig_debias_profile(res.profiles, res.remeasured, "t")):
        assert fig.axes
