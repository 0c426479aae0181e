"""``make demo``: materialise the whole lineage graph for the registry's demo models through Dagster.

``python -m qk_assets.demo [--group demo] [--models GLOB ...] [--dry-run] [--force]``

The demo loads the same code location as the UI (``qk_assets.defs``) and executes its implicit asset
job against ``DagsterInstance.get()`` (the instance under ``$DAGSTER_HOME``), so every run and every
materialisation shows up in ``make ui``. Assets are selected per partition set:

- corpus-partitioned assets: the corpora the demo models read (``sotu-demo``, ``code-demo``);
- (model, corpus)-partitioned assets: every corpus of each demo model (``smollm2-135m``, ``gemma3-270m``),
  one run per pair;
- model-partitioned assets (``cross_corpus``, SPEC 10): the demo models with two or more corpora;
- series-partitioned assets: every series (the SmolLM3 checkpoints need the hub, so the demo's trajectory
  holds the thesis's reference values and marks each checkpoint as missing);
- unpartitioned assets (model report, benchmark joins, cross-model figures, ``report_html``): all.

What to compute is Dagster's answer, not a rule of this module. Before planning, the demo adds the registry's
partitions (what ``registry_partitions_sensor`` does) and observes ``registry_entry`` and ``registry_analysis``
(registry edits become data versions), then asks Dagster, through the GraphQL API of a ``dagster-webserver`` it
starts for the moment (``--dagster-url`` reuses a running one), for the status of every selected asset partition —
the same status the UI shows: *missing*, *stale* with Dagster's causes (new code version — every asset's
code version is a hash of its source, ``qk_assets.versioning`` —, new dependency data version, ...), or
fresh. It recomputes the missing and stale ones, and what depends on them in the plan (their new values
make the dependents stale once written). A second ``make demo`` finds everything fresh and says so.

Runs follow the dependencies: each run holds the assets of one partition whose upstream work is done.
A failed asset skips what depends on it; the report is built regardless (it marks what is missing).

SIGINT (Ctrl-C) or SIGTERM stops the demo: Dagster's in-process execution ends the run in flight as
interrupted, the demo frees that run's pool slots at once (the ``gpu`` pool: a capture elsewhere may
start), starts nothing more and exits with 128 + the signal number. A run still open at that point is
marked canceled. A demo killed outright (SIGKILL) leaves its run open; the next demo fails it and frees
its slots before it starts.
"""

import argparse
import contextlib
import fcntl
import fnmatch
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRunStatus,
    Definitions,
    RunsFilter,
    partition_loading_context,
)

from qk_assets.dagster_api import DagsterAPI, partitions_of, webserver
from qk_assets.partitions import multi_corpus_models, pair_key, sync_instance
from qk_core.config.registry import Registry
from qk_core.io.storage import Storage

DEMO_TAG = "qk/demo"
FAILURE_REASON_TAG = "dagster/failure_reason"  # Dagster's tag on a failed run: why it failed
INTERRUPTED = "UNEXPECTED_TERMINATION"  # ... when a signal interrupted its execution
REPORT_KEY = AssetKey("report_html")
REGISTRY_SOURCES = (AssetKey("registry_entry"), AssetKey("registry_analysis"))
REPORT_REL = "report/index.html"

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


def select_nodes(graph: AssetGraph, registry: Registry, group: str, patterns: Iterable[str] = (),
                 instance: DagsterInstance | None = None) -> tuple[list[Node], list[str]]:
    """The (asset, partition) pairs the demo materialises, and notes on the assets it leaves out."""
    patterns = list(patterns)
    wanted = demo_partition_keys(registry, group, patterns)
    nodes: list[Node] = []
    notes: list[str] = []
    for key in graph.toposorted_asset_keys:
        node = graph.get(key)
        if not node.is_materializable:
            continue
        if node.partitions_def is None:
            nodes.append((key, None))
            continue
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


# ---- grouping into runs -----------------------------------------------------------------------
@dataclass
class Step:
    """One Dagster run: assets of one partition (None: unpartitioned)."""

    partition: str | None
    keys: list[AssetKey] = field(default_factory=list)


