"""Context-extension variants (SPEC 13.1): registry expansion and its errors, and tiny random models of two
families (llama, qwen3) whose captured vectors must change exactly as each RoPE override says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.hook import CaptureSession
from qk_core.capture.layers import describe_layers, variant_problems
from qk_core.capture.store import CaptureReader
from qk_core.config.registry import RegistryError, load_registry
from qk_core.corpus.build import local_corpus
from qk_core.io.storage import Storage
from qk_core.models.loading import ModelSourceError, load_config, load_model

torch.set_num_threads(min(2, torch.get_num_threads()))

C, W = 64, 192  # trained context and variant window of the tiny models (tokens)
FAMILIES = ("llama", "qwen3")
PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def registry_text(corpus: Path, models: str, variants: str) -> str:
    return (f'[corpora.tiny]\nkind = "local_file"\npath = "{corpus}"\n\n{models}\n{variants}\n')


def write(tmp: Path, text: str) -> Path:
    path = tmp / "registry.toml"
    path.write_text(text)
    return path


BASE = '[models.base]\nfamily = "llama"\nsource = { local = "m" }\nwindow = 128\nbucket = 8\ncorpus = "tiny"\n' \
       'groups = ["demo"]\ncapture = { per_bucket = 3 }\n' \
       'config_overrides = { rope_scaling = { rope_type = "yarn", factor = 4.0, ' \
       'original_max_position_embeddings = 32 }, attention_dropout = 0.0 }\n'


# ---- registry expansion ------------------------------------------------------------------------
def test_variants_expand_to_model_keys_that_inherit_the_base(tmp_path: Path) -> None:
    variants = ('[variants.base]\ntrained_context = 64\ngroups = ["extension"]\nnone = {}\n'
                'linear = { type = "linear", factor = 2 }\ndynamic = { type = "dynamic", factor = 2 }\n'
                'yarn = { type = "yarn", factor = 2, beta_fast = 16 }\nllama3 = { type = "llama3", factor = 4 }\n'
                'theta = { rope_theta = 40000 }\n')
    reg = load_registry(write(tmp_path, registry_text(tmp_path / "c.jsonl", BASE, variants)))
    keys = reg.variants_of("base")
    assert keys == [f"base~{n}" for n in ("none", "linear", "dynamic", "yarn", "llama3", "theta")]
    assert reg.in_group("demo") == ["base"]  # the variants are not in the base's groups
    assert reg.in_group("extension") == keys
    base = reg.model("base")
    for key in keys:
        e = reg.model(key)
        assert (e.family, e.source, e.tokenizer, e.corpora, e.capture, e.dtype) == \
               (base.family, base.source, base.tokenizer, base.corpora, base.capture, base.dtype)
        assert e.window == 128 and e.bucket == 8  # W = 2C by default, B = W / 16
        assert e.config_overrides["attention_dropout"] == 0.0  # the base's other overrides are kept
        assert e.variant is not None and e.variant.key == key and e.variant.trained_context == 64
    ov = {k: reg.model(k).config_overrides for k in keys}
    assert ov["base~none"]["rope_scaling"]["rope_type"] == "yarn"  # none: the base entry's own RoPE
    assert "rope_scaling" not in ov["base~linear"]  # a new RoPE replaces the base's override
    assert ov["base~linear"]["rope_parameters"] == {"rope_type": "linear", "factor": 2.0}
    assert ov["base~dynamic"]["max_position_embeddings"] == 64  # dynamic NTK rescales beyond C
    assert ov["base~yarn"]["rope_parameters"] == {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0,
                                                  "original_max_position_embeddings": 64}
    assert ov["base~yarn"]["max_position_embeddings"] == 128
    assert ov["base~llama3"]["rope_parameters"]["original_max_position_embeddings"] == 64
    assert ov["base~theta"]["rope_parameters"] == {"rope_theta": 40000.0}
    assert "plain extrapolation" in reg.model("base~none").description


@pytest.mark.parametrize(("variants", "needle"), [
    ('[variants.nobase]\ntrained_context = 64\nnone = {}\n', "variants.nobase"),
    ('[variants.base]\ntrained_context = 64\nwindow = 64\nnone = {}\n', "must exceed trained_context"),
    ('[variants.base]\nnone = {}\n', "trained_context"),
    ('[variants.base]\ntrained_context = 64\n', "declares no variant"),
    ('[variants.base]\ntrained_context = 64\nlin = { type = "linear" }\n', "entry 'base~lin'"),
    ('[variants.base]\ntrained_context = 64\nlin = { factor = 2 }\n', "'none' takes none"),
    ('[variants.base]\ntrained_context = 64\nlin = { type = "ntk", factor = 2 }\n', "[variants.base].lin.type"),
    ('[variants.base]\ntrained_context = 64\nlin = { type = "linear", factor = 2, beta_fast = 3 }\n',
     "belongs to type 'yarn'"),
    ('[variants.base]\ntrained_context = 64\nlin = { type = "linear", factor = 0.5 }\n', "factor"),
    ('[variants.base]\ntrained_context = 64\nlin = { type = "linear", factor = 2, bogus = 1 }\n', "unknown key"),
    ('[variants.base]\ntrained_context = 64\nlin = 2\n', "must be a table"),
    ('[variants.base]\ntrained_context = 64\n"Bad~Name" = {}\n', "variant names"),
])
def test_variant_errors_name_the_entry(tmp_path: Path, variants: str, needle: str) -> None:
    with pytest.raises(RegistryError) as exc:
        load_registry(write(tmp_path, registry_text(tmp_path / "c.jsonl", BASE, variants)))
    assert needle in str(exc.value) and "registry.toml" in str(exc.value)


def test_a_family_that_cannot_take_the_override_is_refused_naming_the_entry(tmp_path: Path) -> None:
    gemma = BASE.replace('family = "llama"', 'family = "gemma3"').replace("config_overrides", "# ")
    ok = '[variants.base]\ntrained_context = 64\nnone = {}\n'
    assert load_registry(write(tmp_path, registry_text(tmp_path / "c.jsonl", gemma, ok))).variants_of("base")
    bad = ok + 'yarn = { type = "yarn", factor = 2 }\n'
    with pytest.raises(RegistryError, match=r"entry 'base~yarn'.*family 'gemma3' cannot take a RoPE override"):
        load_registry(write(tmp_path, registry_text(tmp_path / "c.jsonl", gemma, bad)))


def test_an_override_the_loaded_config_refuses_names_the_entry(tmp_path: Path) -> None:
    """A base declared as llama whose weights are Gemma 3 (per-layer-type RoPE): loading names the variant."""
    tm.build_tiny_model("gemma3", tmp_path / "m")
    text = registry_text(tmp_path / "c.jsonl", BASE.replace("config_overrides", "# "),
                         '[variants.base]\ntrained_context = 64\nlin = { type = "linear", factor = 2 }\n')
    entry = load_registry(write(tmp_path, text)).model("base~lin")
    with pytest.raises(ModelSourceError, match=r"base~lin: config_overrides \(variant base~lin: linear x2"):
        load_config(entry)


def test_the_demo_registry_declares_the_extension_group() -> None:
    reg = load_registry(Path(__file__).resolve().parent.parent / "data" / "registry.toml")
    keys = reg.in_group("extension")
    assert {"smollm2-135m~none", "smollm2-135m~linear", "smollm2-135m~dynamic", "smollm2-135m~yarn"} <= set(keys)
    assert not set(keys) & set(reg.in_group("demo"))
    for k in keys:
        e = reg.model(k)
        assert e.variant is not None and e.variant.trained_context == 8192 and e.window == 16384


# ---- tiny models: the override changes the captured vectors as the encoding says -----------------
@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ext-zoo")
    for fam in FAMILIES:  # plain RoPE bases (the tiny llama's own config uses llama3 scaling)
        tm.build_tiny_model(fam, root / fam, rope_parameters=dict(PLAIN_ROPE))
    rng = np.random.default_rng(3)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz .,"))
    tm.write_corpus_jsonl(root / "corpus.jsonl", ["".join(rng.choice(letters, size=W + 40)) for _ in range(2)])
    return root


def variant_entries(zoo: Path, tmp: Path, fam: str, lines: dict[str, str]) -> dict[str, Any]:
    model = {"family": fam, "source": {"local": str(zoo / fam)}, "window": 128, "bucket": 16,
             "capture": {"per_bucket": 4}}
    path = tm.write_registry(tmp / "registry.toml", {"b": model}, zoo / "corpus.jsonl")
    body = "".join(f"{name} = {line}\n" for name, line in lines.items())
    path.write_text(path.read_text() + f"\n[variants.b]\ntrained_context = {C}\nwindow = {W}\n{body}")
    reg = load_registry(path)
    return {name: reg.model(f"b~{name}") for name in lines}


def layer0_queries(entry: Any, ids: list[int]) -> torch.Tensor:
    """Layer 0's captured query vectors of every position (n_q, T, d), through the capture's own hook."""
    loaded = load_model(entry, "cpu")
    n_q = loaded.backbone.config.num_attention_heads
    with torch.inference_mode(), CaptureSession(loaded.backbone, {0: (list(range(n_q)), [0])}) as session:
        session.set_positions(np.arange(len(ids)))
        loaded.backbone(input_ids=torch.tensor([ids]), use_cache=False)
        rows = session.collect()
    q = sorted((r for r in rows if r.kind == "q" and r.layer == 0), key=lambda r: r.head)
    assert [r.head for r in q] == list(range(n_q))
    return torch.from_numpy(np.stack([r.vectors for r in q]))


@pytest.mark.parametrize("fam", FAMILIES)
def test_linear_interpolation_moves_a_query_from_position_t_to_s_t(zoo: Path, tmp_path: Path, fam: str) -> None:
    """Position interpolation by s: layer 0's query of a token at position s*t equals the unscaled query of
    the same token at position t (layer 0's query depends only on the token and the RoPE angle)."""
    s = 2
    e = variant_entries(zoo, tmp_path, fam, {"none": "{}", "lin": '{ type = "linear", factor = 2 }'})
    rng = np.random.default_rng(0)
    long_ids = [256, *rng.integers(0, 256, size=W - 1).tolist()]
    short_ids = long_ids[::s]  # the token at position s*t of the long sequence sits at t here
    q_lin = layer0_queries(e["lin"], long_ids)
    q_none = layer0_queries(e["none"], short_ids)
    t = np.arange(len(short_ids))
    assert torch.allclose(q_lin[:, s * t], q_none[:, t], rtol=1e-5, atol=1e-6)
    # the override acts: without it, the same token at s*t has another query
    q_plain_long = layer0_queries(e["none"], long_ids)
    assert not torch.allclose(q_plain_long[:, s * t[1:]], q_none[:, t[1:]], atol=1e-3)
    assert torch.equal(q_plain_long[:, 0], q_lin[:, 0])  # position 0: no rotation under any encoding


@pytest.mark.parametrize("fam", FAMILIES)
def test_dynamic_ntk_equals_plain_rope_with_the_rescaled_base(zoo: Path, tmp_path: Path, fam: str) -> None:
    """Dynamic NTK at sequence length T > C is plain RoPE with base theta * (f T / C - (f - 1))^(d / (d - 2));
    at T <= C it is the unchanged encoding."""
    f, d, T = 2.0, 16, W
    theta = PLAIN_ROPE["rope_theta"] * (f * T / C - (f - 1)) ** (d / (d - 2))
    e = variant_entries(zoo, tmp_path, fam, {"none": "{}", "dyn": '{ type = "dynamic", factor = 2 }',
                                             "theta": f"{{ rope_theta = {theta!r} }}"})
    ids = [256, *np.random.default_rng(1).integers(0, 256, size=T - 1).tolist()]
    q_dyn, q_theta, q_none = (layer0_queries(e[k], ids) for k in ("dyn", "theta", "none"))
    assert torch.allclose(q_dyn, q_theta, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(q_dyn, q_none, atol=1e-3)
    short = ids[:C]
    assert torch.allclose(layer0_queries(e["dyn"], short), layer0_queries(e["none"], short), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fam", FAMILIES)
def test_variant_captures_record_the_override_and_match_the_models_logits(zoo: Path, tmp_path: Path,
                                                                          fam: str) -> None:
    """The capture of each variant records its override in the layer metadata and the manifest, checks it, and its
    captured q.k x scaling still equals that variant's own attention logits (YaRN's attention factor included)."""
    lines = {"yarn": '{ type = "yarn", factor = 3 }', "dyn": '{ type = "dynamic", factor = 3 }'}
    entries = variant_entries(zoo, tmp_path, fam, lines)
    corpus = local_corpus({"path": str(zoo / "corpus.jsonl")})
    for name, e in entries.items():
        loaded = load_model(e, "cpu")
        storage = Storage(tmp_path / name)
        result = capture_model(e, corpus, storage, loaded=loaded)
        reader = CaptureReader(storage, result.prefix)
        man = reader.manifest
        assert man["variant"]["name"] == name and man["variant"]["trained_context"] == C
        want = {"yarn": "yarn", "dyn": "dynamic"}[name]
        assert all(li["rope_type"] == want and li["rope_factor"] == 3.0 for li in man["layers"] if li["rope_applied"])
        if name == "yarn":
            assert man["variant"]["rope_attention_scaling"] == pytest.approx(0.1 * np.log(3.0) + 1.0)
            assert all(li["rope_original_context"] == C for li in man["layers"] if li["rope_applied"])
        compared = 0
        for eid, text in zip(corpus["example_id"], corpus["text"], strict=True):
            ids = loaded.tokenizer(text, truncation=True, max_length=e.window)["input_ids"]
            assert len(ids) == W  # beyond C: the override is active
            weights = tm.eager_attention_weights(loaded.backbone, torch.tensor([ids]))
            for h in man["heads"]:
                head = reader.read_head(h["layer"], h["q_head"])
                qm, km = head.q_doc == int(eid), head.k_doc == int(eid)
                scaling = man["layers"][h["layer"]]["scaling"]
                err, n, _ = tm.logit_mismatch(head.q[qm], head.q_pos[qm], head.k[km], head.k_pos[km], scaling,
                                              weights[h["layer"]][h["q_head"]])
                assert err < 2e-4, (fam, name, h, err)
                compared += n
        assert compared > 100


def test_a_model_without_the_override_fails_the_capture_check(zoo: Path, tmp_path: Path) -> None:
    e = variant_entries(zoo, tmp_path, "qwen3", {"none": "{}", "lin": '{ type = "linear", factor = 2 }'})
    plain = describe_layers(load_config(e["none"]), {})
    scaled = describe_layers(load_config(e["lin"]), {})
    expected = e["lin"].variant.expected_rope()
    assert variant_problems(scaled, expected) == []
    problems = variant_problems(plain, expected)
    assert len(problems) == 2 * len(plain) and "rope_type is 'default', the variant sets 'linear'" in problems[0]
