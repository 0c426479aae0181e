"""One model's capture sharded by document over the GPU workers of a Ray cluster (SPEC 1.9; issue 12).

Scheduling, placement and retries are Ray's: every shard is one Ray task requesting ``num_gpus``
(Ray sets ``CUDA_VISIBLE_DEVICES`` for it), which loads the model once and runs
:func:`qk_core.capture.capture_model` on its documents with ``finalize=False``, so each document is
committed to the shared storage root by the capture store's own atomic per-document commit. Documents
go to shards round-robin in corpus order. A shard whose worker or node dies is retried by Ray
(``max_retries``) on any worker with a free GPU; the retry skips the documents already committed, so
nothing is lost or written twice. When every shard has returned, the driver checks that every document
is committed and runs the one ``finalize()`` (fan-out, checksums, verification, as for one worker).

The result is bit-identical to a single-worker capture: the fingerprint, head manifest and positions
depend only on the entry and the whole corpus, a document's rows only on that document, and
``finalize()`` reads the document files in name order whoever wrote them.

While the shards run, the driver watches the cluster (:func:`qk_core.runtime.cluster.wait_for_tasks`):
each shard's start, a node's death and a shard started again by Ray are events in ``log``; a request no
node can hold (``num_gpus = 2`` on one-GPU nodes, no GPU worker at all) fails after
``QK_RAY_SCHEDULE_TIMEOUT_S`` naming the request and what the cluster offers.

Workers need this package importable and the storage credentials in their own environment
(``AWS_*``); only the storage root and endpoint URL travel with the task.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pandas as pd

from qk_core.capture.run import CaptureResult, _result_from_storage, capture_model
from qk_core.capture.store import CaptureError, CaptureWriter
from qk_core.config.registry import ModelEntry
from qk_core.io.storage import Storage
from qk_core.runtime.cluster import RayScheduleError, _tracked, start_tracker, wait_for_tasks


def shard_documents(example_ids: list[int], n_shards: int) -> list[list[int]]:
    """Round-robin split of the corpus's example ids into at most ``n_shards`` non-empty shards."""
    if n_shards < 1:
        raise ValueError(f"n_shards must be >= 1, got {n_shards}")
    shards = [list(example_ids[i::n_shards]) for i in range(n_shards)]
    return [s for s in shards if s]


def capture_shard(entry: ModelEntry, corpus: pd.DataFrame, storage_root: str, s3_endpoint_url: str | None,
                  corpus_name: str | None, doc_ids: list[int], device: str) -> dict[str, Any]:
    """Body of one shard task: capture ``doc_ids`` into the shared root without finalizing."""
    import ray

    t0 = time.perf_counter()
    result = capture_model(entry, corpus, Storage(storage_root, s3_endpoint_url), corpus_name=corpus_name,
                           device=device, only_docs=doc_ids, finalize=False)
    return {"prefix": result.prefix, "captured": result.captured_docs, "skipped": result.skipped_docs,
            "tokens": result.tokens, "forward_s": result.seconds, "task_s": time.perf_counter() - t0,
            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
            "already_complete": result.already_complete}


def capture_sharded(entry: ModelEntry, corpus: pd.DataFrame, storage: Storage, *, n_shards: int,
                    num_gpus: float = 1.0, corpus_name: str | None = None, device: str = "auto",
                    max_retries: int = 3, log: Any = None, schedule_timeout_s: float | None = None) -> CaptureResult:
    """Capture ``entry`` over ``corpus`` with ``n_shards`` Ray tasks on the connected cluster, then finalize.

    ``ray.init(address=...)`` must have been called (the caller owns the connection). Returns the same
    :class:`CaptureResult` as :func:`capture_model`, with ``shards``: what each task reported (documents
    captured and found committed, node, pid, timings). ``schedule_timeout_s`` (default
    ``QK_RAY_SCHEDULE_TIMEOUT_S``) bounds the wait while no node can hold one shard's request.
    """
    import ray

    if not ray.is_initialized():
        raise CaptureError(f"{entry.key}: no Ray connection; call ray.init(address=...) before a sharded capture")
    docs = corpus[["example_id", "text"]].reset_index(drop=True)
    if entry.capture.max_docs:
        docs = docs.head(entry.capture.max_docs)
    ids = [int(e) for e in docs["example_id"]]
    shards = shard_documents(ids, n_shards)
    task = ray.remote(_tracked)
    corpus_ref = ray.put(docs)
    tracker = start_tracker()
    t0 = time.perf_counter()
    labels = [f"shard {i} of {entry.key} ({len(shard)} documents)" for i, shard in enumerate(shards)]
    refs = [task.options(name=f"qk_capture_shard:{entry.key}:{i}", num_cpus=1, num_gpus=num_gpus,
                         max_retries=max_retries, retry_exceptions=False).remote(
        tracker, labels[i], capture_shard, entry, corpus_ref, storage.url, storage.s3_endpoint_url, corpus_name,
        shard, device)
        for i, shard in enumerate(shards)]
    try:
        reports = wait_for_tasks(refs, {"CPU": 1.0, "GPU": float(num_gpus)}, labels=labels, tracker=tracker,
                                 log=log, timeout_s=schedule_timeout_s, max_retries=max_retries)
    except RayScheduleError as exc:
        raise CaptureError(f"{entry.key} (registry capture.num_gpus = {num_gpus:g}): {exc}") from None
    prefixes = {r["prefix"] for r in reports}
    if len(prefixes) != 1:
        raise CaptureError(f"{entry.key}: shards wrote to different captures {sorted(prefixes)}")
    prefix = prefixes.pop()
    if storage.exists(f"{prefix}/complete.json"):
        return _result_from_storage(storage, prefix, already_complete=True, skipped_docs=ids, shards=reports)
    manifest = storage.read_json(f"{prefix}/manifest.json")
    writer = CaptureWriter(storage, entry.key, manifest)
    missing = sorted(set(ids) - writer.committed_doc_ids())
    if missing:
        raise CaptureError(f"{storage.uri(prefix)}: documents {missing[:20]} were not committed by any shard")
    summary = writer.finalize(keep_doc_files=entry.capture.keep_doc_files)
    if log is not None:
        log.info(f"{entry.key}: sharded capture of {len(ids)} documents over {len(shards)} Ray tasks in "
                 f"{time.perf_counter() - t0:.1f}s; {sum(summary['rows'].values())} rows")
    captured = sorted(e for r in reports for e in r["captured"])
    skipped = sorted(e for r in reports for e in r["skipped"])
    return _result_from_storage(storage, prefix, captured_docs=captured, skipped_docs=skipped, shards=reports,
                                tokens=sum(r["tokens"] for r in reports), seconds=sum(r["forward_s"] for r in reports),
                                verification=summary["verification"])
