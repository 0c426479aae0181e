"""Backfill one checkpoint series in one action: ``make backfill SERIES=<series>`` (``ARGS=--with-upstream``),
i.e. ``python -m qk_assets.cli.backfill <series> [--corpus C] [--with-upstream] [--url U]`` with ``DAGSTER_HOME``
set.

Launches one Dagster *asset backfill* (the daemon executes it), as ``make demo`` and the UI's *Materialize* do,
through ``qk_assets.cli.dagster_api``: with ``--url`` through that running ``dagster dev`` (``make ui``; the command
returns once it is launched), otherwise through a ``dagster dev`` it starts for the backfill's duration, following it
per partition until it ends (SIGINT / SIGTERM cancel it and exit 128 + the signal). The backfill holds exactly the
series' checkpoints on one corpus — every (model, corpus) asset (capture and all per-model analyses) for the
partitions ``<corpus>|<series>@<revision>`` — and nothing else: not the other model keys, not the other corpora.
The series and its checkpoints come from the registry, never from code.

The corpus partition the checkpoints read must exist first. When it was never materialised the command
stops before launching anything and says so, naming the partition and the fix; with ``--with-upstream``
the corpus partition joins the same backfill and Dagster runs it before the checkpoints. With ``make ui``
running, the trajectory follows by automation once the checkpoints' metrics land.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from dagster import AssetKey, DagsterInstance, Definitions

from qk_assets.cli.dagster_api import DagsterAPI, Interrupted, dagster_at, run_backfill, stop_on_signals
from qk_assets.cli.preflight import InstanceError, instance_problem
from qk_assets.definitions import build_definitions, per_model_keys
from qk_assets.partitions import pair_key, registry, sync_instance
from qk_core.config.registry import Registry, RegistryError

CORPUS = AssetKey("corpus")
SERIES_TAG = "qk/series"


class BackfillError(RuntimeError):
    """The backfill cannot start; the message names what is missing and the fix."""


def series_partitions(defs: Definitions, registry: Registry, series: str,
                      corpus: str | None = None) -> tuple[str, dict[AssetKey, list[str]]]:
    """The corpus and, per (model, corpus) asset, the partition keys of the series' checkpoints."""
    if series not in registry.series:
        raise BackfillError(f"{registry.path}: no series '{series}'; series: {', '.join(registry.series) or '(none)'}")
    keys = registry.series[series].checkpoint_keys
    corpus = corpus or registry.model(keys[0]).corpus
    if corpus not in registry.corpora:
        raise BackfillError(f"{registry.path}: unknown corpus '{corpus}'; corpora: {', '.join(registry.corpora)}")
    unlisted = [k for k in keys if corpus not in registry.model(k).corpora]
    if unlisted:
        raise BackfillError(f"{registry.path}: series '{series}' does not list corpus '{corpus}' (field 'corpora') "
                            f"for {', '.join(unlisted)}; add it there first")
    parts = [str(pair_key(k, corpus)) for k in keys]
    return corpus, {key: parts for key in per_model_keys(list(defs.assets or []))}


def plan_series_backfill(instance: DagsterInstance, defs: Definitions, registry: Registry, series: str,
                         corpus: str | None = None, with_upstream: bool = False
                         ) -> tuple[dict[AssetKey, list[str]], list[str]]:
    """What the series' backfill holds (per asset, its partitions) and lines to print; refuses, naming the fix,
    when the corpus partition was never materialised and ``with_upstream`` is off."""
    corpus, partitions = series_partitions(defs, registry, series, corpus)
    lines = []
    if corpus not in instance.get_materialized_partitions(CORPUS):
        if not with_upstream:
            raise BackfillError(
                f"corpus[{corpus}] was never materialised, and every checkpoint of '{series}' reads it. Fix: run "
                f"`make backfill SERIES={series} ARGS='--corpus {corpus} --with-upstream'` (the corpus runs "
                f"first, in the same backfill), or materialise it in the UI: Assets > corpus > Materialize > "
                f"{corpus}.")
        partitions = {CORPUS: [corpus], **partitions}
        lines.append(f"corpus[{corpus}] (never materialised: runs first)")
    lines.append(f"{len(partitions) - (1 if CORPUS in partitions else 0)} per-model assets x "
                 f"{len(registry.series[series].checkpoint_keys)} checkpoints of '{series}' on '{corpus}'")
    return partitions, lines


