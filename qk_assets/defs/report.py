"""``report_html``: the static report page under the storage root (``report/index.html``).

Thin: it reads what the other assets stored (their Parquet values, their figure files, the metadata and
provenance of their latest materialisations from the Dagster instance), copies the figures next to the
page and calls :func:`qk_core.report.html.render_report`. It depends on every other asset of the code
location by key, so it is stale whenever any of them is recomputed; assets that are missing (not yet
materialised, or not yet defined) appear in the page as "not yet computed". With the daemon running
(``make ui``), ``automation_sensor`` rebuilds the page after upstream updates, in the same run as the
joins, statistics and cross-model figures it shows (:mod:`qk_assets.automation`).
"""

import importlib
import json
import pkgutil
import time

import pandas as pd
import pyarrow.parquet as pq
from dagster import (
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    AssetsDefinition,
    AutomationCondition,
    MetadataValue,
    PartitionsDefinition,
    TableMetadataValue,
    asset,
)

from qk_assets import defs as defs_pkg
from qk_assets.defs.registry import REGISTRY_LISTING
from qk_assets.figures import png_size
from qk_assets.io_manager import asset_rel
from qk_assets.metadata import table_value
from qk_assets.partitions import MODEL_DIM, model_corpus_partitions, pair_key, registry, registry_pairs, split_key
from qk_assets.resources import StorageResource
from qk_core.config.registry import Registry
from qk_core.io.storage import Storage
from qk_core.report.html import AssetState, Figure, ModelInfo, ReportInputs, render_report

CAPTURE = "qk_capture"
REPORT_DIR = "report"
PAGE = f"{REPORT_DIR}/index.html"
VECTOR_FORMATS = ("pdf", "svg")  # copied beside a figure's PNG when stored
MAX_READ_ROWS = 20_000  # larger tables are shown by their first rows only (they stay whole in storage)
# The assets SPEC sections 1-7, 10 and 11 call for; any other asset of the code location is included as well.
EXPECTED = [
    "corpus", "qk_capture", "pca_heads", "pca_layers", "pca_metrics", "rotation_heads", "rotation_layers",
    "rotation_metrics", "geometry_figures", "plasticity_heads", "plasticity_profiles", "plasticity_pairs",
    "plasticity_heatmap", "plasticity_metrics", "model_report", "benchmark_scores", "model_aliases",
    "reference_metrics", "benchmark_joins", "benchmark_stats", "trajectory",
    "intervention_summary", "intervention_contrast", "intervention_verdicts", "intervention_debias_metrics",
    "cross_corpus_metrics", "cross_corpus_correlations", "cross_corpus_verdicts",
]


