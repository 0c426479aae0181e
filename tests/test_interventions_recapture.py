"""Recapture under `debias` (SPEC 11.2-11.3): the real capture and rotation code measure bias_strength ~0.

For one head of a full-attention layer of each tiny family: capture, fit the rotation (SPEC 3), recapture
the head with its key drift removed, and fit the rotation again on the recapture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.store import CaptureError, CaptureReader
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.geometry.rotation import analyse_rotation
from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionSession
from qk_core.io.storage import Storage
from qk_core.models.loading import load_model

pytestmark = pytest.mark.slow  # capture, rotation and recapture per family (15 s)

torch.set_num_threads(min(2, torch.get_num_threads()))
LAYER = {"llama": 1, "mistral": 1, "ministral3": 1, "qwen3": 1, "smollm3": 1, "gemma3": 2, "mllama": 2}


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recap")
    return tm.write_corpus_jsonl(root / "corpus.jsonl", tm.sample_texts(3, 300, seed=2))


def rotation(reader: CaptureReader, layer: int, head: int) -> Any:
    h = reader.read_head(layer, head)
    return analyse_rotation(h.q, h.q_pos, h.q_doc, h.k, h.k_pos, h.k_doc, window=h.window), h


@pytest.mark.parametrize("fam", tm.FAMILIES)
def test_recapture_under_debias_has_zero_bias(fam: str, tmp_path: Path, corpus_file: Path) -> None:
    tm.build_tiny_model(fam, tmp_path / fam)
    model = {"family": fam, "source": {"local": str(tmp_path / fam)}, "window": 256, "bucket": 32,
             "capture": {"per_bucket": 4}}
    entry = load_registry(tm.write_registry(tmp_path / "r.toml", {f"t-{fam}": model}, corpus_file)).model(f"t-{fam}")
    loaded = load_model(entry, "cpu")
    storage = Storage(tmp_path / "storage")
    docs = local_corpus({"path": str(corpus_file)})
    layer, head = LAYER[fam], 1
    base = capture_model(entry, docs, storage, loaded=loaded)
    before, hd = rotation(CaptureReader(storage, base.prefix), layer, head)
    assert abs(before.bias_strength) > 1e-4, f"{fam}: the tiny head has no bias to remove"
    iv = Intervention("debias", ((layer, head),),
                      axes={(layer, head): DebiasAxis(before.a, before.alpha_k, float(hd.k_pos.mean()))})
    re = capture_model(entry, docs, storage, loaded=loaded, intervention=InterventionSession(loaded.backbone, iv),
                       heads=[(layer, head), (layer, 0)])
    assert re.prefix != base.prefix and not re.already_complete
    reader = CaptureReader(storage, re.prefix)
    plan = {(h["layer"], h["q_head"]): h["kv_head"] for h in re.manifest["heads"]}
    assert plan == {(layer, 0): 0, (layer, 1): 1}  # one key head per query head in the debiased layer
    after, hd2 = rotation(reader, layer, head)
    np.testing.assert_array_equal(hd2.q, hd.q)  # the layer's input is untouched
    assert abs(after.alpha_k) < 1e-5 * abs(before.alpha_k) + 1e-7, f"{fam}: alpha_K {before.alpha_k} -> {after.alpha_k}"
    assert abs(after.bias_strength) < 1e-5 * abs(before.bias_strength) + 1e-7
    # the other head of the group keeps its keys and its bias
    other, _ = rotation(reader, layer, 0)
    other0, _ = rotation(CaptureReader(storage, base.prefix), layer, 0)
    assert other.bias_strength == pytest.approx(other0.bias_strength, rel=1e-4)
    # a capture cannot run under per-prompt mean ablation
    with pytest.raises(CaptureError, match="mean ablation"):
        mean = Intervention("ablate", ((layer, head),), "mean", means={(layer, head): np.zeros(16)})
        capture_model(entry, docs, storage, loaded=loaded, heads=[(layer, head)],
                      intervention=InterventionSession(loaded.backbone, mean))