def launch_series_backfill(api: DagsterAPI, instance: DagsterInstance, defs: Definitions, registry: Registry,
                           series: str, corpus: str | None = None,
                           with_upstream: bool = False) -> tuple[str, list[str]]:
    """Launch the series' backfill; returns its id and what it holds (lines to print)."""
    partitions, lines = plan_series_backfill(instance, defs, registry, series, corpus, with_upstream)
    backfill_id = api.launch_backfill(dict(partitions), tags={SERIES_TAG: series})
    return backfill_id, lines


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qk_assets.cli.backfill", description=__doc__.split("\n")[0])
    parser.add_argument("series", help="a [series.<name>] of the registry, e.g. smollm3-3b")
    parser.add_argument("--corpus", help="the corpus to capture on (default: the series' first corpus)")
    parser.add_argument("--with-upstream", action="store_true",
                        help="include the corpus partition when it was never materialised (it runs first)")
    parser.add_argument("--url", help="a running `dagster dev` (e.g. `make ui`'s http://127.0.0.1:3000) on the same "
                        "DAGSTER_HOME; default: start one for the backfill's duration")
    args = parser.parse_args(list(argv) if argv is not None else None)

    if not os.environ.get("DAGSTER_HOME"):
        print("backfill: not launched: DAGSTER_HOME is not set (the instance `make ui` runs on); run "
              f"`make backfill SERIES={args.series}` or set DAGSTER_HOME", file=sys.stderr)
        return 2
    home = Path(os.environ["DAGSTER_HOME"])
    if problem := instance_problem(home):  # before Dagster opens the instance
        print(f"backfill: not launched: {problem}", file=sys.stderr)
        return 2
    defs = build_definitions()
    try:
        instance = DagsterInstance.get()
    except Exception:  # the database went down since the check: say so rather than Dagster's traceback
        if problem := instance_problem(home):
            print(f"backfill: not launched: {problem}", file=sys.stderr)
            return 2
        raise

    def say(msg: str) -> None:  # on stderr: stdout's first line is the launched backfill's id
        print(f"backfill: {msg}", file=sys.stderr, flush=True)

    try:
        sync_instance(instance, registry())  # what the registry sensor would add on its next tick
        partitions, lines = plan_series_backfill(instance, defs, registry(), args.series, args.corpus,
                                                 args.with_upstream)  # refused before Dagster is asked anything
        with stop_on_signals(), dagster_at(args.url, home=home, log_path=home / "backfill-dagster.log", say=say) as api:
            backfill_id = api.launch_backfill(dict(partitions), tags={SERIES_TAG: args.series})
            print(f"backfill {backfill_id} launched: " + "; ".join(lines), flush=True)
            print(f"follow it at {api.url}/runs/b/{backfill_id}", flush=True)
            if args.url:
                return 0
            b = run_backfill(api, backfill_id, say, health=lambda: instance_problem(home))
    except Interrupted as exc:
        print(f"backfill: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except (BackfillError, RegistryError) as exc:
        print(f"backfill: not launched: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # no webserver at --url (connection refused, timeout)
        print(f"backfill: not launched: no Dagster webserver answers at {args.url} ({exc}); start it with "
              "`make ui` or leave --url out", file=sys.stderr)
        return 2
    except Exception as exc:  # the instance's database or volume first: what Dagster says then is a consequence
        problem = str(exc) if isinstance(exc, InstanceError) else instance_problem(home)
        if problem is None and not isinstance(exc, RuntimeError):
            raise
        print(f"backfill: {problem or exc}", file=sys.stderr)  # else Dagster refused the backfill: it says why
        return 2
    say(f"{b.status.lower()}" + "".join(f"; {asset}: {n} partition(s) failed or skipped"
                                        for asset, n in sorted(b.failed.items())))
    return 0 if b.status == "COMPLETED_SUCCESS" else 1


if __name__ == "__main__":
    sys.exit(main())
