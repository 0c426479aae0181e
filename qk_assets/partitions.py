"""Partitions derived from the registry file, growing without a code-location reload (SPEC 6, 8, 10).

Every per-model asset (capture, the ``geometry`` and ``plasticity`` multi-assets, and any later per-model
analysis) is keyed by (model, corpus): :func:`model_corpus_partitions`, a two-dimensional
``MultiPartitionsDefinition`` over two *dynamic* dimensions, ``model`` and ``corpus``. ``corpus`` is
partitioned by the same dynamic ``corpus`` dimension, ``trajectory`` by the dynamic ``series``.

Why dynamic dimensions rather than static keys or one dynamic "model|corpus" dimension: the partition
keys live in the Dagster instance, so ``registry_partitions_sensor`` (qk_assets.defs.registry) adds a
model, a checkpoint or a corpus the moment the registry file lists it, with no reload; and a two-
dimensional key lets ``qk_capture`` read its corpus partition through the mapping Dagster infers between
the ``corpus`` asset and the ``corpus`` dimension (``MultiToSingleDimensionPartitionMapping``, built in, so
the daemon and the UI understand it), where a single
"model|corpus" key would need a custom mapping Dagster cannot serialise. Dagster writes the key as
``<corpus>|<model>`` (dimensions in name order). Pairs the registry does not list (a model on a corpus
it is not captured on, or an entry removed from the file) exist in the grid; automation never requests
them (``qk_assets.automation.RegistryListed``, with :func:`listed_keys`) and materialising one by hand
fails naming the registry field to edit.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache

from dagster import (
    AddDynamicPartitionsRequest,
    DynamicPartitionsDefinition,
    Failure,
    MultiPartitionKey,
    MultiPartitionsDefinition,
    PartitionsDefinition,
)

from qk_assets.resources import initialise_pools
from qk_core.config.registry import ModelEntry, Registry, load_registry

MODEL_DIM = "model"
CORPUS_DIM = "corpus"
SERIES_DIM = "series"
MODELS = DynamicPartitionsDefinition(name=MODEL_DIM)
CORPORA = DynamicPartitionsDefinition(name=CORPUS_DIM)
SERIES = DynamicPartitionsDefinition(name=SERIES_DIM)
MODEL_CORPUS = MultiPartitionsDefinition({MODEL_DIM: MODELS, CORPUS_DIM: CORPORA})


@cache
def registry() -> Registry:
    """The registry as loaded when this process loaded the code (a run process reads it fresh)."""
    return load_registry()


def model_corpus_partitions() -> MultiPartitionsDefinition:
    """The partitions of every per-model asset: (model, corpus), both dimensions from the registry."""
    return MODEL_CORPUS


def model_partitions() -> DynamicPartitionsDefinition:
    """The ``model`` dimension alone: per-model assets over every corpus of a model (SPEC 10: cross_corpus)."""
    return MODELS


def corpus_partitions() -> DynamicPartitionsDefinition:
    return CORPORA


def series_partitions() -> DynamicPartitionsDefinition:
    return SERIES


def pair_key(model: str, corpus: str) -> MultiPartitionKey:
    return MultiPartitionKey({MODEL_DIM: model, CORPUS_DIM: corpus})


def split_key(partition_key: str) -> tuple[str, str]:
    """(model, corpus) of a per-model partition key (``<corpus>|<model>`` or a MultiPartitionKey)."""
    if isinstance(partition_key, MultiPartitionKey):
        dims = partition_key.keys_by_dimension
        return dims[MODEL_DIM], dims[CORPUS_DIM]
    corpus, sep, model = str(partition_key).partition("|")
    if not sep:
        raise ValueError(f"'{partition_key}' is not a (model, corpus) partition key '<corpus>|<model>'")
    return model, corpus


def listed_pair(partition_key: str) -> tuple[str, str, ModelEntry]:
    """(model, corpus, the model's registry entry) of a per-model partition the registry lists. A pair it does not
    list (a partition of the grid materialised by hand) is a :class:`dagster.Failure` naming the field to edit."""
    model, corpus = split_key(partition_key)
    entry = registry().model(model)
    if corpus not in entry.corpora:
        raise Failure(description=(
            f"{registry().path}: model '{model}' is not captured on corpus '{corpus}' (field 'corpora' lists "
            f"{list(entry.corpora)}); add '{corpus}' there to analyse this pair"))
    return model, corpus, entry


def registry_pairs(reg: Registry) -> list[tuple[str, str]]:
    """Every (model, corpus) the registry captures, in file order (a model's corpora in its order)."""
    return [(key, c) for key, entry in reg.models.items() for c in entry.corpora]


def multi_corpus_models(reg: Registry) -> list[str]:
    """Models captured on two or more corpora (the ones the cross-corpus asset compares, SPEC 10)."""
    return [key for key, entry in reg.models.items() if len(entry.corpora) >= 2]


def checkpoint_pair_keys(reg: Registry, series: Iterable[str] | None = None) -> set[str]:
    """The (model, corpus) partition keys the trajectories read: every checkpoint of every series (of
    ``series`` only, when given; names the registry does not list have none) on the checkpoint's first
    corpus (SPEC 6)."""
    chosen = reg.series.values() if series is None else [reg.series[s] for s in series if s in reg.series]
    return {str(pair_key(k, reg.model(k).corpus)) for s in chosen for k in s.checkpoint_keys}


def primary_pairs(reg: Registry) -> list[tuple[str, str]]:
    """(model, its first corpus) for every model: what the study-wide tables (report, joins) read."""
    return [(key, entry.corpus) for key, entry in reg.models.items()]


def by_model(frames: object, reg: Registry) -> dict[str, object]:
    """A bulk-loaded per-model input ({partition key: frame}) narrowed to each model's first corpus and
    keyed by model (what the cross-model tables and figures use)."""
    if not isinstance(frames, dict):
        return {}
    out = {}
    for pk, df in frames.items():
        try:
            model, corpus = split_key(pk)
        except ValueError:
            continue
        if model in reg.models and reg.model(model).corpus == corpus:
            out[model] = df
    return out


def wanted_keys(reg: Registry) -> dict[str, list[str]]:
    """The dynamic partition keys the registry defines, per dimension, in file order."""
    return {MODEL_DIM: list(reg.models), CORPUS_DIM: list(reg.corpora), SERIES_DIM: list(reg.series)}


def listed_keys(reg: Registry, partitions_def: PartitionsDefinition) -> set[str] | None:
    """The keys of ``partitions_def`` that ``reg`` lists now: its (model, corpus) pairs, corpora, models or
    series (None for a partitions definition that is not the registry's)."""
    if partitions_def == MODEL_CORPUS:
        return {str(pair_key(m, c)) for m, c in registry_pairs(reg)}
    for dim, keys in ((CORPORA, reg.corpora), (MODELS, reg.models), (SERIES, reg.series)):
        if partitions_def == dim:
            return set(keys)
    return None


def partition_requests(reg: Registry, existing: dict[str, list[str]]) -> tuple[list[AddDynamicPartitionsRequest],
                                                                              dict[str, list[str]]]:
    """Requests adding what the registry lists and the instance lacks, and what the instance has that the
    registry no longer lists (reported, never deleted: their outputs stay)."""
    adds, gone = [], {}
    for dim, keys in wanted_keys(reg).items():
        have = set(existing.get(dim, []))
        new = [k for k in keys if k not in have]
        if new:
            adds.append(AddDynamicPartitionsRequest(partitions_def_name=dim, partition_keys=new))
        removed = sorted(have - set(keys))
        if removed:
            gone[dim] = removed
    return adds, gone


def sync_instance(instance, reg: Registry, attempts: int = 3) -> dict[str, list[str]]:
    """Add the registry's partitions to ``instance`` (what the sensor does, for in-process runs and tests) and
    give the ``gpu`` pool its limit (:func:`qk_assets.resources.initialise_pools`); returns the keys added per
    dimension.

    The registry sensor may add the same keys at the same moment (a fresh instance: the demo's start). The
    instance checks which keys it has and then inserts the others, so one of two such writers can fail on the
    table's unique key; that writer reads the instance again and adds what is still missing, up to ``attempts``
    times."""
    from sqlalchemy.exc import IntegrityError

    initialise_pools(instance)
    added: dict[str, list[str]] = {}
    for attempt in range(attempts):
        existing = {d: list(instance.get_dynamic_partitions(d)) for d in (MODEL_DIM, CORPUS_DIM, SERIES_DIM)}
        adds, _ = partition_requests(reg, existing)
        try:
            for req in adds:
                instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
                added[req.partitions_def_name] = list(req.partition_keys)
            return added
        except IntegrityError:
            if attempt == attempts - 1:
                raise
    return added
