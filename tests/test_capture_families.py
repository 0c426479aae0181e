"""Capture correctness on tiny random models of every registry family (SPEC 1.1-1.4, 1.7-1.9).

Ground truth is the model itself: its outputs without the capture function, and its own attention
weights from the eager backend (whose logs are the attention logits up to a per-row constant).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch
import transformers as tf

from qk_core.capture import capture_model
from qk_core.capture.hook import CaptureSession
from qk_core.capture.moments import MomentPlan
from qk_core.capture.store import CaptureError, CaptureReader
from qk_core.config.registry import ModelEntry, load_registry
from qk_core.corpus.build import local_corpus
from qk_core.io.storage import Storage
from qk_core.models.loading import load_model, text_backbone

torch.set_num_threads(min(2, torch.get_num_threads()))

WINDOW, BUCKET, PER_BUCKET = 256, 32, 3
SHORT_CHARS = 200  # -> 201 tokens with BOS: shorter than the window


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny family saved once, plus a 2-document corpus (one short, one truncated)."""
    root = tmp_path_factory.mktemp("zoo")
    for fam in tm.FAMILIES:
        tm.build_tiny_model(fam, root / fam)
    texts = tm.sample_texts(2, 400, seed=1)
    tm.write_corpus_jsonl(root / "corpus.jsonl", [texts[0][:SHORT_CHARS], texts[1]], ids=[11, 12])
    return root


def entry(zoo: Path, tmp: Path, fam: str, **fields: Any) -> ModelEntry:
    tmp.mkdir(parents=True, exist_ok=True)
    capture = {"per_bucket": PER_BUCKET, **fields.pop("capture", {})}
    model = {"family": fam, "source": {"local": str(zoo / fam)}, "window": WINDOW, "bucket": BUCKET,
             "capture": capture, **fields}
    reg = load_registry(tm.write_registry(tmp / "registry.toml", {f"t-{fam}": model}, zoo / "corpus.jsonl"))
    return reg.model(f"t-{fam}")


def corpus(zoo: Path) -> Any:
    return local_corpus({"path": str(zoo / "corpus.jsonl")})


def run_and_read(zoo: Path, tmp: Path, fam: str, **fields: Any) -> tuple[Any, CaptureReader, Any]:
    e = entry(zoo, tmp, fam, **fields)
    loaded = load_model(e, "cpu")
    storage = Storage(tmp / "storage")
    result = capture_model(e, corpus(zoo), storage, loaded=loaded)
    return result, CaptureReader(storage, result.prefix), loaded


def reference_weights(loaded: Any, zoo: Path) -> dict[int, dict[int, torch.Tensor]]:
    """Eager attention weights per document id and layer."""
    out = {}
    for eid, text in zip(corpus(zoo)["example_id"], corpus(zoo)["text"], strict=True):
        ids = loaded.tokenizer(text, truncation=True, max_length=WINDOW)["input_ids"]
        out[int(eid)] = tm.eager_attention_weights(loaded.backbone, torch.tensor([ids]))
    return out


def with_head_class(fam: str, path: Path) -> Any:
    if fam == "ministral3":
        return tf.Mistral3ForConditionalGeneration.from_pretrained(path)
    if fam == "mllama":
        return tf.MllamaForConditionalGeneration.from_pretrained(path)
    return tf.AutoModelForCausalLM.from_pretrained(path)


# ---- (a) outputs unchanged ---------------------------------------------------------------------
@pytest.mark.parametrize("fam", tm.FAMILIES)
def test_logits_identical_with_and_without_capture(zoo: Path, fam: str) -> None:
    model = with_head_class(fam, zoo / fam).eval()
    backbone = text_backbone(model.model)
    n_q, n_kv = backbone.config.num_attention_heads, backbone.config.num_key_value_heads
    layers = sorted(tm.attention_modules(backbone))
    cross = set(getattr(backbone.config, "cross_attention_layers", None) or [])
    plan = {layer: (list(range(n_q)), list(range(n_kv))) for layer in layers if layer not in cross}
    ids = torch.tensor([list(range(1, 120))])
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits
        with CaptureSession(backbone, plan) as session:
            session.set_positions(np.array([0, 5, 77, 118]))
            captured = model(input_ids=ids, use_cache=False).logits
            rows = session.collect()
        after = model(input_ids=ids, use_cache=False).logits
    assert backbone.config._attn_implementation == "sdpa"  # restored
    assert torch.equal(plain, captured)
    assert torch.equal(plain, after)
    assert len(rows) == len(plan) * (n_q + n_kv)
    assert all(r.vectors.shape == (4, backbone.config.head_dim) for r in rows)


