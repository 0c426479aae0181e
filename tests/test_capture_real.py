"""Capture on real trained weights (SPEC 1, 9): SmolLM2-135M and Gemma-3-270M from their GGUF packages,
on SOTU text, at a short window (256 tokens) to stay fast. Outputs are unchanged by the capture and
captured q·k·scaling reproduces the model's own attention logits (eager attention weights).

Its inputs come from ``make setup``: the GGUF packages of requirements-models.txt and the SOTU tarball in
the cache. Only their absence skips (locally; under ``CI=true`` it fails, tests/prereq.py); any error once
they are there fails the test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch
from prereq import missing

from qk_core.capture import capture_model
from qk_core.capture.hook import CaptureSession
from qk_core.capture.store import CaptureReader
from qk_core.config.registry import load_registry
from qk_core.corpus.build import CACHE_DIR, sotu_corpus
from qk_core.io.storage import Storage
from qk_core.models.loading import load_model

pytestmark = pytest.mark.slow
torch.set_num_threads(min(2, torch.get_num_threads()))
WINDOW, BUCKET, N_DOCS = 256, 32, 2


@pytest.fixture(scope="module")
def sotu() -> Any:
    params = load_registry().corpus("sotu-demo").params
    # the file qk_core.corpus.fetch_pinned keeps (`make setup` fetches it; the tests run offline)
    cached = CACHE_DIR / f"{params['sha256'][:16]}-{params['url'].rsplit('/', 1)[-1]}"
    if not cached.exists():
        missing(f"the SOTU demo corpus ({cached.name} in {CACHE_DIR})", "make setup")
    return sotu_corpus(params).head(N_DOCS)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def captured(request: pytest.FixtureRequest, sotu: Any, tmp_path_factory: pytest.TempPathFactory) -> dict:
    reg = load_registry()
    package = reg.model(request.param).source.package
    if importlib.util.find_spec(package or "") is None:
        missing(f"the demo model package {package!r}", "make setup; requirements-models.txt")
    entry = dataclasses.replace(reg.model(request.param), window=WINDOW, bucket=BUCKET)
    loaded = load_model(entry, "cpu")
    storage = Storage(tmp_path_factory.mktemp("real") / "storage")
    result = capture_model(entry, sotu, storage, loaded=loaded)
    return {"key": request.param, "entry": entry, "loaded": loaded, "result": result,
            "reader": CaptureReader(storage, result.prefix), "sotu": sotu}


def doc_ids(captured: dict, i: int) -> torch.Tensor:
    text = captured["sotu"]["text"].iloc[i]
    return torch.tensor([captured["loaded"].tokenizer(text, truncation=True, max_length=WINDOW)["input_ids"]])


def test_real_model_layout_and_scaling(captured: dict) -> None:
    reader, loaded = captured["reader"], captured["loaded"]
    layers = reader.manifest["layers"]
    assert loaded.identity["attn_implementation"] == "sdpa"
    assert reader.manifest["model"]["source"]["kind"] == "gguf_package"
    assert reader.manifest["dtype"] == "float32"
    if captured["key"] == "smollm2-135m":
        assert len(layers) == 30 and len(reader.manifest["heads"]) == 270  # 30 x 9 < 300: all heads
        assert {(li["n_q"], li["n_kv"], li["head_dim"]) for li in layers} == {(9, 3, 64)}
        assert all(li["scaling"] == pytest.approx(64 ** -0.5) for li in layers)
        assert {li["rope_theta"] for li in layers} == {1e5}
    else:
        cfg = loaded.backbone.config
        full = [li["layer"] for li in layers if li["attention_type"] == "full"]
        assert full == [5, 11, 17]
        assert sorted({h["layer"] for h in reader.manifest["heads"]}) == full  # sliding layers excluded
        assert {li["sliding_window"] for li in layers if li["attention_type"] == "sliding"} == {512}
        assert all(li["scaling"] == pytest.approx(cfg.query_pre_attn_scalar ** -0.5) for li in layers)
        assert all(li["qk_norm"] for li in layers)
        assert {li["rope_theta"] for li in layers if li["layer"] in full} == {1e6}
        assert {li["rope_theta"] for li in layers if li["layer"] not in full} == {1e4}
        assert {h["kv_head"] for h in reader.manifest["heads"]} == {0}


def test_real_outputs_identical_with_and_without_capture(captured: dict) -> None:
    backbone = captured["loaded"].backbone
    ids = doc_ids(captured, 0)[:, :128]
    plan = {h["layer"]: ([h["q_head"]], [h["kv_head"]]) for h in captured["reader"].manifest["heads"][:6]}
    with torch.inference_mode():
        plain = backbone(input_ids=ids, use_cache=False).last_hidden_state
        with CaptureSession(backbone, plan) as session:
            session.set_positions(np.arange(0, 128, 9))
            with_capture = backbone(input_ids=ids, use_cache=False).last_hidden_state
            assert session.collect()
    assert torch.equal(plain, with_capture)


def test_real_captured_qk_reproduces_attention_logits(captured: dict) -> None:
    reader, loaded = captured["reader"], captured["loaded"]
    layers = {li["layer"]: li for li in reader.manifest["layers"]}
    weights = {int(eid): tm.eager_attention_weights(loaded.backbone, doc_ids(captured, i))
               for i, eid in enumerate(captured["sotu"]["example_id"])}
    worst, compared, total = 0.0, 0, 0
    for h in reader.manifest["heads"]:
        head = reader.read_head(h["layer"], h["q_head"])
        for eid, w in weights.items():
            qm, km = head.q_doc == eid, head.k_doc == eid
            err, n, _ = tm.logit_mismatch(head.q[qm], head.q_pos[qm], head.k[km], head.k_pos[km],
                                          layers[h["layer"]]["scaling"], w[h["layer"]][h["q_head"]],
                                          min_weight=1e-30)
            worst, compared = max(worst, err), compared + n
            total += int((head.k_pos[km][None, :] <= head.q_pos[qm][:, None]).sum())
    assert worst < 2e-3, worst
    assert compared > 0.95 * total


# SmolLM2 only: 43 s (Gemma 3, 93 s, takes the same path; its captures above load through the cache, and a load
# missing a tensor is an error there)
@pytest.mark.parametrize("key", ["smollm2-135m"])
def test_cached_gguf_weights_equal_the_gguf_file(key: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dequantised weights kept as safetensors (qk_core.models.loading.gguf_weights) are the GGUF file's own:
    the backbone and the model with its LM head equal, tensor for tensor, what transformers loads from the GGUF
    file; a cached file of the wrong size is converted again. The conversion's parts (convert_gguf) are
    independent: the tokenizer alone writes only the tokenizer, which encodes as the GGUF file's."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from qk_core.models import loading

    entry = load_registry().model(key)
    if importlib.util.find_spec(entry.source.package or "") is None:
        missing(f"the demo model package {entry.source.package!r}", "make setup; requirements-models.txt")
    monkeypatch.setattr(loading, "CACHE_DIR", tmp_path)  # a fresh conversion, not the shared cache's
    gguf = loading.resolve_gguf(entry.source)
    # make setup converts the parts side by side (qk_core.setup_data): the tokenizer alone converts nothing else,
    # and the cached one encodes as the GGUF file's own
    with pytest.raises(ValueError, match="no GGUF conversion part"):
        loading.convert_gguf(entry, ["config"])
    folder = loading.convert_gguf(entry, ["tokenizer"])
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokenizer"]
    text = "Fellow-citizens of the Senate and House of Representatives: def f(x): return x ** 2"
    direct_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cached_tok = loading.load_tokenizer(entry.key, entry.tokenizer)
    assert cached_tok(text)["input_ids"] == direct_tok(text)["input_ids"]
    assert loading.convert_gguf(entry, ["weights"]) == folder
    assert sorted(p.name for p in folder.parent.iterdir()) == ["config", "tokenizer", "weights"]
    config = loading.load_config(entry)
    for auto, with_head in ((AutoModel, False), (AutoModelForCausalLM, True)):
        direct = auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.float32)
        cached = load_model(entry, "cpu", config=config, tokenizer=object(), with_head=with_head).model
        a, b = direct.state_dict(), cached.state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    folder = loading.gguf_cache_dir(entry.source) / "weights"
    assert folder.parent.parent == tmp_path / "gguf-converted"
    with open(folder / loading.SAFETENSORS_FILE, "r+b") as fh:  # a damaged (truncated) conversion
        fh.truncate(1000)
    assert loading.gguf_weights(entry.key, entry.source, AutoModelForCausalLM) == folder
    assert (folder / ".complete").read_text() == str((folder / loading.SAFETENSORS_FILE).stat().st_size)
    assert (folder / loading.SAFETENSORS_FILE).stat().st_size > 10**8
