"""Capture orchestration: one registry model over one corpus into one stored capture (SPEC 1).

:func:`capture_model` resolves the model's identity (config only), derives the capture fingerprint and
returns at once when that capture is already complete. Otherwise it loads the model, probes its layers
(SPEC 1.4, 1.8), samples heads (1.5), and runs one backbone forward per document (1.3: batch 1, no LM
head, no KV cache, plain causal; up to the last layer it reads) under a
:class:`~qk_core.capture.hook.CaptureSession`, committing each finished document atomically (1.9). Documents
already committed are skipped, so a killed run resumes.
Nothing becomes visible before the first document has been captured and validated, and a reader sees
the capture only after ``finalize()`` wrote ``complete.json``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from qk_core.capture.layers import LayerInfo, LayerSelectionError, describe_layers, select_layers, variant_problems
from qk_core.capture.moments import LayerMoments, MomentPlan
from qk_core.capture.sampling import bernoulli_positions, kv_head_of, sample_heads, stratified_positions
from qk_core.capture.store import (
    SCHEMA_VERSION,
    CaptureError,
    CaptureReader,
    CaptureWriter,
    capture_prefix,
    fingerprint,
    head_file,
)
from qk_core.config.registry import ModelEntry
from qk_core.io.storage import Storage
from qk_core.models.loading import (
    LoadedModel,
    load_config,
    load_model,
    load_tokenizer,
    model_identity,
    resolve_device,
    resolve_dtype,
)
from qk_core.runtime.host_memory import release_freed_memory

CAPTURE_VERSION = 1  # bump when a change alters captured values for the same options
VALUE_COLUMNS = ["layer", "q_head", "kv_head", "d", "attention_type", "sliding_window", "rope_applied",
                 "n_q_rows", "n_k_rows", "capture_prefix"]
LAYER_COLUMNS = ["layer", "attention_type", "sliding_window", "rope_applied", "rope_type", "rope_theta",
                 "rope_factor", "rope_original_context", "qk_norm", "scaling", "query_scaling", "head_dim",
                 "n_q", "n_kv", "module", "eligible", "sampled_heads"]

_log = logging.getLogger(__name__)


@dataclass
class CaptureResult:
    """What a capture run produced (value rows, manifest, per-layer metadata, run statistics)."""

    prefix: str
    fingerprint: str
    manifest: dict[str, Any]
    heads: pd.DataFrame  # the qk_capture value, VALUE_COLUMNS
    layers: pd.DataFrame  # per-layer metadata, LAYER_COLUMNS
    doc_tokens: pd.DataFrame  # example_id, n_tokens
    captured_docs: list[int] = field(default_factory=list)  # captured in this run
    skipped_docs: list[int] = field(default_factory=list)  # already committed before this run
    tokens: int = 0  # tokens forwarded in this run
    seconds: float = 0.0  # wall time of the forwards of this run
    already_complete: bool = False
    verification: dict[str, Any] | None = None  # CaptureReader.verify() of this run's finalize, if any
    shards: list[dict[str, Any]] = field(default_factory=list)  # per Ray task of a sharded capture

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


# ---- identity --------------------------------------------------------------------------------
def dataset_identity(corpus: pd.DataFrame, corpus_name: str | None) -> dict[str, Any]:
    """Which documents a capture read: corpus name, count, and a hash of (example_id, content hash)."""
    h = hashlib.sha256()
    for eid, text in zip(corpus["example_id"], corpus["text"], strict=True):
        h.update(f"{int(eid)}:{hashlib.sha256(str(text).encode()).hexdigest()};".encode())
    return {"corpus": corpus_name, "n_docs": len(corpus), "docs_sha256": h.hexdigest(),
            "example_ids": [int(e) for e in corpus["example_id"]]}


def sampler_settings(entry: ModelEntry) -> dict[str, Any]:
    """The capture options that determine captured rows (``keep_doc_files``, ``shards`` and ``num_gpus`` only
    decide what is kept and where it runs; the ``moments`` options add files beside the rows, SPEC 12.1)."""
    opts = asdict(entry.capture)
    for key in ("keep_doc_files", "moments", "moment_dtype", "lw_intensity", "moment_groups", "shards", "num_gpus"):
        opts.pop(key, None)
    opts["layers"] = list(opts.get("layers") or []) or None
    return opts


def capture_identity(entry: ModelEntry, config: Any, corpus: pd.DataFrame, corpus_name: str | None,
                     dtype: str, intervention: Any = None,
                     heads: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """Everything that determines captured values; its hash is the capture fingerprint (SPEC 1.9).

    A capture under an intervention (SPEC 11.3) or of an explicit head list adds those to the identity
    (a plain capture's identity, hence its fingerprint, is unchanged).
    """
    extra: dict[str, Any] = {}
    if intervention is not None:
        extra["intervention"] = intervention.identity()
    if heads is not None:
        extra["heads"] = [list(h) for h in sorted(heads)]
    return {**extra,
        "capture_version": CAPTURE_VERSION,
        "model": model_identity(entry, config),
        "dtype": dtype,
        "window": entry.window,
        "bucket": entry.bucket,
        "sampler": sampler_settings(entry),
        "dataset": dataset_identity(corpus, corpus_name),
        "tokenization": {"truncation": "right", "max_length": entry.window, "add_special_tokens": True},
    }


def _software() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


# ---- layers and heads ------------------------------------------------------------------------
def _under(loaded: LoadedModel, intervention: Any) -> contextlib.AbstractContextManager[Any]:
    """The write hook a capture runs under (SPEC 11.3), attached to the backbone's attention session beside
    the capture: it runs first, the capture sees its result."""
    if intervention is None:
        return contextlib.nullcontext()
    from qk_core.capture.attention import attach  # torch loads only when capture runs

    problem = intervention.capture_problem()
    if problem:
        raise CaptureError(problem)
    return attach(loaded.backbone, intervention)


def probe_layers(loaded: LoadedModel, include_sliding: bool, intervention: Any = None) -> list[LayerInfo]:
    """Run a few tokens through the backbone under the capture function and describe every layer."""
    import torch

    from qk_core.capture import hook  # module import: torch loads only when capture runs

    ids = list(loaded.tokenizer("Probe of the attention layers.")["input_ids"])[:16] or [0, 1]
    x = torch.tensor([ids], device=loaded.device)
    with hook.CaptureSession(loaded.backbone) as session, _under(loaded, intervention), torch.inference_mode():
        session.set_positions({})
        loaded.backbone(input_ids=x, use_cache=False)
        calls = dict(session.calls)
    return describe_layers(loaded.backbone.config, calls, include_sliding)


def plan_heads(entry: ModelEntry, infos: list[LayerInfo],
               explicit: list[tuple[int, int]] | None = None) -> list[dict[str, int]]:
    """The head manifest: sampled (layer, q_head) with kv_head = floor(h·n_kv/n_q) and d (SPEC 1.5).

    ``explicit`` (layer, q_head) pairs replace the sampler (a recapture of chosen heads, SPEC 11.3).
    """
    opts = entry.capture
    by_layer = {i.layer: i for i in infos}
    if explicit is not None:
        out = []
        for layer, h in sorted(explicit):
            info = by_layer.get(int(layer))
            if info is None or not 0 <= int(h) < int(info.n_q or 0):
                raise CaptureError(f"{entry.key}: requested head (layer {layer}, q_head {h}) does not exist")
            out.append({"layer": int(layer), "q_head": int(h), "kv_head": kv_head_of(int(h), int(info.n_q),
                        int(info.n_kv)), "d": int(info.head_dim)})
        return out
    requested = list(getattr(opts, "layers", None) or []) or None
    try:
        chosen = select_layers(infos, requested, opts.include_sliding)
    except LayerSelectionError as exc:
        raise CaptureError(f"{entry.key}: {exc}") from exc
    pool = [(layer, h) for layer in chosen for h in range(int(by_layer[layer].n_q or 0))]
    heads = sample_heads(pool, opts.heads, opts.seed)
    return [{"layer": layer, "q_head": h,
             "kv_head": kv_head_of(h, int(by_layer[layer].n_q), int(by_layer[layer].n_kv)),
             "d": int(by_layer[layer].head_dim)} for layer, h in heads]


def plan_moments(entry: ModelEntry, infos: list[LayerInfo], enabled: bool = True) -> MomentPlan:
    """Every query head and KV head (with each query head's KV head row) whose SPEC 12.1 moments the capture
    accumulates over every position, in the layers the head sampler draws from (1.4), with the entry's bucket
    and moment options; no layer when not ``enabled``."""
    out: dict[int, tuple[list[int], list[int], list[int]]] = {}
    if enabled:
        requested = list(getattr(entry.capture, "layers", None) or []) or None
        try:
            chosen = select_layers(infos, requested, entry.capture.include_sliding)
        except LayerSelectionError as exc:
            raise CaptureError(f"{entry.key}: {exc}") from exc
        by_layer = {i.layer: i for i in infos}
        for layer in sorted(chosen):
            n_q, n_kv = int(by_layer[layer].n_q or 0), int(by_layer[layer].n_kv or 0)
            if n_q and n_kv:
                out[layer] = (list(range(n_q)), list(range(n_kv)), [kv_head_of(h, n_q, n_kv) for h in range(n_q)])
    return MomentPlan(out, int(entry.bucket), -(-int(entry.window) // int(entry.bucket)), entry.capture.moment_dtype,
                      entry.capture.lw_intensity, entry.capture.moment_groups)


def _layer_plan(heads: list[dict[str, int]]) -> dict[int, tuple[list[int], list[int]]]:
    plan: dict[int, tuple[list[int], list[int]]] = {}
    for h in heads:
        q, kv = plan.setdefault(h["layer"], ([], []))
        q.append(h["q_head"])
        if h["kv_head"] not in kv:
            kv.append(h["kv_head"])
    return {layer: (sorted(q), sorted(kv)) for layer, (q, kv) in sorted(plan.items())}


def document_positions(entry: ModelEntry, n_tokens: int, doc_id: int,
                       layers: list[int]) -> np.ndarray | dict[tuple[int, str], np.ndarray]:
    """Positions of one document: one shared array (stratified) or one per (layer, kind) (bernoulli)."""
    o = entry.capture
    if o.position_sampler == "stratified":
        return stratified_positions(n_tokens, entry.bucket, o.per_bucket, o.seed, doc_id)
    return {(layer, kind): bernoulli_positions(n_tokens, entry.bucket, o.bernoulli_rate, o.seed, doc_id, layer, kind)
            for layer in layers for kind in ("q", "k")}


# ---- value and metadata tables ---------------------------------------------------------------
def layers_frame(manifest: dict[str, Any]) -> pd.DataFrame:
    counts = pd.Series([h["layer"] for h in manifest["heads"]]).value_counts()
    df = pd.DataFrame(manifest["layers"])
    df["sampled_heads"] = df["layer"].map(counts).fillna(0).astype(int)
    df["query_scaling"] = df["query_scaling"].map(lambda v: "" if v is None else str(v))
    return df[LAYER_COLUMNS]


def heads_frame(manifest: dict[str, Any], prefix: str, rows: dict[str, int]) -> pd.DataFrame:
    """The qk_capture value: one row per sampled head with its layer metadata and row counts."""
    by_layer = {li["layer"]: li for li in manifest["layers"]}
    out = []
    for h in manifest["heads"]:
        li = by_layer[h["layer"]]
        out.append({
            **h, "attention_type": li["attention_type"],
            "sliding_window": -1 if li["sliding_window"] is None else int(li["sliding_window"]),
            "rope_applied": bool(li["rope_applied"]),
            "n_q_rows": int(rows.get(head_file(prefix, "q", h["layer"], h["q_head"]), 0)),
            "n_k_rows": int(rows.get(head_file(prefix, "k", h["layer"], h["kv_head"]), 0)),
            "capture_prefix": prefix,
        })
    df = pd.DataFrame(out, columns=VALUE_COLUMNS)
    for col in ("layer", "q_head", "kv_head", "d", "sliding_window", "n_q_rows", "n_k_rows"):
        df[col] = df[col].astype("int64")
    return df


def _verifiable(storage: Storage, prefix: str) -> bool:
    """Whether the capture's complete.json carries file checksums (else it predates verification)."""
    summary = storage.read_json(f"{prefix}/complete.json")
    return isinstance(summary, dict) and isinstance(summary.get("files"), dict)


def _result_from_storage(storage: Storage, prefix: str, **kw: Any) -> CaptureResult:
    """The capture's value from storage (manifest ownership and doc_tokens verified; see verify_capture)."""
    reader = CaptureReader(storage, prefix)
    manifest = reader.manifest
    summary = reader.complete
    doc_tokens = reader.doc_tokens()
    return CaptureResult(prefix=prefix, fingerprint=manifest["fingerprint"], manifest=manifest,
                         heads=heads_frame(manifest, prefix, summary["rows"]), layers=layers_frame(manifest),
                         doc_tokens=doc_tokens, **kw)


# ---- the run ---------------------------------------------------------------------------------
def capture_model(entry: ModelEntry, corpus: pd.DataFrame, storage: Storage, *, corpus_name: str | None = None,
                  device: str = "auto", loaded: LoadedModel | None = None, log: Any = None,
                  on_document: Callable[[int, int], None] | None = None,
                  only_docs: Collection[int] | None = None, finalize: bool = True, intervention: Any = None,
                  heads: list[tuple[int, int]] | None = None, overlap_commits: bool | None = None) -> CaptureResult:
    """Capture ``entry`` over ``corpus`` (columns example_id, text) into ``storage`` (SPEC 1).

    ``loaded`` reuses an already loaded model; ``log`` is any logger with ``info``/``warning`` (the
    Dagster run log in the asset); ``on_document(example_id, n_tokens)`` is called after each commit.
    One shard of a capture (:mod:`qk_core.capture.sharded`): ``only_docs`` restricts the documents this
    call forwards (the capture's identity stays the whole corpus), ``finalize=False`` leaves the
    fan-out to whoever commits the last shard; the result then holds no row counts (``heads`` with 0).
    ``intervention`` (a write hook of :mod:`qk_core.capture.attention` with ``identity()`` and
    ``capture_problem()``, e.g. :class:`qk_core.interventions.hook.InterventionSession`) is active during every forward
    and ``heads`` replaces the head sampler: the recapture of SPEC 11.3. Both enter the fingerprint.
    Under ``debias`` a layer's kernel gets one key head per query head, so there kv_head = q_head.
    ``overlap_commits``: commit each document while the next one's forward runs (default: on an accelerator,
    whose forward leaves the host idle; on a CPU the commit would compete with the forward for the same cores).
    """
    import torch

    log = log or _log
    corpus_name = corpus_name or entry.corpus
    if corpus is None or len(corpus) == 0:
        raise CaptureError(f"{entry.key}: corpus '{corpus_name}' has no documents")
    missing_cols = {"example_id", "text"} - set(corpus.columns)
    if missing_cols:
        raise CaptureError(f"{entry.key}: corpus '{corpus_name}' lacks columns {sorted(missing_cols)}")
    docs = corpus[["example_id", "text"]].reset_index(drop=True)
    if entry.capture.max_docs:
        docs = docs.head(entry.capture.max_docs)

    dev = loaded.device if loaded is not None else resolve_device(device)
    dtype = loaded.dtype if loaded is not None else resolve_dtype(entry.dtype, dev)
    config = loaded.model.config if loaded is not None else load_config(entry)
    # the tokenizer is resolved before the fingerprint: its resolved commit is part of the identity
    tokenizer = loaded.tokenizer if loaded is not None else load_tokenizer(entry.key, entry.tokenizer,
                                                                           entry.trust_remote_code)
    ident = capture_identity(entry, config, docs, corpus_name, dtype, intervention, heads)
    fp = fingerprint(ident)
    prefix = capture_prefix(entry.key, fp)
    if storage.exists(f"{prefix}/complete.json"):
        if _verifiable(storage, prefix) or not storage.ls(f"{prefix}/docs"):
            log.info(f"{entry.key}: capture {fp} is already complete at {storage.uri(prefix)}")
            return _result_from_storage(storage, prefix, already_complete=True,
                                        skipped_docs=[int(e) for e in docs["example_id"]])
        log.info(f"{entry.key}: capture {fp} was finalized without checksums; finalizing it again")
        old = storage.read_json(f"{prefix}/manifest.json")
        storage.delete(f"{prefix}/complete.json")
        summary = CaptureWriter(storage, entry.key, old).finalize(keep_doc_files=entry.capture.keep_doc_files)
        return _result_from_storage(storage, prefix, already_complete=True, verification=summary["verification"],
                                    skipped_docs=[int(e) for e in docs["example_id"]])

    if loaded is None:
        log.info(f"{entry.key}: loading {entry.source.describe()} on {dev} as {dtype}")
        loaded = load_model(entry, dev, config=config, tokenizer=tokenizer)
    infos = probe_layers(loaded, entry.capture.include_sliding, intervention)
    if entry.variant is not None:  # SPEC 13.1: the override must be what the loaded model's layers record
        problems = variant_problems(infos, entry.variant.expected_rope())
        if problems:
            raise CaptureError(f"{entry.key}: the loaded model does not carry the variant's RoPE override "
                               f"({entry.variant.describe()}): " + "; ".join(problems))
    explicit = heads
    heads = plan_heads(entry, infos, explicit)
    sampled = {h["layer"] for h in heads}
    # SPEC 12.1: every eligible head and position (not for a recapture of chosen heads under a write hook,
    # whose kernel may get one key head per query head)
    moment_plan = plan_moments(entry, infos, enabled=explicit is None and entry.capture.moments)
    manifest = {
        "schema_version": SCHEMA_VERSION, "fingerprint": fp, "model_key": entry.key,
        "window": entry.window, "bucket": entry.bucket, "heads": heads,
        "layers": [i.as_dict() for i in infos], "identity": ident,
        "model": {**ident["model"], **{k: loaded.identity.get(k) for k in
                                        ("model_class", "backbone_class", "attn_implementation")}},
        "dtype": dtype, "device": dev, "sampler": ident["sampler"], "dataset": ident["dataset"],
        "tokenization": ident["tokenization"], "software": _software(),
        "moments": moment_plan.manifest(),
    }
    if entry.variant is not None:  # SPEC 13.1 (only variants carry the key: other manifests are unchanged)
        rotary = getattr(loaded.backbone, "rotary_emb", None)
        manifest["variant"] = {**entry.variant.record(), "description": entry.variant.describe(),
                               "expected_rope": entry.variant.expected_rope(),
                               "rope_attention_scaling": float(getattr(rotary, "attention_scaling", 1.0) or 1.0)}
    log.info(f"{entry.key}: {len(heads)} heads in {len(sampled)} of {len(infos)} layers "
             f"(eligible: {[i.layer for i in infos if i.eligible]}); window {entry.window}, bucket {entry.bucket}, "
             f"attention backend {loaded.identity.get('attn_implementation')}")

    writer = CaptureWriter(storage, entry.key, manifest) if storage.exists(f"{prefix}/manifest.json") else None
    committed = writer.committed_doc_ids() if writer is not None else set()
    if writer is not None and writer_manifest_heads(storage, prefix) != heads:
        raise CaptureError(f"{storage.uri(prefix)}: stored head manifest differs from this run's; not resuming")
    mine = docs if only_docs is None else docs[docs["example_id"].astype(int).isin({int(e) for e in only_docs})]
    todo = sorted((int(e), str(t)) for e, t in zip(mine["example_id"], mine["text"], strict=True)
                  if int(e) not in committed)  # in example-id order, the order of the moment merge
    skipped = [int(e) for e in mine["example_id"] if int(e) in committed]
    if skipped:
        log.info(f"{entry.key}: resuming, {len(skipped)}/{len(docs)} documents already committed")

    from qk_core.capture import hook

    plan = _layer_plan(heads)
    captured: list[int] = []
    tokens = 0
    seconds = 0.0
    total = len(mine)
    # with overlap_commits one document's commit (encoding, checksums, file I/O on the host) runs while the next
    # document's forward runs. At most one commit is in flight; its error stops the capture before the next
    # commit (the documents committed before it stay, and resume). Off by default on a CPU: on 2 cores it was no
    # faster at 2K (capture_cpu --moments 1.450x against 1.447x serial) and at 8K its thread competed with the
    # forward's (1.108x wall, 1.42x peak RSS against 1.063x / 0.98x serial; 2026-11-26).
    overlap = str(dev) != "cpu" if overlap_commits is None else bool(overlap_commits)
    # with overlap the commit thread also merges each document's moments (SPEC 12.1) as it commits, when this call
    # commits all of the capture's documents, so finalize() reads none back (on a CPU that merge would hold its
    # float64 sums in memory through the forwards: finalize() merges from the files instead)
    merge_as_committed = overlap and finalize and only_docs is None and not committed and bool(moment_plan.layers)
    pending: tuple[Future[None], int, int, float] | None = None

    def committed(eid: int, n: int, dt: float) -> None:
        nonlocal tokens, seconds
        captured.append(eid)
        tokens += n
        seconds += dt
        done = len(skipped) + len(captured)
        short = f" (shorter than the window {entry.window})" if n < entry.window else ""
        log.info(f"{entry.key}: document {done}/{total} (id {eid}): {n} tokens{short} in {dt:.1f}s, "
                 f"{n / dt:.0f} tok/s; run average {tokens / seconds:.0f} tok/s")
        if on_document is not None:
            on_document(eid, n)

    def settle() -> None:
        """Wait for the commit in flight, if any, and count its document."""
        nonlocal pending
        if pending is not None:
            future, *done = pending
            pending = None
            future.result()
            committed(*done)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="qk-commit") as commits, \
            hook.CaptureSession(loaded.backbone, plan, moment_plan) as session, _under(loaded, intervention):
        for eid, text in todo:
            ids = list(loaded.tokenizer(text, truncation=True, max_length=entry.window,
                                        add_special_tokens=True)["input_ids"])
            n = len(ids)
            if n == 0:
                raise CaptureError(f"{entry.key}: document {eid} has no tokens")
            session.set_positions(document_positions(entry, n, eid, list(plan)))
            t0 = time.perf_counter()
            x = torch.tensor([ids], device=loaded.device)
            with torch.inference_mode():  # up to the last layer the capture reads
                session.forward(functools.partial(loaded.backbone, input_ids=x, use_cache=False))
            try:
                rows = session.collect(copy=overlap)  # on the CPU, views of buffers the next forward reuses
                sums = session.collect_moments(copy=overlap)
            except hook.CaptureHookError as exc:
                raise CaptureError(f"{entry.key}: {exc}") from exc
            moments = [LayerMoments(layer, np.asarray(q), np.asarray(kv), np.asarray(ki), moment_plan.bucket,
                                    moment_plan.n_buckets, sums[layer], [eid])
                       for layer, (q, kv, ki) in moment_plan.layers.items()]
            dt = time.perf_counter() - t0
            settle()
            if writer is None:
                writer = CaptureWriter(storage, entry.key, manifest)
            if merge_as_committed and writer.running is None:
                writer.merge_while_committing(len(docs))
            if overlap:
                pending = (commits.submit(writer.write_document, eid, n, rows, moments), eid, n, dt)
            else:
                writer.write_document(eid, n, rows, moments)
                committed(eid, n, dt)
            del rows, moments  # not held through the next forward (a commit in flight holds its own)
        settle()
    release_freed_memory()  # what the forwards kept for each other (qk_core.runtime.host_memory)
    if not finalize:
        log.info(f"{entry.key}: shard of {len(mine)} documents committed at {storage.uri(prefix)} "
                 f"({len(captured)} captured, {len(skipped)} already there); finalize left to the caller")
        return CaptureResult(prefix=prefix, fingerprint=fp, manifest=manifest, heads=heads_frame(manifest, prefix, {}),
                             layers=layers_frame(manifest), doc_tokens=pd.DataFrame(columns=["example_id", "n_tokens"]),
                             captured_docs=captured, skipped_docs=skipped, tokens=tokens, seconds=seconds)
    if writer is None:
        writer = CaptureWriter(storage, entry.key, manifest)
    summary = writer.finalize(keep_doc_files=entry.capture.keep_doc_files)
    timing = summary["timing"]
    log.info(f"{entry.key}: capture complete at {storage.uri(prefix)}: {summary['n_docs']} documents, "
             f"{sum(summary['rows'].values())} rows in {len(summary['rows'])} head files; fan-out "
             f"{timing['fan_out_s']:.1f}s, verified in {timing['verify_s']:.1f}s; "
             f"document files {summary['doc_files']}")
    return _result_from_storage(storage, prefix, captured_docs=captured, skipped_docs=skipped, tokens=tokens,
                                seconds=seconds, verification=summary["verification"])


def writer_manifest_heads(storage: Storage, prefix: str) -> list[dict[str, int]]:
    return list(storage.read_json(f"{prefix}/manifest.json")["heads"])
