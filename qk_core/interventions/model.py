"""The text decoder of a model with or without LM head (the probe runs the LM, interventions the decoder)."""

from __future__ import annotations

from typing import Any

from qk_core.models.loading import text_backbone


def backbone_of(model: Any) -> Any:
    """The text decoder whose attention modules the interventions act on (``model.model`` of a ``*ForCausalLM``)."""
    return text_backbone(model)
