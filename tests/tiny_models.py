"""Tiny randomly initialised models of every registry family, built locally from configs (no network).

Reusable by every test that needs a model on disk:

- :func:`build_tiny_model` (``family``, ``path``, ``**config_overrides``) saves a model (safetensors) and a
  byte-level tokenizer into ``path`` and returns it; load it through a registry ``local`` source.
- :func:`build_tiny_series` saves one such model per revision under ``root/<revision>`` (a local
  checkpoint series: same architecture, different weights), for ``source = {local = "root/{revision}"}``.
- :func:`write_corpus_jsonl` / :func:`write_registry` write a local corpus and a registry TOML using them.

Families: llama, mistral, ministral3 (multimodal Mistral3 checkpoint whose text model is Ministral3),
qwen3, smollm3, gemma3 (text model), mllama (Llama-3.2-Vision: vision + text with cross-attention layers).
Weights are drawn with a larger init scale than the library default so that attention is far from
uniform (tests then discriminate between right and wrong Q/K rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "ministral3", "qwen3", "smollm3", "gemma3", "mllama")
VOCAB = 272  # 256 byte symbols + specials, rounded up
INIT_STD = 0.15

_TEXT_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "initializer_range": INIT_STD,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
}


def byte_tokenizer() -> Any:
    """A byte-level tokenizer (one token per UTF-8 byte, BOS prepended) built without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_config(family: str, **overrides: Any) -> Any:
    """The config of a tiny model of ``family``; ``overrides`` go to the text config."""
    import transformers as tf

    text = dict(_TEXT_BASE)
    if family == "llama":
        text["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}
        return tf.LlamaConfig(**{**text, **overrides})
    if family == "mistral":
        return tf.MistralConfig(**{**text, "sliding_window": None, **overrides})
    if family == "qwen3":
        return tf.Qwen3Config(**{**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                                 **overrides})
    if family == "smollm3":
        return tf.SmolLM3Config(**{**text, "num_hidden_layers": 8, **overrides})
    if family == "gemma3":
        # 6 layers, every 3rd full (2, 5), sliding window 8; query_pre_attn_scalar != head_dim on purpose
        cfg = {**text, "num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
        return tf.Gemma3TextConfig(**{**cfg, **overrides})
    if family == "ministral3":
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1}
        text_cfg = tf.Ministral3Config(**{**text, "rope_parameters": rope, "max_position_embeddings": 512,
                                          **overrides})
        vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=16, image_size=32, patch_size=8)
        return tf.Mistral3Config(text_config=text_cfg, vision_config=vision, image_token_index=259,
                                 spatial_merge_size=2)
    if family == "mllama":
        text_cfg = tf.MllamaTextConfig(**{**text, "num_hidden_layers": 5, "cross_attention_layers": [1, 3],
                                          "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                          **overrides})
        vision = tf.MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_global_layers=1, attention_heads=2, vision_output_dim=64,
                                       image_size=16, patch_size=8, max_num_tiles=1,
                                       intermediate_layers_indices=[0],
                                       supported_aspect_ratios=[[1, 1]])
        return tf.MllamaConfig(text_config=text_cfg, vision_config=vision, image_token_index=259)
    raise ValueError(f"unknown tiny family {family!r}; known: {FAMILIES}")


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> Any:
    """An in-memory tiny model (with its head) of ``family``, seeded."""
    import torch
    import transformers as tf

    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    if family == "ministral3":
        model = tf.Mistral3ForConditionalGeneration(cfg)
    elif family == "mllama":
        model = tf.MllamaForConditionalGeneration(cfg)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return model.eval()


def build_tiny_model(family: str, path: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a tiny ``family`` model (safetensors) + byte tokenizer into ``path``; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(family, seed=seed, **config_overrides)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


def build_tiny_series(family: str, root: str | Path, revisions: list[str], **config_overrides: Any) -> Path:
    """A local checkpoint series: ``root/<revision>`` per revision, same architecture, seed = index."""
    root = Path(root)
    for i, rev in enumerate(revisions):
        build_tiny_model(family, root / rev, seed=i, **config_overrides)
    return root


def write_corpus_jsonl(path: str | Path, texts: list[str], ids: list[int] | None = None) -> Path:
    """A ``local_file`` corpus: one JSON record per line with ``id`` and ``text``."""
    path = Path(path)
    ids = ids or list(range(1, len(texts) + 1))
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True)))
    return path


