"""Partitions derived from the registry file: adding an entry adds a partition, no code change."""

from functools import cache

from dagster import StaticPartitionMapping, StaticPartitionsDefinition

from qk_core.registry import Registry, load_registry


@cache
def registry() -> Registry:
    """The registry as loaded when the code location loads (reload the location to pick up edits)."""
    return load_registry()


def model_partitions() -> StaticPartitionsDefinition:
    """One partition per model key: registry models and every checkpoint of every series."""
    return StaticPartitionsDefinition(registry().model_keys)


def corpus_partitions() -> StaticPartitionsDefinition:
    return StaticPartitionsDefinition(sorted(registry().corpora))


def series_partitions() -> StaticPartitionsDefinition:
    return StaticPartitionsDefinition(sorted(registry().series) or ["(none)"])


def corpus_of_model() -> StaticPartitionMapping:
    """corpus partition -> the model partitions that read it."""
    mapping: dict[str, set[str]] = {}
    for key, entry in registry().models.items():
        mapping.setdefault(entry.corpus, set()).add(key)
    return StaticPartitionMapping(mapping)


def checkpoints_of_series() -> StaticPartitionMapping:
    """model partition (a checkpoint) -> its series partition."""
    return StaticPartitionMapping(
        {key: s.name for s in registry().series.values() for key in s.checkpoint_keys}
    )
