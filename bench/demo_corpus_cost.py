"""What the second demo corpus (SPEC 10) adds to `make demo`, per demo model: the `code-demo` pair's run
(capture + every per-model analysis; the intervention study is not run there) and the model's
`cross_corpus` run, each executed as one run of the implicit asset job with its steps in process (as the demo's
backfill runs execute them, `in_process` executor), here in this process, with its wall and CPU time.

    export QK_STORAGE_ROOT=<scratch>/storage DAGSTER_HOME=<scratch>/home
    .venv/bin/python bench/demo_corpus_cost.py smollm2-135m pair
    .venv/bin/python bench/demo_corpus_cost.py smollm2-135m cross  # once the model's sotu-demo pair exists too

Results: bench/results/demo_corpus_cost.md (record `uptime` with them; the machine is usually shared).
"""
import resource
import sys
import time

from dagster import AssetKey, DagsterInstance, partition_loading_context

from qk_assets.cli.demo import REGISTRY_SOURCES
from qk_assets.definitions import defs
from qk_assets.partitions import registry, sync_instance


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(instance: DagsterInstance, keys: list[AssetKey], partition: str | None = None) -> int:
    """One run of ``keys`` (one partition) in this process; returns the number of materialisations."""
    job = defs.resolve_implicit_job_def_def_for_assets(keys)
    result = job.execute_in_process(instance=instance, asset_selection=keys, partition_key=partition,
                                    raise_on_error=False,
                                    run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})
    return len(result.get_asset_materialization_events())


def timed(label: str, keys: list[AssetKey], partition: str, instance: DagsterInstance) -> None:
    w0, c0 = time.monotonic(), cpu()
    done = run(instance, keys, partition)
    print(f"{label}: {done} materialisations, wall {time.monotonic() - w0:.1f} s, CPU {cpu() - c0:.1f} s",
          flush=True)


model, what = sys.argv[1], sys.argv[2]
instance = DagsterInstance.get()
graph = defs.resolve_asset_graph()
with partition_loading_context(dynamic_partitions_store=instance):
    sync_instance(instance, registry())
    run(instance, list(REGISTRY_SOURCES))
    if what == "pair":
        timed("corpus[code-demo]", [AssetKey("corpus")], "code-demo", instance)
        keys = sorted((k for k in graph.get_all_asset_keys() if graph.get(k).is_materializable
                       and graph.get(k).partitions_def is not None
                       and getattr(graph.get(k).partitions_def, "partitions_defs", None)),
                      key=lambda k: k.to_user_string())
        timed(f"code-demo|{model} (capture + analyses)", keys, f"code-demo|{model}", instance)
    else:
        keys = sorted((k for k in graph.get_all_asset_keys() if k.to_user_string().startswith("cross_corpus")),
                      key=lambda k: k.to_user_string())
        timed(f"cross_corpus[{model}]", keys, model, instance)