def sample_texts(n: int, n_chars: int, seed: int = 0) -> list[str]:
    """``n`` pseudo-random ASCII documents of ``n_chars`` characters (one byte-token each)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz      .,"))
    return ["".join(rng.choice(letters, size=n_chars)) for _ in range(n)]


def write_registry(path: str | Path, models: dict[str, dict[str, Any]], corpus_file: str | Path,
                   corpus_name: str = "tiny", extra_corpora: dict[str, str | Path] | None = None) -> Path:
    """A registry TOML with one ``local_file`` corpus (plus ``extra_corpora``: name -> file, for models that list
    several in their ``corpora``) and the given model tables (values TOML-encoded)."""
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return str(v)

    lines = []
    for name, file in {corpus_name: corpus_file, **(extra_corpora or {})}.items():
        lines += [f'[corpora.{name}]', 'kind = "local_file"', f"path = {json.dumps(str(file))}", "n_docs = 1000", ""]
    for key, fields in models.items():
        lines.append(f'[models."{key}"]')
        lines += [f"{k} = {val(v)}" for k, v in {"corpus": corpus_name, **fields}.items()]
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path


def attention_modules(backbone: Any) -> dict[int, Any]:
    """The self/cross-attention modules of a text backbone by layer index (anything with q_proj + layer_idx)."""
    return {int(m.layer_idx): m for m in backbone.modules()
            if hasattr(m, "q_proj") and hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")}


def eager_attention_weights(backbone: Any, input_ids: Any) -> dict[int, Any]:
    """Post-softmax attention weights (n_q, T, T) per layer from the model's own eager attention.

    The backbone is switched to ``eager`` for this forward and back afterwards; the weights are what
    each attention module returns (read with forward hooks in the test only). Their logs give the
    model's own attention logits up to a per-row constant.
    """
    import torch

    saved = backbone.config._attn_implementation
    weights: dict[int, Any] = {}
    hooks = [m.register_forward_hook(lambda mod, _a, out: weights.__setitem__(int(mod.layer_idx), out[1][0]))
             for m in attention_modules(backbone).values()]
    backbone.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            backbone(input_ids=input_ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        backbone.set_attn_implementation(saved)
    return weights


def logit_mismatch(q: Any, q_pos: Any, k: Any, k_pos: Any, scaling: float, weights: Any,
                   window: int | None = None, min_weight: float = 0.0) -> tuple[float, int, Any]:
    """Compare captured q·k·scaling with the model's own logits of one head and one document.

    ``weights`` is that head's (T, T) post-softmax attention from :func:`eager_attention_weights`;
    its log equals the logits up to a per-row constant, so both sides are taken relative to one
    reference key per query row (the visible sampled key with the largest weight). Pairs compared:
    causal, inside the sliding ``window`` if any, weights above ``min_weight``. Returns (max abs
    difference, number of pairs compared, the (n_q, n_k) weights at the sampled positions).
    """
    import numpy as np

    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
    w = np.asarray(weights, dtype=np.float64)[np.ix_(q_pos, k_pos)]
    s = scaling * q @ k.T
    valid = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        valid &= (q_pos[:, None] - k_pos[None, :]) < window
    valid &= w > min_weight
    rows = np.flatnonzero(valid.any(axis=1))
    if not len(rows):
        return 0.0, 0, w
    ref = np.where(valid, w, -1.0).argmax(axis=1)[rows]
    with np.errstate(divide="ignore"):
        r = np.log(w)
    ds = s[rows] - s[rows, ref][:, None]
    dr = r[rows] - r[rows, ref][:, None]
    v = valid[rows]
    return float(np.max(np.abs(ds - dr)[v])), int(v.sum()), w
