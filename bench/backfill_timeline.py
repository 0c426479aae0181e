"""Where the wall time of an asset backfill goes (e.g. `make demo`'s): per run, when Dagster's backfill daemon
created it, when the run queue started it and when it ended, relative to the backfill's launch, and how long
after the last run end before it the daemon created it (a wait for the daemon's next tick, 30 s apart).

    DAGSTER_HOME=dagster_home .venv/bin/python bench/backfill_timeline.py [BACKFILL_ID]   # default: the last demo's

Prints a Markdown table and the totals: time waiting for a backfill tick, time queued, time running.
"""

from __future__ import annotations

import sys

from dagster import DagsterInstance, RunsFilter


def main(argv: list[str]) -> int:
    with DagsterInstance.get() as instance:
        backfills = [b for b in instance.get_backfills() if b.tags.get("qk/demo") == "1"]
        if not argv and not backfills:
            print("no backfill of `make demo` in this instance; pass a backfill id", file=sys.stderr)
            return 2
        backfill = instance.get_backfill(argv[0]) if argv else backfills[0]
        if backfill is None:
            print(f"no backfill {argv[0]} in this instance", file=sys.stderr)
            return 2
        t0 = backfill.backfill_timestamp
        records = sorted(instance.get_run_records(RunsFilter(tags={"dagster/backfill": backfill.backfill_id})),
                         key=lambda r: r.create_timestamp.timestamp())
        end = (backfill.backfill_end_timestamp or max((r.end_time or t0) for r in records)) - t0
        print(f"backfill {backfill.backfill_id}: {backfill.status.value}, {len(records)} runs, "
              f"{end:.0f} s from launch to end\n")
        print("| partition | assets | created (s) | tick wait (s) | to start (s) | started (s) | ran (s) | ended (s) "
              "| status |")
        print("|---|---|---|---|---|---|---|---|---|")
        ends: list[float] = []
        waits = queued = ran = 0.0
        for r in records:
            run = r.dagster_run
            created = r.create_timestamp.timestamp() - t0
            before = [e for e in ends if e <= created]
            wait = created - max(before) if before else created
            waits += wait
            cells = ["-"] * 4
            if r.start_time:
                start = r.start_time - t0
                queued += start - created
                cells[:2] = [f"{start - created:.1f}", f"{start:.1f}"]
                if r.end_time:
                    stop = r.end_time - t0
                    ran += stop - start
                    cells[2:] = [f"{stop - start:.1f}", f"{stop:.1f}"]
                    ends.append(stop)
            print(f"| {run.tags.get('dagster/partition', '(none)')} | {len(run.asset_selection or [])} | {created:.1f} "
                  f"| {wait:.1f} | {' | '.join(cells)} | {run.status.value} |")
        print(f"\ntotal: waiting for a backfill tick {waits:.0f} s (summed over runs; the first row's is launch to "
              f"first tick), created to started (queue, launch, code import) {queued:.0f} s, running {ran:.0f} s "
              "(runs overlap)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
