"""``make demo``: materialise the whole lineage graph for the registry's demo models through Dagster.

``python -m qk_assets.cli.demo [--group demo] [--models GLOB ...] [--dry-run] [--force] [--dagster-url URL]``

Dagster executes everything, exactly as for the UI's *Materialize* and ``make backfill``: the demo runs
``dagster dev`` (webserver + daemon, ``qk_assets.cli.dagster_api``) over ``$DAGSTER_HOME`` for its duration, or uses
a running one (``--dagster-url``, e.g. ``make ui``'s), and

1. adds the registry's partitions (what ``registry_partitions_sensor`` does) and observes ``registry_entry`` and
   ``registry_analysis`` in one run (registry edits become data versions);
2. asks Dagster (GraphQL) for the status of every selected asset partition — the status the UI shows: *missing*,
   *stale* with Dagster's causes (a new code version: every asset's code version is a hash of its source,
   ``qk_assets.versioning``; a new dependency data version, ...), or fresh — and plans those plus what depends on
   them in the selection (their new values make the dependents stale once written); it prints that plan;
3. launches **one asset backfill** of exactly that plan. The backfill daemon orders it by dependency, groups each
   partition's assets into one run, and skips what depends on a failure; the run queue and the ``gpu`` pool
   decide what runs side by side. The demo polls it and prints each partition's runs as they start and end.

The selection per partition set: the corpora the demo models read; every (model, corpus) pair of the demo models;
the models with two or more corpora (``cross_corpus``, SPEC 10); every series (without its hub checkpoints the
trajectory holds the thesis's reference values); every unpartitioned asset (model report, joins, figures,
``report_html``). A second ``make demo`` finds everything fresh, says so and launches nothing.

SIGINT (Ctrl-C) or SIGTERM cancels the backfill (Dagster terminates its runs in progress; their pool slots are
freed by Dagster), stops the ``dagster dev`` the demo started, and exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from dagster import (
    AssetKey,
    DagsterInstance,
    Definitions,
    multi_or_in_process_executor,
    partition_loading_context,
)

from qk_assets.cli.dagster_api import (
    POLL_S,
    DagsterAPI,
    Health,
    Interrupted,
    dagster_at,
    partitions_of,
    run_backfill,
    stop_on_signals,
)
from qk_assets.cli.preflight import InstanceError, instance_problem
from qk_assets.definitions import build_definitions
from qk_assets.defs.extension import GROUP as EXTENSION_GROUP
from qk_assets.partitions import multi_corpus_models, pair_key, registry, sync_instance
from qk_core.config.registry import Registry
from qk_core.io.storage import Storage

DEMO_TAG = "qk/demo"
REPORT_KEY = AssetKey("report_html")
REGISTRY_SOURCES = (AssetKey("registry_entry"), AssetKey("registry_analysis"))
REPORT_REL = "report/index.html"
DemoInterrupted = Interrupted  # SIGINT / SIGTERM stopped the demo (its backfill canceled)

Node = tuple[AssetKey, str | None]
AssetGraph = Any  # what Definitions.resolve_asset_graph() returns


def node_name(node: Node) -> str:
    key, pk = node
    return key.to_user_string() + (f"[{pk}]" if pk else "")


# ---- what the demo selects --------------------------------------------------------------------
def group_models(registry: Registry, group: str, patterns: Iterable[str] = ()) -> list[str]:
    """Model keys of ``group`` (registry order), narrowed to those matching any glob in ``patterns``."""
    pats = list(patterns)
    return [m for m in registry.in_group(group) if not pats or any(fnmatch.fnmatchcase(m, p) for p in pats)]


def demo_partition_keys(registry: Registry, group: str, patterns: Iterable[str] = ()) -> set[str]:
    """Partition keys that belong to the demo: its models' (model, corpus) pairs, their corpora, the models
    with two or more corpora (the cross-corpus asset), and every series (a series whose checkpoints are not
    captured shows the thesis's reference values and says what is missing)."""
    models = group_models(registry, group, patterns)
    corpora = {c for m in models for c in registry.model(m).corpora}
    pairs = {str(pair_key(m, c)) for m in models for c in registry.model(m).corpora}
    compared = set(models) & set(multi_corpus_models(registry))
    return pairs | corpora | compared | set(registry.series)


def extension_partition_keys(registry: Registry, group: str, patterns: Iterable[str] = ()) -> set[str]:
    """Partition keys of the extension assets (SPEC 13, group ``extension``) that belong to the run: the chosen
    variants' (model, first corpus) pairs (retrieval beyond C) and their bases (the comparison). A run without
    variants materialises none of them."""
    chosen = [registry.model(m) for m in group_models(registry, group, patterns)]
    variants = [e for e in chosen if e.variant is not None]
    return {str(pair_key(e.key, e.corpus)) for e in variants} | {e.variant.base for e in variants}


def select_nodes(graph: AssetGraph, registry: Registry, group: str, patterns: Iterable[str] = (),
                 instance: DagsterInstance | None = None) -> tuple[list[Node], list[str]]:
    """The (asset, partition) pairs the demo materialises, and notes on the assets it leaves out."""
    patterns = list(patterns)
    wanted_models = demo_partition_keys(registry, group, patterns)
    wanted_extension = extension_partition_keys(registry, group, patterns)
    nodes: list[Node] = []
    notes: list[str] = []
    for key in graph.toposorted_asset_keys:
        node = graph.get(key)
        if not node.is_materializable:
            continue
        if node.partitions_def is None:
            nodes.append((key, None))
            continue
        wanted = wanted_extension if node.group_name == EXTENSION_GROUP else wanted_models
        keys = [k for k in node.partitions_def.get_partition_keys(dynamic_partitions_store=instance) if k in wanted]
        if not keys:
            notes.append(f"{key.to_user_string()}: no partition for the '{group}' models (skipped)")
        demo_models = set(group_models(registry, group, patterns))
        for k in keys:
            if k in registry.series and not demo_models & set(registry.series[k].checkpoint_keys):
                notes.append(f"{key.to_user_string()}[{k}]: no checkpoint of the series is in the demo; "
                             "it shows the thesis's reference values")
        nodes.extend((key, k) for k in keys)
    return nodes, notes


def upstream_nodes(graph: AssetGraph, node: Node) -> list[Node]:
    """Every upstream (asset, partition) of ``node`` under the graph's partition mappings."""
    key, pk = node
    out: list[Node] = []
    for parent in sorted(graph.get(key).parent_keys, key=lambda k: k.to_user_string()):
        pnode = graph.get(parent)
        if not pnode.is_materializable:
            continue
        if pnode.partitions_def is None:
            out.append((parent, None))
            continue
        result = graph.get_parent_partition_keys_for_child(pk, parent, key)
        out.extend((parent, k) for k in sorted(result.partitions_subset.get_partition_keys()))
    return out


# ---- what Dagster says is missing or stale ------------------------------------------------------
@dataclass
class Decision:
    node: Node
    reason: str  # "" when up to date


def dagster_reasons(api: DagsterAPI, nodes: list[Node]) -> dict[Node, str]:
    """Dagster's own answer per node (the UI's status): missing, stale with its causes, or fresh ("")."""
    status = api.stale_status(partitions_of(nodes))
    out = {}
    for node in nodes:
        st = status.get(node)
        if st is None or st.status == "MISSING":
            out[node] = "missing (never materialised)"
        elif st.status == "STALE":
            out[node] = "stale: " + "; ".join(st.causes[:2]) + (" ..." if len(st.causes) > 2 else "")
        else:
            out[node] = ""
    return out


def siblings(graph: AssetGraph, key: AssetKey) -> list[AssetKey]:
    """The other outputs of ``key``'s asset definition when it cannot materialise them separately."""
    adef = graph.get(key).assets_def
    if adef.can_subset:
        return []
    return sorted((k for k in adef.keys if k != key), key=lambda k: k.to_user_string())


def decide(graph: AssetGraph, nodes: list[Node], own: dict[Node, str], force: bool = False) -> list[Decision]:
    """Decisions in the order of ``nodes``: Dagster's missing / stale ones, and what depends on them in the
    plan (recomputing an asset gives its dependents new inputs; Dagster marks them stale only afterwards);
    the outputs of an asset that cannot be subset are recomputed together."""
    reason = {n: "forced" if force else own.get(n, "") for n in nodes}
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if reason[node]:
                continue
            ups = [u for u in upstream_nodes(graph, node) if reason.get(u)]
            mates = [m for m in ((k, node[1]) for k in siblings(graph, node[0])) if reason.get(m)]
            if ups:
                reason[node] = f"upstream {node_name(ups[0])} is recomputed"
            elif mates:
                reason[node] = f"computed together with {node_name(mates[0])}"
            changed = changed or bool(reason[node])
    return [Decision(n, reason[n]) for n in nodes]


# ---- through Dagster -----------------------------------------------------------------------------
def observe_registry_entries(api: DagsterAPI, defs: Definitions, timeout: float = 600) -> None:
    """Record the registry's entries as ``registry_entry`` and ``registry_analysis`` data versions: one observation
    run, launched and executed by Dagster (what the registry sensor requests when the file changes)."""
    graph = defs.resolve_asset_graph()
    sources = [k for k in REGISTRY_SOURCES if graph.has(k)]
    if not sources:
        return
    run_id = api.launch_run(sources, tags={DEMO_TAG: "1"}, run_config=run_config(defs, sources, "WARNING"))
    run = api.wait_run(run_id, timeout=timeout)
    if run.status != "SUCCESS":
        raise RuntimeError(f"observing the registry entries failed ({run.status}); see {api.url}/runs/{run.run_id}")


def run_config(defs: Definitions, keys: list[AssetKey], log_level: str) -> dict:
    """Run config of the demo's runs: the console log level, and each run's steps in its run worker where the
    location keeps Dagster's default executor (its ``in_process`` choice: one code import per run, not one per step;
    the project's own location sets ``in_process_executor`` for every run)."""
    config: dict = {"loggers": {"console": {"config": {"log_level": log_level}}}}
    job = defs.resolve_implicit_job_def_def_for_assets(keys)
    if job is not None and job.executor_def is multi_or_in_process_executor:
        config["execution"] = {"config": {"in_process": {}}}
    return config


# ---- the demo ----------------------------------------------------------------------------------
def report_location(storage: Storage) -> str:
    path = storage.local_path(REPORT_REL)
    return path.as_uri() if path is not None else storage.uri(REPORT_REL)


def run_demo(api: DagsterAPI, defs: Definitions, instance: DagsterInstance, registry: Registry, storage: Storage, *,
             group: str = "demo", models: Iterable[str] = (), dry_run: bool = False, force: bool = False,
             log_level: str = "INFO", verbose: bool = False, out: TextIO = sys.stdout, poll_s: float = POLL_S,
             health: Health | None = None) -> int:
    """Plan with Dagster's staleness and execute the plan as one asset backfill through ``api`` (a webserver whose
    instance runs the backfill daemon); return the number of failed or skipped asset partitions (0 = success).
    ``health`` (:func:`qk_assets.cli.preflight.instance_problem`) is asked while the backfill is followed."""
    with partition_loading_context(dynamic_partitions_store=instance):
        return _run_demo(api, defs, instance, registry, storage, group=group, models=models, dry_run=dry_run,
                         force=force, log_level=log_level, verbose=verbose, out=out, poll_s=poll_s, health=health)


def _run_demo(api: DagsterAPI, defs: Definitions, instance: DagsterInstance, registry: Registry, storage: Storage, *,
              group: str, models: Iterable[str], dry_run: bool, force: bool, log_level: str, verbose: bool,
              out: TextIO, poll_s: float, health: Health | None = None) -> int:

    def say(msg: str) -> None:
        print(msg, file=out, flush=True)

    graph = defs.resolve_asset_graph()
    models = list(models)
    chosen = group_models(registry, group, models)
    if not chosen:
        say(f"demo: no model of group '{group}' matches {models}")
        return 1
    added = sync_instance(instance, registry)
    if added:
        say("demo: partitions added from the registry: "
            + "; ".join(f"{dim} {', '.join(keys)}" for dim, keys in added.items()))
    if not dry_run and (open_ids := api.open_backfills({DEMO_TAG: "1"})):  # e.g. of a demo that was killed
        say(f"demo: backfill {open_ids[0]} of an earlier demo is still in progress; following it first "
            f"({api.url}/runs/b/{open_ids[0]})")
        run_backfill(api, open_ids[0], say, poll_s, health)
    t0 = time.monotonic()
    observe_registry_entries(api, defs)  # registry edits reach Dagster's staleness as data versions
    say(f"demo: registry entries observed in {time.monotonic() - t0:.0f} s")
    nodes, notes = select_nodes(graph, registry, group, models, instance)
    say(f"demo: {len(nodes)} asset partitions for the '{group}' models "
        f"({', '.join(chosen)}); Dagster instance {instance.root_directory}; "
        f"storage {storage.url}")
    for note in notes:
        say(f"  note: {note}")
    say(f"demo: asked Dagster ({api.url}) what is missing or stale")
    decisions = decide(graph, nodes, dagster_reasons(api, nodes), force=force)
    todo = [d.node for d in decisions if d.reason]
    fresh = [d for d in decisions if not d.reason]
    if fresh and verbose:
        for d in fresh:
            say(f"  ok   {node_name(d.node):<48} up to date")
    elif fresh:
        say(f"  ok   {len(fresh)} asset partitions are up to date (--verbose lists them)")
    for d in decisions:
        if d.reason:
            say(f"  run  {node_name(d.node):<48} {d.reason}")
    if not todo:
        say("demo: everything is up to date; nothing to compute")
    if dry_run or not todo:
        if not dry_run:
            _say_report(say, storage, api)
        return 0
    keys = sorted({k for k, _ in todo}, key=lambda k: k.to_user_string())
    backfill_id = api.launch_backfill(partitions_of(todo), tags={DEMO_TAG: "1"}, title="make demo",
                                      run_config=run_config(defs, keys, log_level))
    t_start = time.monotonic()
    say(f"demo: launched backfill {backfill_id} of {len(todo)} asset partitions; Dagster's daemon runs it "
        f"({api.url}/runs/b/{backfill_id})")
    b = run_backfill(api, backfill_id, say, poll_s, health)  # SIGINT / SIGTERM: canceled, then Interrupted
    failed = sum(b.failed.values())
    if not failed and b.status != "COMPLETED_SUCCESS":
        failed = 1
    say(f"demo: backfill {b.status.lower()} in {time.monotonic() - t_start:.0f} s; "
        f"{failed} asset partition(s) failed or skipped")
    for asset, n in sorted(b.failed.items()):
        say(f"  FAILED or skipped: {asset} ({n} partition(s))")
    if b.error:
        say(f"  backfill error: {b.error}")
    _say_report(say, storage, api, rebuilt=REPORT_KEY.to_user_string() not in b.failed)
    return failed


def _say_report(say: Any, storage: Storage, api: DagsterAPI, rebuilt: bool = True) -> None:
    if storage.exists(REPORT_REL):
        say(f"report: {report_location(storage)}" + ("" if rebuilt else " (not rebuilt: report_html was skipped)"))
    else:
        say("report: not built (the report_html asset is not defined or failed)")
    say("runs and materialisations: `make ui`, then http://127.0.0.1:3000")


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qk_assets.cli.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--group", default="demo", help="registry group to materialise (default: demo)")
    parser.add_argument("--models", nargs="+", default=[], metavar="GLOB",
                        help="only these model keys of the group (globs, e.g. 'smollm3-3b@*')")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and why; run nothing")
    parser.add_argument("--force", action="store_true", help="recompute everything in the plan")
    parser.add_argument("--verbose", action="store_true", help="also list the up-to-date asset partitions")
    parser.add_argument("--log-level", default="INFO", help="Dagster console log level of the runs (default INFO)")
    parser.add_argument("--dagster-url", help="use this running `dagster dev` (e.g. `make ui`'s http://127.0.0.1:3000, "
                        "same DAGSTER_HOME; its code location is reloaded first) instead of starting one")
    args = parser.parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("TQDM_DISABLE", "1")  # no carriage-return progress bars in the run log

    if os.environ.get("DAGSTER_HOME") and (problem := instance_problem(Path(os.environ["DAGSTER_HOME"]))):
        print(f"demo: not started: {problem}", file=sys.stderr, flush=True)  # before Dagster opens the instance
        return 2
    defs = build_definitions()
    try:
        instance = DagsterInstance.get()
    except Exception:  # the database went down since the check: say so rather than Dagster's traceback
        if os.environ.get("DAGSTER_HOME") and (problem := instance_problem(Path(os.environ["DAGSTER_HOME"]))):
            print(f"demo: not started: {problem}", file=sys.stderr, flush=True)
            return 2
        raise
    home = Path(instance.root_directory or os.environ.get("DAGSTER_HOME", "."))
    storage = Storage.from_settings()

    def health() -> str | None:
        return instance_problem(home) if instance.root_directory else None

    def say(msg: str) -> None:
        print(f"demo: {msg}", flush=True)

    try:
        with stop_on_signals(), dagster_at(args.dagster_url, home=home, log_path=home / "demo-dagster.log",
                                           say=say) as api:
            failed = run_demo(api, defs, instance, registry(), storage, group=args.group, models=args.models,
                              dry_run=args.dry_run, verbose=args.verbose, force=args.force,
                              log_level=args.log_level, health=health)
    except DemoInterrupted as exc:
        print(f"demo: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:  # the instance's database or volume first: what Dagster says then is a consequence
        problem = str(exc) if isinstance(exc, InstanceError) else health()
        if problem is None and not isinstance(exc, RuntimeError):
            raise
        # else Dagster refused (daemon missing, backfill not launched): its message says why
        print(f"demo: {problem or exc}", file=sys.stderr, flush=True)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