def test_one_session_reuses_its_row_buffer_across_documents(zoo: Path) -> None:
    """A session gathers each forward's rows into one reused buffer: rows equal a fresh session's over documents
    of other lengths and position counts, a ``copy`` survives the next forward, the views do not."""
    backbone = text_backbone(tf.AutoModelForCausalLM.from_pretrained(zoo / "llama").eval().model)
    n_q, n_kv = backbone.config.num_attention_heads, backbone.config.num_key_value_heads
    plan = {layer: ([n_q - 1, 0], list(range(n_kv))) for layer in sorted(tm.attention_modules(backbone))}
    docs = [(119, np.arange(3, 119, 7)), (40, np.array([1, 2, 39])), (119, np.array([0, 5, 77, 118]))]

    def rows_of(session: CaptureSession, n: int, pos: np.ndarray, copy: bool = False) -> dict:
        session.set_positions(pos)
        backbone(input_ids=torch.tensor([list(range(1, n + 1))]), use_cache=False)
        return {(r.kind, r.layer, r.head): (r.positions, r.vectors) for r in session.collect(copy=copy)}

    with torch.inference_mode():
        fresh = []
        for n, pos in docs:
            with CaptureSession(backbone, plan) as alone:
                fresh.append({k: (p, v.copy()) for k, (p, v) in rows_of(alone, n, pos).items()})
        with CaptureSession(backbone, plan) as session:
            kept = rows_of(session, *docs[0], copy=True)
            views = rows_of(session, *docs[0])
            buffer = session._rows_flat.data_ptr()
            got = [kept] + [rows_of(session, n, pos, copy=True) for n, pos in docs[1:]]
            assert session._rows_flat.data_ptr() == buffer  # the first document's buffer held every later one
    for want, have in zip(fresh, got, strict=True):
        assert want.keys() == have.keys()
        for key, (p, v) in want.items():
            assert np.array_equal(have[key][0], p) and np.array_equal(have[key][1], v) and v.shape == (len(p), 16)
    first = ("q", 0, n_q - 1)
    assert not np.array_equal(views[first][1][:1], fresh[0][first][1][:1])  # overwritten by the next forward


