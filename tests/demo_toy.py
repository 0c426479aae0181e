"""A toy code location of the real graph's shape for the demo runner's tests.

corpus_t[c] -> cap[m, c] -> ana[m, c] -> rep -> report_html, plus ``xy`` (a multi-asset that cannot be
subset). Its code versions come from the JSON file named by ``QK_TOY_VERSIONS`` (``{"ana": "v2"}``), so the
test process and the webserver it asks (``workspace.yaml`` loading this file) see the same code change.
The runs execute in Dagster's run workers (the backfill daemon launches them), so the toy talks to the test
through files in the folder named by ``QK_TOY_DIR``: ``calls`` gets one line per asset partition that ran,
a label listed in ``fail.json`` raises, one listed in ``sleep.json`` sleeps for ten minutes first (until
Dagster terminates its run). ``cap`` runs in the concurrency pool ``gpu``, as the real capture does.
"""

import json
import os
import time
from pathlib import Path

import pandas as pd
from dagster import AssetExecutionContext, AssetOut, Definitions, Output, asset, mem_io_manager, multi_asset

from qk_assets.partitions import corpus_partitions, model_corpus_partitions

DEFAULTS = {"corpus_t": "c1", "cap": "k1", "ana": "v1", "rep": "r1", "report_html": "h1", "x": "1", "y": "1"}


def versions() -> dict[str, str]:
    path = os.environ.get("QK_TOY_VERSIONS")
    return {**DEFAULTS, **(json.loads(Path(path).read_text()) if path and Path(path).exists() else {})}


def _listed(name: str) -> list[str]:
    path = Path(os.environ.get("QK_TOY_DIR", ".")) / name
    return json.loads(path.read_text()) if path.exists() else []


def record(label: str) -> None:
    with open(Path(os.environ.get("QK_TOY_DIR", ".")) / "calls", "a") as fh:
        fh.write(label + "\n")


def _record(context: AssetExecutionContext) -> pd.DataFrame:
    name = context.assets_def.key.to_user_string()
    label = name + (f"[{context.partition_key}]" if context.has_partition_key else "")
    record(label)
    if label in _listed("sleep.json"):
        time.sleep(600)  # until the run is terminated
    if label in _listed("fail.json"):
        raise RuntimeError(f"{label} fails on purpose")
    return pd.DataFrame({"x": [1]})


def build(v: dict[str, str] | None = None) -> Definitions:
    v = {**versions(), **(v or {})}

    @asset(partitions_def=corpus_partitions(), code_version=v["corpus_t"])
    def corpus_t(context: AssetExecutionContext) -> pd.DataFrame:
        return _record(context)

    @asset(partitions_def=model_corpus_partitions(), code_version=v["cap"], deps=["corpus_t"], pool="gpu")
    def cap(context: AssetExecutionContext) -> pd.DataFrame:
        return _record(context)

    @asset(partitions_def=model_corpus_partitions(), code_version=v["ana"], deps=[cap])
    def ana(context: AssetExecutionContext) -> pd.DataFrame:
        return _record(context)

    @asset(code_version=v["rep"], deps=[ana])
    def rep(context: AssetExecutionContext) -> pd.DataFrame:
        return _record(context)

    @asset(name="report_html", code_version=v["report_html"], deps=[rep, ana])
    def report(context: AssetExecutionContext) -> pd.DataFrame:
        return _record(context)

    @multi_asset(outs={"x": AssetOut(code_version=v["x"]), "y": AssetOut(code_version=v["y"])}, can_subset=False)
    def xy():
        record("xy")
        yield Output(pd.DataFrame({"v": [1]}), output_name="x")
        yield Output(pd.DataFrame({"v": [2]}), output_name="y")

    return Definitions(assets=[corpus_t, cap, ana, rep, report, xy], resources={"io_manager": mem_io_manager})


defs = build()
