"""Head interventions on tiny models of every registry family (SPEC 11.2).

Ground truth: the plain model (bit-identical outputs with an empty head set, untouched heads and earlier
layers), the model's own eager attention weights, and an independent float64 computation of the debiased
logits q.(k - alpha_K (t - t_bar) a) from the captured q and k.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture.hook import CaptureSession
from qk_core.interventions.hook import DebiasAxis, Intervention, InterventionError, InterventionSession
from qk_core.interventions.model import backbone_of

torch.set_num_threads(min(2, torch.get_num_threads()))

# a full-attention self-attention layer of each tiny family (gemma3: every 3rd layer; mllama: 1, 3 are cross)
LAYER = {"llama": 1, "mistral": 1, "ministral3": 1, "qwen3": 1, "smollm3": 1, "gemma3": 2, "mllama": 2}
T = 48


@pytest.fixture(scope="module", params=tm.FAMILIES)
def fam_model(request: pytest.FixtureRequest) -> tuple[str, Any, Any, torch.Tensor]:
    fam = request.param
    model = tm.tiny_model(fam)
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(3))
    return fam, model, backbone_of(model), ids


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def o_proj_inputs(model: Any, backbone: Any, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per layer: the attention output handed to the output projection, (T, n_q, d)."""
    out: dict[int, torch.Tensor] = {}
    mods = tm.attention_modules(backbone)
    hooks = [m.o_proj.register_forward_pre_hook(
        lambda _m, a, layer=layer, n=m.config.num_attention_heads: out.__setitem__(layer, a[0][0].reshape(T, n, -1)))
        for layer, m in mods.items()]
    try:
        logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def test_empty_head_set_is_bit_identical(fam_model: tuple[str, Any, Any, torch.Tensor]) -> None:
    fam, model, backbone, ids = fam_model
    plain = logits(model, ids)
    for iv in (Intervention(), Intervention("ablate", (), "zero"), Intervention("debias", ())):
        with InterventionSession(backbone, iv):
            assert backbone.config._attn_implementation.startswith("qk_")
            got = logits(model, ids)
        assert torch.equal(got, plain), f"{fam}: {iv.kind} with no heads changed the outputs"
    assert not backbone.config._attn_implementation.startswith("qk_")


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablate_changes_exactly_the_chosen_heads(fam_model: tuple[str, Any, Any, torch.Tensor], mode: str) -> None:
    fam, model, backbone, ids = fam_model
    layer = LAYER[fam]
    chosen = [(layer, 1), (layer, 2)]
    with InterventionSession(backbone, Intervention(), record_means=True) as rec:
        base = o_proj_inputs(model, backbone, ids)
    means = rec.head_means()
    np.testing.assert_allclose(means[(layer, 1)], base[layer][:, 1].mean(0).numpy(), rtol=1e-5, atol=1e-6)
    with InterventionSession(backbone, Intervention("ablate", tuple(chosen), mode, means=means)):
        got = o_proj_inputs(model, backbone, ids)
    for la in base:
        if la < layer:
            assert torch.equal(got[la], base[la]), f"{fam}: layer {la} before the ablated layer changed"
    for h in range(base[layer].shape[1]):
        if (layer, h) in chosen:
            want = torch.zeros_like(base[layer][:, h]) if mode == "zero" else \
                torch.as_tensor(means[(layer, h)]).expand_as(base[layer][:, h])
            assert torch.equal(got[layer][:, h], want), f"{fam}: head {h} not ablated to {mode}"
            assert not torch.equal(base[layer][:, h], want)
        else:
            assert torch.equal(got[layer][:, h], base[layer][:, h]), f"{fam}: untouched head {h} changed"


def eager_weights(backbone: Any, model: Any, ids: torch.Tensor, iv: Intervention | None) -> dict[int, torch.Tensor]:
    """Post-softmax weights (n_q, T, T) per layer from the eager backend, under ``iv`` when given."""
    saved = backbone.config._attn_implementation
    backbone.set_attn_implementation("eager")
    weights: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, _a, out: weights.__setitem__(int(mod.layer_idx), out[1][0]))
             for m in tm.attention_modules(backbone).values()]
    try:
        if iv is None:
            logits(model, ids)
        else:
            with InterventionSession(backbone, iv):
                logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
        backbone.set_attn_implementation(saved)
    return weights


def test_debias_logits_match_independent_computation(fam_model: tuple[str, Any, Any, torch.Tensor]) -> None:
    fam, model, backbone, ids = fam_model
    layer, head = LAYER[fam], 1
    n_q = backbone.config.num_attention_heads
    n_kv = backbone.config.num_key_value_heads
    kv = head * n_kv // n_q
    pos = np.arange(T)
    with CaptureSession(backbone, {layer: (list(range(n_q)), list(range(n_kv)))}) as cap:
        cap.set_positions(pos)
        logits(model, ids)
        scaling = cap.calls[layer].scaling
        rows = {(r.kind, r.head): r.vectors.astype(np.float64) for r in cap.collect() if r.layer == layer}
    d = rows[("q", 0)].shape[1]
    rng = np.random.default_rng(0)
    a = rng.normal(size=d)
    a /= np.linalg.norm(a)
    k0 = rows[("k", kv)]
    # a planted slope large enough to move the attention visibly
    alpha = 4.0 * float(np.std(k0 @ a)) / T
    axis = DebiasAxis(a=a, alpha_k=alpha, t_bar=17.5)
    base = eager_weights(backbone, model, ids, None)
    got = eager_weights(backbone, model, ids, Intervention("debias", ((layer, head),), axes={(layer, head): axis}))

    k_deb = k0 - alpha * (pos - 17.5)[:, None] * a[None, :]
    z = scaling * rows[("q", head)] @ k_deb.T
    z[np.triu_indices(T, 1)] = -np.inf
    want = np.exp(z - z.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    w = got[layer][head].double().numpy()
    np.testing.assert_allclose(w, want, atol=2e-5, err_msg=f"{fam}: debiased weights")
    assert np.abs(w - base[layer][head].double().numpy()).max() > 1e-2, f"{fam}: debias moved nothing"
    for h in range(n_q):
        if h != head:  # incl. the other heads of its GQA group
            assert torch.equal(got[layer][h], base[layer][h]), f"{fam}: head {h} changed under debias of {head}"
    for la in base:
        if la < layer:
            assert torch.equal(got[la], base[la])


def test_debias_refuses_bad_input(fam_model: tuple[str, Any, Any, torch.Tensor]) -> None:
    fam, model, backbone, ids = fam_model
    with pytest.raises(InterventionError, match="no rotation axis"):
        Intervention("debias", ((LAYER[fam], 0),))
    with pytest.raises(InterventionError, match="no baseline mean"):
        InterventionSession(backbone, Intervention("ablate", ((LAYER[fam], 0),), "mean"))
    bad = DebiasAxis(a=np.ones(3) / np.sqrt(3), alpha_k=0.1, t_bar=0.0)
    with InterventionSession(backbone, Intervention("debias", ((LAYER[fam], 0),), axes={(LAYER[fam], 0): bad})), \
            pytest.raises(InterventionError, match="axis a has length 3"):
        logits(model, ids)