def group_steps(graph: AssetGraph, todo_nodes: list[Node], order: list[str | None]) -> Iterator[Step]:
    """Runs in dependency order; each holds every pending asset of one partition that can run now.

    ``order`` ranks partitions when several could run (corpora, then models in registry order, then
    unpartitioned). The caller may drop nodes from ``todo_nodes`` (a list it owns) between steps.
    """
    rank = {p: i for i, p in enumerate(order)}
    while todo_nodes:
        todo = set(todo_nodes)
        deps = {n: [u for u in upstream_nodes(graph, n) if u in todo] for n in todo}
        chosen: list[Node] = []
        for part in sorted({pk for _, pk in todo}, key=lambda p: rank.get(p, len(rank))):
            group = {n for n in todo if n[1] == part}
            changed = True
            while changed:
                bad = {n for n in group if any(u not in group for u in deps[n])}
                changed = bool(bad)
                group -= bad
            if group:
                chosen = [n for n in todo_nodes if n in group]
                break
        if not chosen:
            raise RuntimeError("no runnable step: dependency cycle among " + ", ".join(map(node_name, todo)))
        for n in chosen:
            todo_nodes.remove(n)
        yield Step(chosen[0][1], [k for k, _ in chosen])


# ---- execution --------------------------------------------------------------------------------
@contextmanager
def demo_lock(instance: DagsterInstance) -> Iterator[None]:
    """One demo at a time per instance (a second one waits), so dead demo runs can be cleaned up."""
    home = Path(instance.root_directory) if instance.root_directory else Path(os.environ.get("DAGSTER_HOME", "."))
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".qk-demo.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def free_pool_slots(instance: DagsterInstance, run_id: str) -> None:
    """Free the concurrency-pool slots ``run_id`` holds (what Dagster's daemon does a while after a run ends)."""
    with contextlib.suppress(Exception):  # storage without concurrency support
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)


def fail_dead_demo_runs(instance: DagsterInstance) -> int:
    """Mark runs of an interrupted earlier demo as failed and free their pool slots."""
    runs = instance.get_runs(RunsFilter(tags={DEMO_TAG: "1"}, statuses=[
        DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.NOT_STARTED,
        DagsterRunStatus.QUEUED, DagsterRunStatus.CANCELING]))
    for run in runs:
        instance.report_run_failed(run, "the demo process that ran it is gone")
        free_pool_slots(instance, run.run_id)
    return len(runs)


class DemoInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped the demo (``signum``: which one, None if unknown)."""

    def __init__(self, signum: int | None = None, run: str = "") -> None:
        self.signum = signum
        self.run = run  # what happened to the run in flight
        name = signal.Signals(signum).name if signum else "a signal"
        super().__init__(f"stopped by {name}" + (f"; {run}" if run else ""))

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


@contextmanager
def stop_on_signals() -> Iterator[Callable[[], int | None]]:
    """SIGINT and SIGTERM raise :class:`DemoInterrupted` in the main thread, so what is open is closed (the
    planning webserver, the run in flight). While a run executes, Dagster's in-process execution handles
    both signals itself (it ends the run as interrupted). Yields ``received()``: the last SIGINT / SIGTERM
    that arrived since the previous call, whoever handled it (the interpreter's wakeup fd records them)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return

    def handler(signum: int, _frame: object) -> None:
        raise DemoInterrupted(signum)

    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)

    def received() -> int | None:
        try:
            got = os.read(read_fd, 4096)
        except BlockingIOError:
            return None
        stops = [n for n in got if n in (signal.SIGINT, signal.SIGTERM)]
        return stops[-1] if stops else None

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield received
    finally:
        for sig, old in previous.items():
            if old is not None:
                signal.signal(sig, old)
        signal.set_wakeup_fd(previous_fd)
        os.close(read_fd)
        os.close(write_fd)


