"""The one run-config shape of the analyses: option tables keyed by analysis name, exactly as in a registry
entry's ``analysis`` table and checked by the same schema (:func:`qk_core.config.options.resolve_options`)."""

from typing import Any

from dagster import Config
from pydantic import Field

from qk_assets.partitions import registry
from qk_core.config.options import resolve_options
from qk_core.config.schema import OptionsError


class AnalysisConfig(Config):
    """Run-config overrides of the registry's analysis options, e.g.
    ``{"options": {"pca": {"n_components": 5}, "rotation": {"separation": "eigen"}}}``."""

    options: dict[str, dict[str, Any]] = Field(default_factory=dict)


def analysis_options(model_key: str, config: AnalysisConfig | None, *names: str) -> list[Any]:
    """Options of each analysis in ``names`` for ``model_key``: defaults < registry < run config."""
    given = dict(config.options) if config is not None else {}
    extra = sorted(set(given) - set(names))
    if extra:
        raise OptionsError(f"run config 'options': {extra} not read by this asset (it reads {list(names)})")
    reg = registry()
    analysis = reg.model(model_key).analysis if model_key in reg.models else {}
    return [resolve_options(name, analysis, given.get(name)) for name in names]
