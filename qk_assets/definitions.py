"""The Dagster code location: every asset, check, sensor and job of the platform.

Each module of :mod:`qk_assets.defs` is one stage of the lineage graph. Its assets are picked up
automatically; a module may also export ``SENSORS``, ``JOBS`` and ``ASSET_CHECKS`` lists.
"""

import importlib
import pkgutil
from types import ModuleType

from dagster import (
    AssetKey,
    AssetsDefinition,
    Definitions,
    in_process_executor,
    load_asset_checks_from_modules,
    load_assets_from_modules,
)

from qk_assets import defs as defs_pkg
from qk_assets.automation import automation_sensor
from qk_assets.defs.registry import model_automation_sensor
from qk_assets.io_manager import ParquetIOManager
from qk_assets.owners import with_owners
from qk_assets.partitions import model_corpus_partitions
from qk_assets.resources import RayClusterResource, StorageResource, TorchDeviceResource
from qk_assets.versioning import with_code_versions
from qk_core.config.settings import Settings


def asset_modules() -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(defs_pkg.__path__))
    return [importlib.import_module(f"{defs_pkg.__name__}.{n}") for n in names]


def per_model_keys(assets: list[object]) -> list[AssetKey]:
    """Every executable asset partitioned by (model, corpus)."""
    return sorted((k for a in assets if isinstance(a, AssetsDefinition) and a.is_executable
                   and a.partitions_def == model_corpus_partitions() for k in a.keys),
                  key=lambda k: k.to_user_string())


def derived_keys(assets: list[object]) -> list[AssetKey]:
    """Every asset with an automation condition that is neither per (model, corpus) nor ``corpus``."""
    skip = {*per_model_keys(assets), AssetKey("corpus")}
    return sorted((spec.key for a in assets if isinstance(a, AssetsDefinition) and a.is_executable
                   for spec in a.specs if spec.automation_condition is not None and spec.key not in skip),
                  key=lambda k: k.to_user_string())


def build_definitions(settings: Settings | None = None) -> Definitions:
    settings = settings or Settings.from_env()
    storage = StorageResource.from_settings(settings)
    modules = asset_modules()
    assets = with_owners(with_code_versions(load_assets_from_modules(modules), modules))
    return Definitions(
        assets=assets,
        asset_checks=load_asset_checks_from_modules(modules),
        sensors=[*(s for m in modules for s in getattr(m, "SENSORS", [])),
                 # QK_AUTOMATION_INTERVAL_S: each evaluation walks the whole graph in the code server
                 model_automation_sensor(per_model_keys(assets), settings.automation_interval_s),
                 automation_sensor(derived_keys(assets), settings.automation_interval_s)],
        jobs=[j for m in modules for j in getattr(m, "JOBS", [])],
        # every run (UI, backfill, sensor, automation, demo) executes its steps in its run worker: one code import
        # per run, not one per step (a step process imports the location: 3 assets took 21-25 s and 29-31 s of CPU
        # with a process per step, 8.5-8.9 s of both in process, README "Where the time goes"); runs of different
        # partitions still run side by side, bounded by the run queue
        executor=in_process_executor,
        resources={
            "storage": storage,
            "io_manager": ParquetIOManager(storage=storage),
            "device": TorchDeviceResource(device=settings.device),
            "ray": RayClusterResource.from_settings(settings),
        },
    )


defs = build_definitions()
