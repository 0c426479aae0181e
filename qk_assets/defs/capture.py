"""Q/K capture, one partition per registry model key (SPEC 1).

Thin wrapper over :func:`qk_core.capture.capture_model`: reads the model's corpus partition, runs on the
torch device resource (GPU when present, CPU otherwise) in the concurrency pool ``gpu`` (one capture
at a time across runs), streams the documents into ``captures/<model>/<fingerprint>/`` and returns one
row per sampled head. Progress (documents done/total, tokens per second) goes to the run log. A rerun
after a crash resumes with the documents not yet committed; a rerun of a complete capture is a no-op.

The blocking asset check ``capture_verified`` checks every committed file of the capture (size and
SHA-256 against ``complete.json``, manifest ownership; SPEC 1.9): a damaged capture fails the check,
naming the file, and nothing downstream of it runs in that run.
"""

import json

import pandas as pd
from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetIn,
    MetadataValue,
    Output,
    asset,
)

from qk_assets.automation import PER_PAIR
from qk_assets.checks import check_spec
from qk_assets.metadata import results_first, table_value
from qk_assets.partitions import listed_pair, model_corpus_partitions
from qk_assets.resources import GPU_POOL, RayClusterResource, StorageResource, TorchDeviceResource
from qk_core.capture import capture_model
from qk_core.capture.run import layers_frame
from qk_core.capture.sharded import capture_sharded
from qk_core.capture.store import verify_capture

HEAD_TABLE_COLUMNS = ["layer", "q_head", "kv_head", "d", "attention_type", "sliding_window", "rope_applied",
                      "n_q_rows", "n_k_rows"]


@asset(
    partitions_def=model_corpus_partitions(),
    ins={"corpus": AssetIn()},  # Dagster maps the corpus partition to the pairs' corpus dimension
    deps=["registry_entry"],
    automation_condition=PER_PAIR,
    pool=GPU_POOL,
    group_name="capture",
    kinds={"pytorch", "parquet"},
    check_specs=[check_spec(  # per partition: each (model, corpus) capture has its own result
        "capture_verified", "qk_capture", blocking=True, partitions_def=model_corpus_partitions(),
        description="Every committed file of the capture has its recorded size and SHA-256, and the manifest "
                    "belongs to its folder (SPEC 1.9); downstream assets do not run on a failed check.")],
    description=(
        "Post-RoPE query/key vectors of sampled heads at sampled positions (SPEC 1), stored under "
        "`captures/<model>/<fingerprint>/`. Value: one row per sampled head (layer, q_head, kv_head, d, "
        "attention_type, sliding_window (-1 for full attention), rope_applied, n_q_rows, n_k_rows, "
        "capture_prefix); per-layer metadata is in the capture manifest. Partitions: every model key times "
        "every corpus, of which the registry asks for the pairs in registry_listing's `pairs`; which of "
        "those are missing: report_html's `registry_pairs`."),
)
def qk_capture(context: AssetExecutionContext, corpus: pd.DataFrame, storage: StorageResource,
               device: TorchDeviceResource, ray: RayClusterResource):
    """Capture one registry model over its corpus; the head manifest and layer metadata are shown here.

    With a Ray cluster set (``QK_RAY_ADDRESS``) the documents are split over ``capture.shards`` Ray tasks
    of ``capture.num_gpus`` GPUs each on the cluster's workers; the stored capture is the same.
    """
    model, corpus_name, entry = listed_pair(context.partition_key)
    store = storage.get()
    if ray.enabled:
        context.log.info(f"{entry.key}: {entry.capture.shards} shard(s) of {entry.capture.num_gpus} GPU(s) each "
                         f"on {ray.name}")
        result = capture_sharded(entry, corpus, store, n_shards=entry.capture.shards,
                                 num_gpus=entry.capture.num_gpus, corpus_name=corpus_name,
                                 device=device.device, log=context.log)
    else:
        result = capture_model(entry, corpus, store, corpus_name=corpus_name, device=device.resolve(),
                               log=context.log)
    man = result.manifest
    tokens = result.doc_tokens
    short = int((tokens["n_tokens"] < entry.window).sum())
    dataset = {k: v for k, v in man["dataset"].items() if k != "example_ids"}
    check = result.verification or verify_capture(store, result.prefix)
    metadata = {
        "capture_path": MetadataValue.path(store.uri(result.prefix)),
        "capture_prefix": result.prefix,
        "fingerprint": result.fingerprint,
        "model": model,
        "corpus": corpus_name,
        "heads": len(result.heads),
        "layers_sampled": int(result.heads["layer"].nunique()),
        "documents": len(tokens),
        "documents_shorter_than_window": short,
        "documents_captured_this_run": len(result.captured_docs),
        "documents_resumed_or_reused": len(result.skipped_docs),
        "tokens_this_run": int(result.tokens),
        "tokens_per_second": float(round(result.tokens_per_s, 1)) if result.tokens else 0.0,
        "model_identity": MetadataValue.json(json.loads(json.dumps(man["model"], default=str))),
        "head_manifest": table_value(result.heads[HEAD_TABLE_COLUMNS], max_rows=1000),
        "layer_metadata": table_value(layers_frame(man), digits=6),
        "document_tokens": table_value(tokens),
    }
    options = {"window": entry.window, "bucket": entry.bucket, "dtype": man["dtype"], "device": man["device"],
               "attention_backend": str(man["model"].get("attn_implementation")), "sampler": man["sampler"],
               "dataset": dataset}
    headline = {k: metadata[k] for k in ("heads", "layers_sampled", "documents", "tokens_per_second")}
    metadata = results_first(headline, metadata, MetadataValue.json(json.loads(json.dumps(options, default=str))))
    yield Output(result.heads, metadata=metadata)
    by_size = int(check["files"]) - int(check["files_hashed"])
    yield AssetCheckResult(
        check_name="capture_verified", asset_key="qk_capture", passed=bool(check["passed"]),
        severity=AssetCheckSeverity.ERROR,
        description=check["error"] or "every committed file verified" + (
            f" ({by_size} by size: finalize's moment merge had just read them back and checked their SHA-256)"
            if by_size else ""),
        metadata={"files_verified": int(check["files"]), "files_hashed": int(check["files_hashed"]),
                  "bytes_verified": int(check["bytes"]), "verify_seconds": float(check["seconds"]),
                  "verified_at_finalize": result.verification is not None})