@pytest.mark.parametrize("fam", tm.FAMILIES)
def test_capture_forward_stops_after_the_last_layer_it_reads(zoo: Path, fam: str) -> None:
    """:meth:`CaptureSession.forward` runs the backbone up to the last planned layer's read and no further (that
    layer's attention, the later layers and the final norm never run), and records exactly what a whole forward
    under the same session records: the rows, and the SPEC 12.1 moments."""
    backbone = text_backbone(with_head_class(fam, zoo / fam).eval().model)
    n_q, n_kv = backbone.config.num_attention_heads, backbone.config.num_key_value_heads
    modules = tm.attention_modules(backbone)
    cross = set(getattr(backbone.config, "cross_attention_layers", None) or [])
    layers = [layer for layer in sorted(modules) if layer not in cross]
    ids = torch.tensor([list(range(1, 120))])
    kv_index = [h * n_kv // n_q for h in range(n_q)]
    ran: list[str] = []
    hooks = [m.register_forward_hook(lambda mod, *_, name=name: ran.append(name))
             for name, m in backbone.named_modules() if m in set(modules.values()) or name in ("norm", "final_norm")]

    def captured(plan_layers: list[int], whole: bool) -> tuple[list[str], dict, dict]:
        plan = {layer: ([n_q - 1, 0], list(range(n_kv))) for layer in plan_layers}
        moments = MomentPlan({plan_layers[-1]: (list(range(n_q)), list(range(n_kv)), kv_index)}, 32, 4, "float64",
                             "gaussian")
        ran.clear()
        with torch.inference_mode(), CaptureSession(backbone, plan, moments) as session:
            session.set_positions(np.array([0, 5, 77, 118]))
            if whole:
                backbone(input_ids=ids, use_cache=False)
            else:
                session.forward(lambda: backbone(input_ids=ids, use_cache=False))
            rows = {(r.kind, r.layer, r.head): r.vectors.copy() for r in session.collect()}
            sums = session.collect_moments(copy=True)
        return list(ran), rows, sums

    try:
        for plan_layers in (layers, layers[:1]):
            whole_ran, whole_rows, whole_sums = captured(plan_layers, True)
            stop_ran, stop_rows, stop_sums = captured(plan_layers, False)
            last = f"layers.{plan_layers[-1]}."
            assert any(name.endswith("norm") for name in whole_ran)
            # the attention modules that finished: those before the last planned layer's, nothing after it
            assert len(stop_ran) == sum(1 for name in whole_ran if not name.endswith("norm")
                                        and int(name.split("layers.")[1].split(".")[0]) < plan_layers[-1])
            assert not any(last in name or name.endswith("norm") for name in stop_ran)
            assert stop_rows.keys() == whole_rows.keys() and stop_sums.keys() == whole_sums.keys()
            assert all(np.array_equal(stop_rows[k], v) for k, v in whole_rows.items())
            assert all(np.array_equal(stop_sums[la][k], v) for la, s in whole_sums.items() for k, v in s.items())
    finally:
        for h in hooks:
            h.remove()


# ---- (b) captured q·k reproduces the model's own logits -----------------------------------------
@pytest.mark.parametrize("fam", tm.FAMILIES)
def test_captured_qk_times_scaling_equals_model_logits(zoo: Path, tmp_path: Path, fam: str) -> None:
    include_sliding = fam == "gemma3"  # check sliding layers too (window 8 < sequence)
    result, reader, loaded = run_and_read(zoo, tmp_path, fam, capture={"include_sliding": include_sliding})
    weights = reference_weights(loaded, zoo)
    layers = {li["layer"]: li for li in reader.manifest["layers"]}
    compared = 0
    for h in reader.manifest["heads"]:
        head = reader.read_head(h["layer"], h["q_head"])
        li = layers[h["layer"]]
        for doc in (11, 12):
            qm, km = head.q_doc == doc, head.k_doc == doc
            err, n, w = tm.logit_mismatch(head.q[qm], head.q_pos[qm], head.k[km], head.k_pos[km], li["scaling"],
                                          weights[doc][h["layer"]][h["q_head"]], window=li["sliding_window"])
            assert err < 2e-4, (fam, h, doc, err)
            compared += n
            if li["sliding_window"] is not None:  # keys beyond the window carry no weight
                qp, kp = head.q_pos[qm][:, None], head.k_pos[km][None, :]
                assert np.all(w[(kp <= qp) & (qp - kp >= li["sliding_window"])] == 0)
    assert compared > 100
    assert result.heads["capture_prefix"].iloc[0] == result.prefix


def test_wrong_kv_head_or_positions_are_detected(zoo: Path, tmp_path: Path) -> None:
    """Negative control: the logit check fails for the other KV head and for shifted positions."""
    _, reader, loaded = run_and_read(zoo, tmp_path, "llama")
    weights = reference_weights(loaded, zoo)
    head = reader.read_head(1, 3)
    assert head.kv_head == 1  # floor(3 * 2 / 4)
    other = reader._read("k", 1, 0)
    qm, km = head.q_doc == 12, head.k_doc == 12
    w = weights[12][1][3]
    scaling = reader.manifest["layers"][1]["scaling"]
    ok, _, _ = tm.logit_mismatch(head.q[qm], head.q_pos[qm], head.k[km], head.k_pos[km], scaling, w)
    wrong_kv, _, _ = tm.logit_mismatch(head.q[qm], head.q_pos[qm], other[0][other[2] == 12], head.k_pos[km],
                                       scaling, w)
    shifted, _, _ = tm.logit_mismatch(np.roll(head.q[qm], 1, axis=0), head.q_pos[qm], head.k[km],
                                      head.k_pos[km], scaling, w)
    assert ok < 2e-4 and wrong_kv > 1e-2 and shifted > 1e-2


# ---- (c) family specifics -----------------------------------------------------------------------
def test_gqa_mapping_in_manifest(zoo: Path, tmp_path: Path) -> None:
    result, reader, _ = run_and_read(zoo, tmp_path, "qwen3")
    for h in reader.manifest["heads"]:
        assert h["kv_head"] == h["q_head"] * 2 // 4
    # K rows are stored once per KV head, and every sampled q head finds its KV head's rows
    assert (result.heads["n_k_rows"] == result.heads["n_q_rows"]).all()
    assert len(reader.storage.ls(f"{result.prefix}/heads/k")) == 4 * 2


def test_nope_layers_yield_raw_projections(zoo: Path, tmp_path: Path) -> None:
    """SmolLM3: every 4th layer has no RoPE; its captured K equals k_proj of the layer input exactly."""
    result, reader, loaded = run_and_read(zoo, tmp_path, "smollm3")
    rope = {li["layer"]: li["rope_applied"] for li in reader.manifest["layers"]}
    assert [layer for layer, r in rope.items() if not r] == [3, 7]
    assert result.heads.groupby("layer")["rope_applied"].first().to_dict() == rope
    text = corpus(zoo)["text"][1]
    ids = torch.tensor([loaded.tokenizer(text, truncation=True, max_length=WINDOW)["input_ids"]])
    with torch.inference_mode():
        hidden = loaded.backbone(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    for layer in (2, 3):
        dec = loaded.backbone.layers[layer]
        with torch.inference_mode():
            raw = dec.self_attn.k_proj(dec.input_layernorm(hidden[layer]))[0].view(ids.shape[1], 2, 16)
        head = reader.read_head(layer, 0)
        km = head.k_doc == 12
        expect = raw[head.k_pos[km], head.kv_head].numpy()
        got = head.k[km]
        # RoPE is a rotation of coordinate pairs (j, j + d/2): pair norms are kept either way
        pair = lambda x: x[:, :8] ** 2 + x[:, 8:] ** 2  # noqa: E731
        np.testing.assert_allclose(pair(got), pair(expect), rtol=1e-4, atol=1e-6)
        if layer == 3:
            np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
        else:
            assert np.abs(got[1:] - expect[1:]).max() > 1e-2


@pytest.mark.parametrize("fam", ["qwen3", "gemma3"])
def test_qk_norm_is_inside_the_captured_vectors(zoo: Path, tmp_path: Path, fam: str) -> None:
    """Unit-weight RMS q/k norm then RoPE (a rotation): every captured row has norm sqrt(d)."""
    _result, reader, _ = run_and_read(zoo, tmp_path, fam)
    assert all(li["qk_norm"] for li in reader.manifest["layers"])
    for h in reader.manifest["heads"]:
        head = reader.read_head(h["layer"], h["q_head"])
        np.testing.assert_allclose(np.linalg.norm(head.q, axis=1), 4.0, rtol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(head.k, axis=1), 4.0, rtol=1e-4)


def test_yarn_override_reaches_the_rope(zoo: Path, tmp_path: Path) -> None:
    """Qwen3 with the registry's YaRN override: recorded, applied (norm scaled by 0.1 ln s + 1), exact logits."""
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    result, reader, loaded = run_and_read(zoo, tmp_path, "qwen3", config_overrides=yarn)
    li = reader.manifest["layers"][0]
    assert (li["rope_type"], li["rope_factor"], li["rope_original_context"], li["rope_theta"]) == \
        ("yarn", 4.0, 32, 1e6)
    assert reader.manifest["model"]["config_overrides"] == yarn
    mscale = 0.1 * np.log(4.0) + 1.0
    head = reader.read_head(0, 0)
    np.testing.assert_allclose(np.linalg.norm(head.q, axis=1), 4.0 * mscale, rtol=1e-4)
    weights = reference_weights(loaded, zoo)
    km, qm = head.k_doc == 12, head.q_doc == 12
    err, n, _ = tm.logit_mismatch(head.q[qm], head.q_pos[qm], head.k[km], head.k_pos[km], li["scaling"],
                                  weights[12][0][0])
    assert err < 2e-4 and n > 100
    plain, _, _ = run_and_read(zoo, tmp_path / "plain", "qwen3")
    assert plain.fingerprint != result.fingerprint


def test_sliding_layers_excluded_by_default_window_recorded(zoo: Path, tmp_path: Path) -> None:
    result, reader, _ = run_and_read(zoo, tmp_path, "gemma3")
    assert sorted(set(result.heads["layer"])) == [2, 5]
    assert set(result.heads["attention_type"]) == {"full"}
    types = {li["layer"]: (li["attention_type"], li["sliding_window"]) for li in reader.manifest["layers"]}
    assert types[0] == ("sliding", 8) and types[2] == ("full", None)
    assert all(li["scaling"] == pytest.approx(24 ** -0.5) for li in reader.manifest["layers"])
    with_sliding, _, _ = run_and_read(zoo, tmp_path / "s", "gemma3", capture={"include_sliding": True})
    assert sorted(set(with_sliding.heads["layer"])) == list(range(6))
    assert set(with_sliding.heads.loc[with_sliding.heads["attention_type"] == "sliding", "sliding_window"]) == {8}


def test_cross_attention_layers_never_sampled(zoo: Path, tmp_path: Path) -> None:
    result, reader, _ = run_and_read(zoo, tmp_path, "mllama", capture={"include_sliding": True})
    assert sorted(set(result.heads["layer"])) == [0, 2, 4]
    types = {li["layer"]: li["attention_type"] for li in reader.manifest["layers"]}
    assert types[1] == types[3] == "cross"
    e = entry(zoo, tmp_path / "x", "mllama", capture={"layers": [0, 1]})
    storage = Storage(tmp_path / "x" / "storage")
    with pytest.raises(CaptureError, match="layer 1 is a cross-attention layer"):
        capture_model(e, corpus(zoo), storage, device="cpu")
    assert storage.ls("", recursive=True) == []


def test_ministral3_text_model_with_position_temperature(zoo: Path, tmp_path: Path) -> None:
    _result, reader, _ = run_and_read(zoo, tmp_path, "ministral3")
    assert reader.manifest["model"]["model_class"] == "Mistral3Model"
    assert reader.manifest["model"]["backbone_class"] == "Ministral3Model"
    qs = reader.manifest["layers"][0]["query_scaling"]
    assert qs["beta"] == 0.1 and qs["original_max_position_embeddings"] == 32


# ---- (d) determinism; short documents ------------------------------------------------------------
def test_capture_is_deterministic_for_a_seed(zoo: Path, tmp_path: Path) -> None:
    a, ra, _ = run_and_read(zoo, tmp_path / "a", "llama", capture={"heads": 5})
    b, rb, _ = run_and_read(zoo, tmp_path / "b", "llama", capture={"heads": 5})
    c, rc, _ = run_and_read(zoo, tmp_path / "c", "llama", capture={"heads": 5, "seed": 1})
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert ra.manifest["heads"] == rb.manifest["heads"] != rc.manifest["heads"]
    assert len(ra.manifest["heads"]) == 5
    for h in ra.manifest["heads"]:
        x, y = ra.read_head(h["layer"], h["q_head"]), rb.read_head(h["layer"], h["q_head"])
        assert np.array_equal(x.q, y.q) and np.array_equal(x.k_pos, y.k_pos) and np.array_equal(x.q_doc, y.q_doc)
    hc = rc.manifest["heads"][0]
    assert not np.array_equal(rc.read_head(hc["layer"], hc["q_head"]).q_pos, x.q_pos)


def test_short_document_captured_over_its_own_length(zoo: Path, tmp_path: Path) -> None:
    result, reader, _ = run_and_read(zoo, tmp_path, "mistral")
    tokens = dict(zip(result.doc_tokens["example_id"], result.doc_tokens["n_tokens"], strict=True))
    assert tokens == {11: SHORT_CHARS + 1, 12: WINDOW}
    head = reader.read_head(0, 0)
    short_pos = head.q_pos[head.q_doc == 11]
    assert short_pos.max() < SHORT_CHARS + 1
    assert len(short_pos) == 7 * PER_BUCKET  # ceil(201 / 32) buckets
    assert len(head.q_pos[head.q_doc == 12]) == (WINDOW // BUCKET) * PER_BUCKET
    assert np.array_equal(np.unique(short_pos // BUCKET), np.arange(7))


def test_bernoulli_sampler_end_to_end(zoo: Path, tmp_path: Path) -> None:
    """Thesis protocol: positions kept with probability rate/B, drawn per (document, layer, kind)."""
    _, reader, loaded = run_and_read(zoo, tmp_path, "llama",
                                     capture={"position_sampler": "bernoulli", "bernoulli_rate": 8.0})
    assert reader.manifest["sampler"]["position_sampler"] == "bernoulli"
    weights = reference_weights(loaded, zoo)
    a, b = reader.read_head(0, 0), reader.read_head(1, 0)
    assert not np.array_equal(a.q_pos, a.k_pos) and not np.array_equal(a.q_pos, b.q_pos)
    n_rows = len(a.q_pos)
    assert abs(n_rows - (SHORT_CHARS + 1 + WINDOW) * 8 / BUCKET) < 4 * np.sqrt(n_rows)
    qm, km = a.q_doc == 12, a.k_doc == 12
    err, n, _ = tm.logit_mismatch(a.q[qm], a.q_pos[qm], a.k[km], a.k_pos[km], reader.manifest["layers"][0]["scaling"],
                                  weights[12][0][0])
    assert err < 2e-4 and n > 100
