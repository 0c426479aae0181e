"""Attention plasticity (SPEC 4): query model, key pairs, closed-form and empirical estimators,
profiles, aggregates, document bootstrap, per-pair records, heatmap, component weights, diagnostics."""

from qk_core.config.options import PlasticityOptions, PlasticityOptionsError
from qk_core.plasticity.analysis import HeadResult, ModelResult, analyse_capture, analyse_head, analyse_model

__all__ = ["HeadResult", "ModelResult", "PlasticityOptions", "PlasticityOptionsError", "analyse_capture",
           "analyse_head", "analyse_model"]
