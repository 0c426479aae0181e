"""Dagster definitions of the QK geometry platform (thin wrappers over qk_core): the code location is
:data:`qk_assets.definitions.defs`; one module per SPEC domain in :mod:`qk_assets.defs`; command-line programs in
:mod:`qk_assets.cli`."""
