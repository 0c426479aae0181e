"""What the second demo corpus (SPEC 10) adds to `make demo`, per demo model: the `code-demo` pair's run
(capture + every per-model analysis; the intervention study is not run there) and the model's
`cross_corpus` run, each executed as the demo executes it (qk_assets.demo.run_step), with wall and CPU time
of this process (the runs execute in process).

    export QK_STORAGE_ROOT=<scratch>/storage DAGSTER_HOME=<scratch>/home
    .venv/bin/python bench/demo_corpus_cost.py smollm2-135m pair
    .venv/bin/python bench/demo_corpus_cost.py smollm2-135m cross  # once the model's sotu-demo pair exists too

Results: bench/results/demo_corpus_cost.md (record `uptime` with them; the machine is usually shared).
"""
import resource
import sys
import time

from dagster import AssetKey, DagsterInstance, partition_loading_context

from qk_assets import defs
from qk_assets.demo import Step, fail_dead_demo_runs, observe_registry_entries, run_step
from qk_assets.partitions import registry, sync_instance


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(label, step, instance):
    w0, c0 = time.monotonic(), cpu()
    done = run_step(defs, instance, step, {}, "WARNING")
    print(f"{label}: {len(done)} materialisations, wall {time.monotonic() - w0:.1f} s, CPU {cpu() - c0:.1f} s",
          flush=True)


model, what = sys.argv[1], sys.argv[2]
instance = DagsterInstance.get()
print("runs of the interrupted demo marked failed (their pool slots freed):", fail_dead_demo_runs(instance))
graph = defs.resolve_asset_graph()
with partition_loading_context(dynamic_partitions_store=instance):
    sync_instance(instance, registry())
    observe_registry_entries(defs, instance)
    if what == "pair":
        timed("corpus[code-demo]", Step("code-demo", [AssetKey("corpus")]), instance)
        keys = sorted((k for k in graph.get_all_asset_keys() if graph.get(k).is_materializable
                       and graph.get(k).partitions_def is not None
                       and getattr(graph.get(k).partitions_def, "partitions_defs", None)),
                      key=lambda k: k.to_user_string())
        timed(f"code-demo|{model} (capture + analyses)", Step(f"code-demo|{model}", keys), instance)
    else:
        keys = sorted((k for k in graph.get_all_asset_keys() if k.to_user_string().startswith("cross_corpus")),
                      key=lambda k: k.to_user_string())
        timed(f"cross_corpus[{model}]", Step(model, keys), instance)