def sibling_assets() -> dict[AssetKey, PartitionsDefinition | None]:
    """Every asset defined by the other modules of :mod:`qk_assets.defs` and its partitions."""
    out: dict[AssetKey, PartitionsDefinition | None] = {}
    for info in sorted(pkgutil.iter_modules(defs_pkg.__path__), key=lambda m: m.name):
        if f"{defs_pkg.__name__}.{info.name}" == __name__:
            continue
        module = importlib.import_module(f"{defs_pkg.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, AssetsDefinition) and value.is_executable:
                for key in value.keys:
                    out[key] = value.partitions_def
    return out


UPSTREAM = sibling_assets()


def _text_metadata(metadata: dict) -> dict[str, str]:
    """The entries worth showing as provenance (no figures, no long previews)."""
    out = {}
    for k, v in metadata.items():
        if k.startswith("fig_") or k in ("path", "preview", "capture_prefix"):
            continue
        if isinstance(v, TableMetadataValue):  # a table entry: its records, shown as a table preview
            out[k] = json.dumps([dict(r.data) for r in v.records], default=str)
            continue
        raw = getattr(v, "value", v)
        if isinstance(raw, dict | list):
            text = json.dumps(raw, sort_keys=True, default=str)
        else:
            text = str(getattr(raw, "path", raw))
        is_table = text.startswith("|")
        if text.startswith("![") or len(text) > (200_000 if is_table else 2000):
            continue
        out[k] = text
    return out


def _read_table(storage: Storage, rel: str) -> pd.DataFrame | None:
    if not storage.exists(rel):
        return None

    def read(pf: pq.ParquetFile) -> pd.DataFrame:  # one version of the file, even while it is replaced
        n = pf.metadata.num_rows
        if n <= MAX_READ_ROWS:
            df = pf.read(use_pandas_metadata=True).to_pandas()
        else:
            batch = next(pf.iter_batches(batch_size=50), None)
            df = batch.to_pandas() if batch is not None else pd.DataFrame()
        df.attrs["total_rows"] = n
        return df

    return storage.with_parquet_file(rel, read)


def partition_label(part: str | None) -> str | None:
    """How the page names a partition: a (model, corpus) pair by its model when the corpus is the model's
    first one, else ``<model> (<corpus>)``; other keys as they are."""
    if not part or "|" not in part:
        return part
    model, corpus = split_key(part)
    reg = registry()
    if model in reg.models and reg.model(model).corpus == corpus:
        return model
    return f"{model} ({corpus})"


def _model_info(key: str) -> ModelInfo:
    m = registry().model(key)
    return ModelInfo(
        key=m.key, family=m.family, description=m.description, source=m.source.describe(),
        tokenizer=m.tokenizer.describe(), dtype=m.dtype, window=m.window, bucket=m.bucket, corpus=m.corpus,
        capture={k: getattr(m.capture, k) for k in m.capture.__dataclass_fields__}, analysis=dict(m.analysis),
    )


# Rebuild the page after any upstream materialisation, once nothing upstream is still running (so a
# backfill of many models rebuilds it once at the end, not after every partition).
REPORT_CONDITION = (
    AutomationCondition.any_deps_updated().since_last_handled()
    & ~AutomationCondition.any_deps_in_progress()
    & ~AutomationCondition.in_progress()
).with_label("after upstream updates, once nothing upstream runs")


def listed(part: str | None, reg: Registry) -> bool:
    """Whether the registry still lists a partition: a (model, corpus) pair, a model, a corpus or a series
    (unpartitioned values always are)."""
    if part is None:
        return True
    if "|" in part:
        return split_key(part) in set(registry_pairs(reg))
    return part in reg.models or part in reg.series or part in reg.corpora


def drop_removed(df: pd.DataFrame, removed: set[str]) -> pd.DataFrame:
    """The rows of a stored table that are not about a model the registry no longer lists (by its ``model``
    column; the thesis's reference models are never registry keys, so they stay)."""
    if not removed or "model" not in df.columns:
        return df
    keep = ~df["model"].astype(str).isin(removed)
    out = df[keep]
    out.attrs = dict(df.attrs)
    if "total_rows" in out.attrs and not keep.all():
        out.attrs["total_rows"] = int(out.attrs["total_rows"]) - int((~keep).sum())
    return out


def pair_coverage(reg: Registry, materialised: dict[str, set[str]]) -> pd.DataFrame:
    """One row per (model, corpus) pair the registry asks for, in file order: its groups, whether its capture is
    materialised and which of its per-pair assets (``materialised``: asset -> materialised partition keys) are
    still missing. The grid of the (model, corpus) partitions also holds pairs nobody asked for; this is what a
    reader wants of it (issue 26.3)."""
    rows = []
    for model, corpus in registry_pairs(reg):
        key = str(pair_key(model, corpus))
        missing = [a for a, done in materialised.items() if key not in done]
        rows.append({"model": model, "corpus": corpus, "groups": ", ".join(reg.model(model).groups),
                     "capture": "materialised" if key in materialised.get(CAPTURE, set()) else "missing",
                     "assets": f"{len(materialised) - len(missing)} of {len(materialised)}",
                     "missing": "all" if missing and len(missing) == len(materialised) else ", ".join(missing)})
    return pd.DataFrame(rows, columns=["model", "corpus", "groups", "capture", "assets", "missing"])


def removal_dates(instance, removed: set[str]) -> dict[str, float]:
    """When each removed model left the registry: the time of the first ``registry_listing`` observation that did
    not list it after one that did (its ``models`` metadata); a model no recorded observation listed is left out."""
    if not removed:
        return {}
    recs = instance.fetch_observations(AssetRecordsFilter(asset_key=REGISTRY_LISTING), limit=10_000,
                                       ascending=True).records
    listed_before: set[str] = set()
    out: dict[str, float] = {}
    for rec in recs:
        obs = rec.asset_observation
        value = obs.metadata.get("models") if obs is not None else None
        models = set(getattr(value, "value", None) or [])
        if value is None:
            continue
        for m in removed:
            if m in models:
                listed_before.add(m)
                out.pop(m, None)  # listed again: a later removal counts
            elif m in listed_before and m not in out:
                out[m] = rec.timestamp
    return out


def removed_note(removed: set[str], dates: dict[str, float]) -> str:
    """The page's one line about models the registry no longer lists (each with the date it left, when known)."""
    names = [f"{m} (removed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(dates[m]))})" if m in dates else m
             for m in sorted(removed)]
    return (f"No longer in the registry, left out of this page (stored outputs kept): {', '.join(names)}. "
            "A figure across models drawn before the removal shows them until it is recomputed.")


@asset(deps=[*sorted(UPSTREAM, key=lambda k: k.to_user_string()), REGISTRY_LISTING], group_name="report",
       kinds={"html"}, automation_condition=REPORT_CONDITION)
def report_html(context: AssetExecutionContext, storage: StorageResource) -> pd.DataFrame:
    """The static HTML report with every figure and table (SPEC 7), the options and provenance of every
    number; one row per item the page shows (asset, partition, kind, path)."""
    st = storage.get()
    instance = context.instance
    root_uri = st.uri("").rstrip("/") + "/"
    states: list[AssetState] = []
    figures: list[Figure] = []
    tables: dict[str, dict[str | None, pd.DataFrame]] = {}
    links: dict[str, dict[str | None, str]] = {}
    inventory = []
    copied: set[str] = set()  # vector files copied next to the page
    reg = registry()
    model_keys = set(reg.model_keys)
    removed = {m for m in instance.get_dynamic_partitions(MODEL_DIM) if m not in reg.models}
    for key, pdef in sorted(UPSTREAM.items(), key=lambda kv: kv[0].to_user_string()):
        name = key.to_user_string()
        if pdef is None:
            parts: list[str | None] = [None]
        else:
            valid = set(pdef.get_partition_keys(dynamic_partitions_store=instance))
            parts = sorted(p for p in instance.get_materialized_partitions(key) if p in valid)
        for part in parts:
            if not listed(part, reg):  # the registry no longer lists it: its outputs stay, the page leaves it out
                continue
            label = partition_label(part)
            flt = AssetRecordsFilter(asset_key=key, asset_partitions=[part] if part else None)
            recs = instance.fetch_materializations(flt, limit=1, ascending=False).records
            if not recs:
                continue
            rec = recs[0]
            mat = rec.asset_materialization
            meta = dict(mat.metadata) if mat is not None else {}
            tags = {**(rec.event_log_entry.tags or {}), **(dict(mat.tags or {}) if mat is not None else {})}
            rel = asset_rel(key.path, part)
            states.append(AssetState(name, label, rec.timestamp, rec.run_id, tags.get("dagster/code_version", ""),
                                     st.uri(rel) if st.exists(rel) else "", _text_metadata(meta)))
            df = _read_table(st, rel)
            if df is not None:
                df = drop_removed(df, removed)
                tables.setdefault(name, {})[label] = df
                links.setdefault(name, {})[label] = f"../{rel}"  # relative to report/index.html
                inventory.append({"asset": name, "partition": label or "", "kind": "table", "path": st.uri(rel)})
            for mkey, value in meta.items():
                if not (mkey.startswith("fig_") and mkey.endswith("_path")):
                    continue
                uri = str(getattr(value, "path", getattr(value, "value", value)))
                if not uri.startswith(root_uri):
                    continue
                src_rel = uri[len(root_uri):]
                if not st.exists(src_rel):
                    continue
                dest = f"{REPORT_DIR}/{src_rel}"
                data = st.read_bytes(src_rel)
                st.write_bytes(dest, data)
                fig_name = mkey[len("fig_"):-len("_path")]
                if any(f.src == src_rel for f in figures):  # one file attached to several outputs
                    continue
                width, height = png_size(data)
                files = []
                for fmt in VECTOR_FORMATS:  # the vector files beside a paper figure (qk_assets.figures)
                    vec = src_rel.rsplit(".", 1)[0] + f".{fmt}"
                    if st.exists(vec):
                        st.write_bytes(f"{REPORT_DIR}/{vec}", st.read_bytes(vec))
                        files.append((fmt.upper(), vec))
                        copied.add(f"{REPORT_DIR}/{vec}")
                figures.append(Figure(src=src_rel, name=fig_name, asset=name, partition=label, width=width,
                                      height=height, files=tuple(files)))
                inventory.append({"asset": name, "partition": label or "", "kind": "figure", "path": st.uri(dest)})

    per_pair = [k for k, pdef in UPSTREAM.items() if pdef == model_corpus_partitions()]
    coverage = pair_coverage(reg, {k.to_user_string(): set(instance.get_materialized_partitions(k))
                                   for k in sorted(per_pair, key=lambda k: k.to_user_string())})
    dates = removal_dates(instance, removed)
    measured = {s.partition for s in states if s.partition in model_keys}
    models = [k for k in registry().model_keys if k in measured] or registry().in_group("demo")
    inputs = ReportInputs(
        title="Q/K geometry of long-context attention — report",
        models=[_model_info(k) for k in models], tables=tables, figures=figures, states=states,
        defined_assets=[k.to_user_string() for k in UPSTREAM], expected_assets=EXPECTED,
        storage_url=st.url, generated_at=time.time(), model_order=list(registry().model_keys), links=links,
        notes=[removed_note(removed, dates)] if removed else [],
    )
    page = render_report(inputs)
    st.write_text(PAGE, page)
    _prune_stale_figures(st, {f"{REPORT_DIR}/{f.src}" for f in figures} | copied)
    inventory.append({"asset": "report_html", "partition": "", "kind": "page", "path": st.uri(PAGE)})
    local = st.local_path(PAGE)
    missing = sorted({*EXPECTED, *(k.to_user_string() for k in UPSTREAM)} - {s.asset for s in states})
    context.add_output_metadata({
        "pairs_listed": len(coverage),  # what the registry asks for, and how much of it is still missing
        "pairs_missing": int((coverage["missing"] != "").sum()),
        "report": MetadataValue.url(local.as_uri()) if local else MetadataValue.path(st.uri(PAGE)),
        "registry_pairs": table_value(coverage, max_rows=max(len(coverage), 1)),
        "models": ", ".join(models),
        "removed_from_registry": ", ".join(sorted(removed)) or "none",
        "removed_on": MetadataValue.json({m: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))
                                          for m, t in sorted(dates.items())}),
        "figures": len(figures),
        "assets_computed": len({s.asset for s in states}),
        "page_bytes": len(page.encode()),
        "not_yet_computed": MetadataValue.md("\n".join(f"- {m}" for m in missing) or "none"),
    })
    return pd.DataFrame(inventory, columns=["asset", "partition", "kind", "path"])


def _prune_stale_figures(st: Storage, keep: set[str]) -> None:
    """Remove copied figures the page no longer shows (from an earlier report)."""
    for rel in st.ls(f"{REPORT_DIR}/figures", recursive=True):
        if rel.endswith((".png", *(f".{fmt}" for fmt in VECTOR_FORMATS))) and rel not in keep:
            st.delete(rel)