def end_run(instance: DagsterInstance, run_id: str, why: str) -> str:
    """Cancel ``run_id`` if it is still open (Dagster's run events, as the UI's *Terminate* records them) and
    free its pool slots at once; returns what became of it."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        return "no run was started"
    if not run.is_finished:
        instance.report_run_canceling(run, why)
        instance.report_run_canceled(run, why)
        run = instance.get_run_by_id(run_id) or run
    free_pool_slots(instance, run_id)
    return f"run {run_id} {run.status.value.lower()}, its pool slots freed"


def run_step(defs: Definitions, instance: DagsterInstance, step: Step, tags: dict[str, str],
             log_level: str, received: Callable[[], int | None] = lambda: None) -> set[Node]:
    """Execute one run; return the nodes it materialised. Raises :class:`DemoInterrupted` when a signal
    arrived during it (``received``, from :func:`stop_on_signals`): the run has ended, its pool slots are free."""
    job = defs.resolve_implicit_job_def_def_for_assets(step.keys)
    if job is None:
        raise RuntimeError("no implicit asset job holds " + ", ".join(k.to_user_string() for k in step.keys))
    run_id = str(uuid.uuid4())
    try:
        result = job.execute_in_process(
            instance=instance, asset_selection=step.keys, partition_key=step.partition, tags=tags,
            run_id=run_id, raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": log_level}}}},
        )
    except DemoInterrupted as exc:  # a signal outside Dagster's handling of the run
        raise DemoInterrupted(exc.signum, end_run(instance, run_id, f"demo {exc}")) from None
    except BaseException:
        end_run(instance, run_id, "the demo stopped on an error")
        raise
    signum = received()
    run = instance.get_run_by_id(run_id)
    if signum is not None or (run is not None and run.tags.get(FAILURE_REASON_TAG) == INTERRUPTED):
        raise DemoInterrupted(signum, end_run(instance, run_id, "demo interrupted"))
    done: set[Node] = set()
    for ev in result.get_asset_materialization_events():
        mat = ev.event_specific_data.materialization
        done.add((mat.asset_key, mat.partition))
    return done


def observe_registry_entries(defs: Definitions, instance: DagsterInstance) -> None:
    """Record the registry's entries as ``registry_entry`` and ``registry_analysis`` data versions (what the
    registry sensor does)."""
    sources = [k for k in REGISTRY_SOURCES if k in defs.resolve_asset_graph().get_all_asset_keys()]
    if not sources:
        return
    job = defs.resolve_implicit_job_def_def_for_assets(sources)
    result = job.execute_in_process(instance=instance, asset_selection=sources, tags={DEMO_TAG: "1"},
                                    raise_on_error=False,
                                    run_config={"loggers": {"console": {"config": {"log_level": "ERROR"}}}})
    if not result.success:
        raise RuntimeError("observing the registry entries failed; see the run in `make ui`")


def _report_apart(steps: Iterable[Step]) -> Iterator[Step]:
    """Run the report in a run of its own, so a failure next to it cannot skip it."""
    for step in steps:
        rest = [k for k in step.keys if k != REPORT_KEY]
        if rest:
            yield Step(step.partition, rest)
        if len(rest) < len(step.keys):
            yield Step(step.partition, [REPORT_KEY])


def report_location(storage: Storage) -> str:
    path = storage.local_path(REPORT_REL)
    return path.as_uri() if path is not None else storage.uri(REPORT_REL)


def partition_order(registry: Registry, group: str, patterns: Iterable[str] = ()) -> list[str | None]:
    models = group_models(registry, group, patterns)
    corpora = sorted({c for m in models for c in registry.model(m).corpora})
    pairs = [str(pair_key(m, c)) for m in models for c in registry.model(m).corpora]
    compared = [m for m in models if m in set(multi_corpus_models(registry))]
    return [*corpora, *pairs, *compared, *sorted(registry.series), None]


def run_demo(defs: Definitions, instance: DagsterInstance, registry: Registry, storage: Storage, **kw: Any) -> int:
    """Plan and execute the demo; return the number of failed asset partitions (0 = success)."""
    with partition_loading_context(dynamic_partitions_store=instance), stop_on_signals() as received:
        return _run_demo(defs, instance, registry, storage, received=received, **kw)


def _run_demo(defs: Definitions, instance: DagsterInstance, registry: Registry, storage: Storage, *,
              group: str = "demo", models: Iterable[str] = (), dry_run: bool = False, force: bool = False,
              log_level: str = "INFO", verbose: bool = False, out=sys.stdout, api: DagsterAPI | None = None,
              received: Callable[[], int | None] = lambda: None) -> int:

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
    try:
        observe_registry_entries(defs, instance)  # registry edits reach Dagster's staleness as data versions
    except RuntimeError:
        if (signum := received()) is not None:  # Dagster ended the observation run on the signal
            raise DemoInterrupted(signum) from None
        raise
    nodes, notes = select_nodes(graph, registry, group, models, instance)
    say(f"demo: {len(nodes)} asset partitions for the '{group}' models "
        f"({', '.join(chosen)}); Dagster instance {instance.root_directory}; "
        f"storage {storage.url}")
    for note in notes:
        say(f"  note: {note}")
    if api is not None:
        own = dagster_reasons(api, nodes)
    else:
        with webserver(log_path=Path(instance.root_directory or ".") / "demo-webserver.log") as web:
            say(f"demo: asked Dagster (webserver {web.url}) what is missing or stale")
            own = dagster_reasons(web, nodes)
    decisions = decide(graph, nodes, own, force=force)
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
    if dry_run:
        return 0
    t_start = time.monotonic()
    failed: set[Node] = set()
    done_any = False
    with demo_lock(instance):
        cleaned = fail_dead_demo_runs(instance)
        if cleaned:
            say(f"demo: marked {cleaned} run(s) of an interrupted earlier demo as failed")
        steps = _report_apart(group_steps(graph, todo, partition_order(registry, group, models)))
        for i, step in enumerate(steps, 1):
            blocked = [k for k in step.keys if k != REPORT_KEY and any(
                u in failed for u in upstream_nodes(graph, (k, step.partition)))]
            keys = [k for k in step.keys if k not in blocked]
            for k in blocked:
                failed.add((k, step.partition))
                say(f"  skip {node_name((k, step.partition))}: an upstream asset failed")
            if not keys:
                continue
            label = step.partition or "unpartitioned"
            say(f"[run {i}] {label}: {', '.join(k.to_user_string() for k in keys)}")
            t0 = time.monotonic()
            tags = {DEMO_TAG: "1"}
            try:
                done = run_step(defs, instance, Step(step.partition, keys), tags, log_level, received)
            except DemoInterrupted as exc:
                say(f"[run {i}] {label}: {exc}; nothing more is started")
                raise
            done_any = True
            missing = [(k, step.partition) for k in keys if (k, step.partition) not in done]
            failed.update(missing)
            status = "ok" if not missing else "FAILED: " + ", ".join(map(node_name, missing))
            say(f"[run {i}] {label}: {status} in {time.monotonic() - t0:.0f} s")
    if done_any:
        say(f"demo: finished in {time.monotonic() - t_start:.0f} s; "
            f"{len(failed)} asset partition(s) failed or skipped")
    if storage.exists(REPORT_REL):
        say(f"report: {report_location(storage)}")
    else:
        say("report: not built (the report_html asset is not defined or failed)")
    say("runs and materialisations: `make ui`, then http://127.0.0.1:3000")
    return len(failed)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qk_assets.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--group", default="demo", help="registry group to materialise (default: demo)")
    parser.add_argument("--models", nargs="+", default=[], metavar="GLOB",
                        help="only these model keys of the group (globs, e.g. 'smollm3-3b@*')")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and why; run nothing")
    parser.add_argument("--force", action="store_true", help="recompute everything in the plan")
    parser.add_argument("--verbose", action="store_true", help="also list the up-to-date asset partitions")
    parser.add_argument("--log-level", default="INFO", help="Dagster console log level (default INFO)")
    parser.add_argument("--dagster-url", help="ask this running webserver (e.g. `make ui`'s http://127.0.0.1:3000; "
                        "its code location is reloaded first) instead of starting one")
    args = parser.parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("TQDM_DISABLE", "1")  # no carriage-return progress bars in the run log

    from qk_assets import defs
    from qk_assets.partitions import registry

    instance = DagsterInstance.get()
    storage = Storage.from_settings()
    api = None
    if args.dagster_url:
        api = DagsterAPI(args.dagster_url)
        api.reload()
    try:
        failed = run_demo(defs, instance, registry(), storage, group=args.group, models=args.models, api=api,
                          dry_run=args.dry_run, verbose=args.verbose,
                          force=args.force, log_level=args.log_level)
    except DemoInterrupted as exc:
        print(f"demo: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
