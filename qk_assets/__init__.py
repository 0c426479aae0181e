"""Dagster definitions of the QK geometry platform (thin wrappers over qk_core)."""

from qk_assets.definitions import build_definitions

defs = build_definitions()
