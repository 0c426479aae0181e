"""Benchmark scores, model aliases, model types and the thesis reference values (SPEC 5).

Everything here reads files through :class:`qk_core.io.storage.Storage` from two folders under the
storage root: ``benchmarks/`` (score files, ``model_aliases.csv``, ``longbench_pro_models.csv``) and
``reference/`` (``thesis_metrics.csv``). The seed files shipped in ``data/benchmarks`` and
``data/reference`` are copied there once (:func:`ensure_seed_files`), never over a user's file.

Score files, all normalised to one long table (:data:`SCORE_COLUMNS`, score 0-100):

- long CSV (``longbench_pro.csv``): ``benchmark, model_name, mode, breakdown, key, score`` and
  optionally ``source, input_truncation, date, suite``;
- per-length CSV (``ruler.csv``): ``benchmark, model_name, mode, length, score`` and optionally
  ``source, suite``; each row becomes breakdown ``length``, key = the length label;
- LongBench-Pro's official per-model summary JSON, unchanged, named
  ``<mode>_context-<N>_bon-<k>_summary.json`` inside a folder named after the model (as published),
  or ``<model>_<mode>_context-<N>_bon-<k>_summary.json``. The ``average_*`` entries are the
  published scores (fraction x 100).

``suite`` is the set of rows that may enter one statistic together (SPEC 5: never mix modes, never
mix RULER sources): the ``suite`` column when a file has one, else the benchmark for long CSVs and
summary JSONs, else the ``source`` for per-length CSVs (one published table = one suite).

Bad input raises :class:`BenchmarkDataError` naming the file, the line (or JSON entry) and the field.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import math
import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from qk_core.config.settings import DATA_DIR, Settings
from qk_core.io.metrics import COLUMNS as METRIC_COLUMNS
from qk_core.io.storage import Storage, StorageError

BENCHMARK_DIR = "benchmarks"
REFERENCE_DIR = "reference"
SEED_DIRS = {BENCHMARK_DIR: DATA_DIR / "benchmarks", REFERENCE_DIR: DATA_DIR / "reference"}
SEED_MARKER = ".seeded.json"
ALIASES_FILE = "model_aliases.csv"
MODEL_TYPES_FILES = {"longbench_pro_models.csv": "LongBench-Pro"}
REFERENCE_FILE = "thesis_metrics.csv"
DATA_SUFFIXES = (".csv", ".json")

SCORE_COLUMNS = ["benchmark", "suite", "source", "model_name", "mode", "breakdown", "key", "score",
                 "length_tokens", "input_truncation", "date", "file", "location", "file_sha256", "extra"]
ALIAS_COLUMNS = ["model", "hf_repo", "benchmark", "benchmark_model_name", "mode", "checkpoint_relation",
                 "note", "file", "location"]
MODEL_TYPE_COLUMNS = ["benchmark", "model_name", "type", "claimed_context", "url", "file", "location"]
REFERENCE_COLUMNS = [*METRIC_COLUMNS, "analysis", "value_source", "source"]
CHECKPOINT_RELATIONS = ("same", "instruct-of-base", "base-of-hybrid")

LONG_REQUIRED = ("benchmark", "model_name", "mode", "breakdown", "key", "score")
LENGTH_REQUIRED = ("benchmark", "model_name", "mode", "length", "score")
ALIAS_REQUIRED = ("model", "benchmark", "benchmark_model_name", "mode", "checkpoint_relation")
MODEL_TYPE_REQUIRED = ("model_name", "type")
REFERENCE_REQUIRED = ("source", "model", "metric", "key", "value")

# LongBench-Pro summary JSON: published entry -> breakdown (SPEC 5; score = fraction x 100).
LBP_BREAKDOWNS = {
    "average_token_length_metric": "length",
    "average_contextual_requirement_metric": "contextual_requirement",
    "average_difficulty_metric": "difficulty",
    "average_primary_task_metric": "primary_task",
    "average_language_metric": "language",
}
LBP_REQUIRED = ("average_overall_metric", "average_token_length_metric")
LBP_NAME_RE = re.compile(
    r"^(?:(?P<model>.+?)_)?(?P<mode>nonthinking|thinking)_context-(?P<ctx>\d+)_bon-(?P<bon>\d+)_summary\.json$")
LENGTH_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
MAX_REPORTED = 25


class BenchmarkDataError(ValueError):
    """Bad benchmark/reference input; the message names each file, line (or entry) and field."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:MAX_REPORTED]
        more = len(self.problems) - len(shown)
        super().__init__("\n".join(shown) + (f"\n... and {more} more" if more > 0 else ""))


@dataclass(frozen=True)
class SourceFile:
    """One input file under the storage root: its relative path and content, read as a stream.

    ``data`` holds small in-memory files (tests); otherwise the file is streamed from ``storage``
    every time it is opened, so a large file is never held in memory whole (issue 14.6).
    """

    rel: str
    data: bytes | None = None
    storage: Storage | None = field(default=None, repr=False, compare=False)

    @contextlib.contextmanager
    def open(self) -> Iterator[BinaryIO]:
        if self.data is not None:
            yield io.BytesIO(self.data)
        else:
            assert self.storage is not None, f"{self.rel}: neither data nor storage"
            with self.storage.open_read(self.rel) as fh:
                yield fh

    @cached_property
    def sha256(self) -> str:
        h = hashlib.sha256()
        with self.open() as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        return h.hexdigest()


# ---- lengths ------------------------------------------------------------------------------------
def parse_length(label: str) -> int | None:
    """``"8k"`` -> 8192, ``"128K"`` -> 131072, ``"4096"`` -> 4096; None when not a length (SPEC 4.5)."""
    m = LENGTH_RE.match(str(label))
    if not m:
        return None
    scale = {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    return round(float(m.group(1)) * scale)


def bin_upper_tokens(key: str) -> int | None:
    """Upper edge of a plasticity length bin label: ``"8k-16k"`` -> 16384, ``"4k"`` -> 4096 (SPEC 4.5).

    A bin [X/2, X) is matched with benchmark length X, so the upper edge is the join key.
    """
    parts = str(key).split("-")
    return parse_length(parts[-1]) if parts else None


# ---- seeds --------------------------------------------------------------------------------------
def ensure_seed_files(storage: Storage) -> list[str]:
    """Copy the shipped seed files into ``benchmarks/`` and ``reference/`` where absent.

    A seed is copied once: the folder's ``.seeded.json`` lists the seeds already placed, so a user
    who deletes or edits a seed file keeps their choice; a user's file of the same name is never
    overwritten. Returns the relative paths written.
    """
    written: list[str] = []
    for folder, src_dir in SEED_DIRS.items():
        marker_rel = f"{folder}/{SEED_MARKER}"
        done: list[str] = []
        if storage.exists(marker_rel):
            try:
                done = list(storage.read_json(marker_rel).get("seeded", []))
            except Exception:  # an unreadable marker: treat as empty, still never overwrite
                done = []
        changed = False
        for path in sorted(p for p in Path(src_dir).iterdir() if p.is_file()):
            if path.name in done:
                continue
            rel = f"{folder}/{path.name}"
            if not storage.exists(rel):
                storage.write_bytes(rel, path.read_bytes())
                written.append(rel)
            done.append(path.name)
            changed = True
        if changed:
            storage.write_json(marker_rel, {"seeded": sorted(done)})
    return written


def list_data_files(storage: Storage, folder: str) -> list[str]:
    """Relative paths of the CSV/JSON files under ``folder`` (recursive; hidden files skipped)."""
    out = []
    for rel in storage.ls(folder, recursive=True):
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(".") or not name.lower().endswith(DATA_SUFFIXES):
            continue
        out.append(rel)
    return out


def classify(rel: str) -> str:
    """Which asset a file under the storage root feeds: scores, aliases, model_types, reference."""
    name = rel.rsplit("/", 1)[-1]
    if rel.startswith(REFERENCE_DIR + "/"):
        return "reference"
    if name == ALIASES_FILE:
        return "aliases"
    if name in MODEL_TYPES_FILES:
        return "model_types"
    return "scores"


def scan_files(storage: Storage, previous: dict[str, dict[str, str]] | None = None
               ) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Content hashes of every data file under ``benchmarks/`` and ``reference/``, and what changed.

    ``previous`` is the state returned by the last scan (``{rel: {"token", "sha256"}}``). Local files
    are hashed on every scan; S3 objects only when their ETag differs (an object's ETag changes with
    its content). A file counts as changed when it is new, gone, or its SHA-256 differs. Returns
    (state, sorted changed paths).
    """
    previous = previous or {}
    state: dict[str, dict[str, str]] = {}
    for rel in [*list_data_files(storage, BENCHMARK_DIR), *list_data_files(storage, REFERENCE_DIR)]:
        try:
            token = storage.info_token(rel)
        except FileNotFoundError:  # removed between listing and info
            continue
        old = previous.get(rel)
        if storage.is_s3 and old and old.get("token") == token:
            state[rel] = dict(old)
            continue
        try:
            sha = SourceFile(rel, storage=storage).sha256  # streamed: a large file is never held whole
        except Exception:  # vanished mid-scan: the next scan sees it gone
            continue
        state[rel] = {"token": token, "sha256": sha}
    changed = [rel for rel in state if previous.get(rel, {}).get("sha256") != state[rel]["sha256"]]
    changed += [rel for rel in previous if rel not in state]
    return state, sorted(changed)


def read_files(storage: Storage, rels: Iterable[str], max_bytes: int | None = None) -> list[SourceFile]:
    """The files as streams; any larger than ``max_bytes`` (default ``QK_BENCHMARK_MAX_BYTES``) is an error."""
    limit = Settings.from_env().benchmark_max_bytes if max_bytes is None else max_bytes
    problems, files = [], []
    for rel in rels:
        if not storage.is_s3:
            try:
                storage.local_read_path(rel)  # a link out of the root is refused before anything is read
            except StorageError as exc:
                problems.append(str(exc))
                continue
        size = storage.size(rel)
        if size > limit:
            problems.append(f"{storage.uri(rel)}: {size:,} bytes is over the limit of {limit:,} bytes for one "
                            "benchmark or reference file (raise QK_BENCHMARK_MAX_BYTES to read it)")
        files.append(SourceFile(rel, storage=storage))
    if problems:
        raise BenchmarkDataError(problems)
    return files


def score_files(storage: Storage, max_bytes: int | None = None) -> list[SourceFile]:
    """Every score file under ``benchmarks/`` (not the alias or model-type tables)."""
    return read_files(storage, [r for r in list_data_files(storage, BENCHMARK_DIR) if classify(r) == "scores"],
                      max_bytes)


# ---- CSV helpers --------------------------------------------------------------------------------
def _csv_rows(f: SourceFile, uri: str, problems: list[str]
              ) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    """Header and a lazy iterator of (line number, row) pairs; the header is line 1.

    The file is streamed (decoded and split as it is read), so memory does not grow with its size.
    """
    stack = contextlib.ExitStack()
    fh = stack.enter_context(f.open())
    reader = csv.reader(io.TextIOWrapper(fh, encoding="utf-8-sig", newline=""))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        problems.append(f"{uri}: line 1: empty file (no header)")
    except UnicodeDecodeError as exc:
        problems.append(f"{uri}: line 1: not UTF-8 text ({exc})")
    except csv.Error as exc:
        problems.append(f"{uri}: line 1: unreadable CSV ({exc})")
    else:
        return header, _csv_body(stack, reader, header, uri, problems)
    stack.close()
    return [], iter(())


def _csv_body(stack: contextlib.ExitStack, reader: Any, header: list[str], uri: str, problems: list[str]
              ) -> Iterator[tuple[int, dict[str, str]]]:
    with stack:
        try:
            for values in reader:
                line = reader.line_num
                if not values or all(not v.strip() for v in values):
                    continue
                if len(values) != len(header):
                    problems.append(f"{uri}: line {line}: {len(values)} fields, the header has {len(header)}")
                    continue
                yield line, {h: v.strip() for h, v in zip(header, values, strict=True)}
        except csv.Error as exc:
            problems.append(f"{uri}: line {reader.line_num}: unreadable CSV ({exc})")
        except UnicodeDecodeError as exc:
            problems.append(f"{uri}: after line {reader.line_num}: not UTF-8 text ({exc})")


def _missing(header: list[str], required: Iterable[str], uri: str, problems: list[str]) -> bool:
    miss = [c for c in required if c not in header]
    for c in miss:
        problems.append(f"{uri}: line 1, field '{c}': missing column (header: {', '.join(header)})")
    return bool(miss)


def _score(raw: Any, where: str, fld: str, problems: list[str], scale: float = 1.0) -> float | None:
    """A finite number in [0, 100] after scaling; otherwise a problem naming ``where`` and ``fld``."""
    try:
        val = float(raw) * scale
    except (TypeError, ValueError):
        problems.append(f"{where}, field '{fld}': {raw!r} is not a number")
        return None
    if not math.isfinite(val) or not 0.0 <= val <= 100.0:
        problems.append(f"{where}, field '{fld}': {raw!r} is outside the score range 0-100"
                        + (" (after x100)" if scale != 1.0 else ""))
        return None
    return val


def _int_or_none(raw: str, where: str, fld: str, problems: list[str]) -> int | None:
    if raw in ("", None):
        return None
    try:
        return int(float(raw))
    except ValueError:
        problems.append(f"{where}, field '{fld}': {raw!r} is not an integer")
        return None


def _nonempty(row: dict[str, str], fields: Iterable[str], where: str, problems: list[str]) -> bool:
    ok = True
    for fld in fields:
        if not row.get(fld, ""):
            problems.append(f"{where}, field '{fld}': empty")
            ok = False
    return ok


STRING_COLUMNS = ["benchmark", "suite", "source", "model_name", "mode", "breakdown", "key", "date", "file",
                  "file_sha256", "extra"]
SORT_COLUMNS = ["benchmark", "suite", "model_name", "mode", "breakdown", "key"]
IDENTITY = SORT_COLUMNS  # one score per cell
_NONE = -(2**62)  # integer sentinel for a missing value in the compact columns


class _Records:
    """Score records in compact columns (issue 14.6: a large file must not need memory per row as dicts).

    Each string column is an ``array`` of codes into its distinct values; numbers are ``array``s; a
    location is a CSV line number (or an entry name for JSON). The frame returns the repeated strings as
    categoricals with sorted categories.
    """

    def __init__(self) -> None:
        self.codes: dict[str, array] = {c: array("i") for c in STRING_COLUMNS}
        self.values: dict[str, dict[str, int]] = {c: {} for c in STRING_COLUMNS}
        self.score, self.length, self.trunc, self.line = array("d"), array("q"), array("q"), array("q")
        self.entries: dict[int, str] = {}  # row -> non-line location (JSON entries)
        self.shas: dict[str, SourceFile] = {}

    def _add(self, col: str, v: str) -> None:
        vals = self.values[col]
        code = vals.get(v)
        if code is None:
            code = vals[v] = len(vals)
        self.codes[col].append(code)

    def add(self, *, benchmark: str, suite: str, source: str, model_name: str, mode: str, breakdown: str,
            key: str, score: float, input_truncation: int | None, date: str, f: SourceFile, location: str,
            extra: dict[str, str]) -> None:
        row = len(self.score)
        for col, v in (("benchmark", benchmark), ("suite", suite), ("source", source), ("model_name", model_name),
                       ("mode", mode), ("breakdown", breakdown), ("key", key), ("date", date), ("file", f.rel),
                       ("file_sha256", f.rel), ("extra", json.dumps(extra, sort_keys=True) if extra else "")):
            self._add(col, v)
        self.shas.setdefault(f.rel, f)
        self.score.append(score)
        length = parse_length(key) if breakdown == "length" else None
        self.length.append(_NONE if length is None else length)
        self.trunc.append(_NONE if input_truncation is None else input_truncation)
        if location.startswith("line ") and location[5:].isdigit():
            self.line.append(int(location[5:]))
        else:
            self.line.append(_NONE)
            self.entries[row] = location

    def duplicates(self, uri_of: Any) -> list[str]:
        """A problem per row repeating an earlier cell (benchmark, suite, model, mode, breakdown, key; a
        length key compares as tokens), in file order, naming both places."""
        n = len(self.score)
        if not n:
            return []
        cols = {c: np.frombuffer(self.codes[c], dtype=np.int32) for c in IDENTITY}
        length = np.frombuffer(self.length, dtype=np.int64)
        cols["key"] = np.where(length != _NONE, length, -1 - cols["key"].astype(np.int64))
        dup = pd.DataFrame(cols).duplicated(keep="first").to_numpy()
        if not dup.any():
            return []
        ident = pd.util.hash_pandas_object(pd.DataFrame(cols), index=False).to_numpy()
        first_of = dict(zip(ident[~dup].tolist(), np.flatnonzero(~dup).tolist(), strict=True))
        names = {c: list(self.values[c]) for c in ("benchmark", "model_name", "mode", "breakdown", "key", "file")}

        def val(col: str, row: int) -> str:
            return names[col][self.codes[col][row]]

        def where(row: int) -> str:
            loc = self.entries.get(row) or f"line {self.line[row]}"
            return f"{uri_of(val('file', row))}: {loc}"

        out = []
        rows = np.flatnonzero(dup)
        for row in rows[:MAX_REPORTED].tolist():
            first = first_of[int(ident[row])]
            out.append(f"{where(row)}, field 'key': duplicate row — {val('benchmark', row)} / "
                       f"{val('model_name', row)} / {val('mode', row)} / {val('breakdown', row)} = {val('key', row)} "
                       f"is already given by {where(first)}")
        if len(rows) > MAX_REPORTED:
            out.append(f"... {len(rows)} duplicate rows in all")
        return out

    def frame(self) -> pd.DataFrame:
        """The table sorted by :data:`SORT_COLUMNS` (the codes are released)."""
        n = len(self.score)
        cats: dict[str, pd.Categorical] = {}
        for col in STRING_COLUMNS:
            names = list(self.values[col])
            if col == "file_sha256":
                names = [self.shas[rel].sha256 for rel in names]
            order = np.argsort(np.array(names, dtype=object), kind="stable") if names else np.zeros(0, np.int64)
            rank = np.empty(len(names), np.int32)
            rank[order] = np.arange(len(names), dtype=np.int32)
            codes = rank[np.frombuffer(self.codes[col], dtype=np.int32)] if n else np.zeros(0, np.int32)
            cats[col] = pd.Categorical.from_codes(codes, categories=pd.Index([names[i] for i in order], dtype=object),
                                                  validate=False)
            self.codes[col] = array("i")
        perm = np.lexsort([cats[c].codes for c in reversed(SORT_COLUMNS)]) if n else np.zeros(0, np.int64)
        line = np.frombuffer(self.line, dtype=np.int64)[perm]
        # "line N" built in Arrow (issue 25.6: numpy's fixed-width and object strings cost ~300 bytes a row)
        location = pc.binary_join_element_wise("line ", pc.cast(pa.array(line), pa.string()), "")
        if self.entries:  # JSON entries name their location instead of a line
            inverse = np.empty_like(perm)
            inverse[perm] = np.arange(n)
            at = sorted((int(inverse[row]), text) for row, text in self.entries.items())
            mask = np.zeros(n, dtype=bool)
            mask[[i for i, _ in at]] = True
            location = pc.replace_with_mask(location, pa.array(mask), pa.array([t for _, t in at], pa.string()))

        def ints(a: array) -> pd.arrays.IntegerArray:
            v = np.frombuffer(a, dtype=np.int64)[perm]
            missing = v == _NONE
            return pd.arrays.IntegerArray(np.where(missing, 0, v), missing)

        data = {c: cats[c][perm] for c in STRING_COLUMNS}
        data.update(score=np.frombuffer(self.score, dtype=np.float64)[perm], length_tokens=ints(self.length),
                    input_truncation=ints(self.trunc), location=pd.array(location, dtype="str"))
        return pd.DataFrame(data, columns=SCORE_COLUMNS)


# ---- score parsers ------------------------------------------------------------------------------
def parse_long_csv(f: SourceFile, uri: str, header: list[str], rows: Iterable[tuple[int, dict[str, str]]],
                   problems: list[str], out: _Records) -> None:
    """The long format: one row per (model, mode, breakdown, key)."""
    if _missing(header, LONG_REQUIRED, uri, problems):
        return
    known = {*LONG_REQUIRED, "source", "input_truncation", "date", "suite"}
    for line, row in rows:
        where = f"{uri}: line {line}"
        ok = _nonempty(row, ("benchmark", "model_name", "mode", "breakdown", "key"), where, problems)
        score = _score(row["score"], where, "score", problems)
        trunc = _int_or_none(row.get("input_truncation", ""), where, "input_truncation", problems)
        if row.get("breakdown") == "length" and row.get("key") and parse_length(row["key"]) is None:
            problems.append(f"{where}, field 'key': {row['key']!r} is not a length (e.g. 8k, 128k, 4096)")
            ok = False
        if not ok or score is None:
            continue
        out.add(
            benchmark=row["benchmark"], suite=row.get("suite") or row["benchmark"],
            source=row.get("source") or f.rel, model_name=row["model_name"], mode=row["mode"],
            breakdown=row["breakdown"], key=row["key"], score=score, input_truncation=trunc,
            date=row.get("date", ""), f=f, location=f"line {line}",
            extra={k: v for k, v in row.items() if k not in known and v},
        )


def parse_length_csv(f: SourceFile, uri: str, header: list[str], rows: Iterable[tuple[int, dict[str, str]]],
                     problems: list[str], out: _Records) -> None:
    """The per-length format (RULER tables): one row per (model, mode, length)."""
    if _missing(header, LENGTH_REQUIRED, uri, problems):
        return
    known = {*LENGTH_REQUIRED, "source", "suite"}
    for line, row in rows:
        where = f"{uri}: line {line}"
        ok = _nonempty(row, ("benchmark", "model_name", "mode", "length"), where, problems)
        score = _score(row["score"], where, "score", problems)
        if row.get("length") and parse_length(row["length"]) is None:
            problems.append(f"{where}, field 'length': {row['length']!r} is not a length (e.g. 8k, 128k, 4096)")
            ok = False
        if not ok or score is None:
            continue
        source = row.get("source") or f.rel
        out.add(
            benchmark=row["benchmark"], suite=row.get("suite") or source, source=source,
            model_name=row["model_name"], mode=row["mode"], breakdown="length", key=row["length"],
            score=score, input_truncation=None, date="", f=f, location=f"line {line}",
            extra={k: v for k, v in row.items() if k not in known and v},
        )


def parse_csv(f: SourceFile, uri: str, problems: list[str], out: _Records) -> None:
    """Dispatch on the header: ``breakdown`` -> long format, ``length`` -> per-length format."""
    header, rows = _csv_rows(f, uri, problems)
    if not header:
        return
    if "breakdown" in header:
        return parse_long_csv(f, uri, header, rows, problems, out)
    if "length" in header:
        return parse_length_csv(f, uri, header, rows, problems, out)
    problems.append(f"{uri}: line 1, field 'breakdown': missing column — a score file needs either "
                    f"{', '.join(LONG_REQUIRED)} (long format) or {', '.join(LENGTH_REQUIRED)} "
                    f"(per-length format); header: {', '.join(header)}")
    return None


def parse_lbp_summary(f: SourceFile, uri: str, problems: list[str], out: _Records) -> None:
    """A LongBench-Pro per-model summary JSON as published (``average_*`` entries, fraction x 100)."""
    parts = f.rel.split("/")
    name = parts[-1]
    m = LBP_NAME_RE.match(name)
    if not m:
        problems.append(f"{uri}: file name: not a LongBench-Pro summary name "
                        "(<mode>_context-<N>_bon-<k>_summary.json, mode thinking|nonthinking)")
        return
    model = m.group("model") or (parts[-2] if len(parts) >= 3 else "")
    if not model:
        problems.append(f"{uri}: file name: no model name — put the file in a folder named after the model "
                        f"({BENCHMARK_DIR}/<model>/{name}) as LongBench-Pro publishes it")
        return
    try:
        with f.open() as fh:
            doc = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"{uri}: not valid JSON ({exc})")
        return
    if not isinstance(doc, dict):
        problems.append(f"{uri}: top level: expected a JSON object")
        return
    for fld in LBP_REQUIRED:
        if fld not in doc:
            problems.append(f"{uri}: entry '{fld}': missing")
    if any(fld not in doc for fld in LBP_REQUIRED):
        return
    common = dict(benchmark="LongBench-Pro", suite="LongBench-Pro", source=f"LongBench-Pro summary file {f.rel}",
                  model_name=model, mode=m.group("mode"), input_truncation=int(m.group("ctx")),
                  date=str(doc.get("date", "")), f=f, extra={"bon": m.group("bon")})
    score = _score(doc["average_overall_metric"], f"{uri}: entry 'average_overall_metric'", "score", problems, 100.0)
    if score is not None:
        out.add(breakdown="overall", key="overall", score=score, location="average_overall_metric", **common)
    for entry, breakdown in LBP_BREAKDOWNS.items():
        cells = doc.get(entry)
        if cells is None:
            continue
        if not isinstance(cells, dict):
            problems.append(f"{uri}: entry '{entry}': expected an object of cell -> score")
            continue
        for key, raw in cells.items():
            loc = f"{entry}.{key}"
            if breakdown == "length" and parse_length(key) is None:
                problems.append(f"{uri}: entry '{loc}', field 'key': {key!r} is not a length")
                continue
            score = _score(raw, f"{uri}: entry '{loc}'", "score", problems, 100.0)
            if score is not None:
                out.add(breakdown=breakdown, key=str(key), score=score, location=loc, **common)


def load_scores(files: list[SourceFile], uri_of: Any = None) -> pd.DataFrame:
    """Parse and validate every score file into one long table (:data:`SCORE_COLUMNS`, SPEC 5).

    Files are streamed row by row into compact columns, so memory is bounded by the table, not the
    files. Raises :class:`BenchmarkDataError` listing every problem (file, line or entry, field),
    including a cell (benchmark, suite, model, mode, breakdown, key) that appears twice, within or
    across files (a length key compares as tokens: 8k = 8192).
    """
    uri_of = uri_of or (lambda rel: rel)
    problems: list[str] = []
    out = _Records()
    for f in sorted(files, key=lambda x: x.rel):
        uri = uri_of(f.rel)
        if f.rel.lower().endswith(".json"):
            parse_lbp_summary(f, uri, problems, out)
        else:
            parse_csv(f, uri, problems, out)
    problems += out.duplicates(uri_of)
    if problems:
        raise BenchmarkDataError(problems)
    return out.frame()


# ---- aliases, model types, reference ------------------------------------------------------------
def load_aliases(f: SourceFile, uri: str | None = None) -> pd.DataFrame:
    """The alias table: model key -> benchmark entry, mode and checkpoint relation (SPEC 5).

    A malformed file (missing column, empty required field, unknown checkpoint relation, duplicate alias)
    raises :class:`BenchmarkDataError` naming file, line and field. Aliases of models the registry does not
    list are kept here; :func:`registry_aliases` sets them aside (the file covers the study, a registry may
    hold fewer models).
    """
    uri = uri or f.rel
    problems: list[str] = []
    header, row_iter = _csv_rows(f, uri, problems)
    rows = list(row_iter)  # a small table, read twice below
    if header and not _missing(header, ALIAS_REQUIRED, uri, problems):
        seen: dict[tuple[str, ...], int] = {}
        for line, row in rows:
            where = f"{uri}: line {line}"
            _nonempty(row, ALIAS_REQUIRED, where, problems)
            if row["checkpoint_relation"] and row["checkpoint_relation"] not in CHECKPOINT_RELATIONS:
                problems.append(f"{where}, field 'checkpoint_relation': {row['checkpoint_relation']!r} is not one "
                                f"of {', '.join(CHECKPOINT_RELATIONS)}")
            ident = (row["model"], row["benchmark"], row["benchmark_model_name"], row["mode"])
            if ident in seen:
                problems.append(f"{where}, field 'benchmark_model_name': duplicate alias (same as line {seen[ident]})")
            seen.setdefault(ident, line)
    if problems:
        raise BenchmarkDataError(problems)
    recs = [{**{c: row.get(c, "") for c in ALIAS_COLUMNS}, "file": f.rel, "location": f"line {line}"}
            for line, row in rows]
    return pd.DataFrame(recs, columns=ALIAS_COLUMNS)


def registry_aliases(aliases: pd.DataFrame, registry_keys: Iterable[str], uri_of: Any = None
                     ) -> tuple[pd.DataFrame, list[str]]:
    """The aliases of the models the registry lists, and one note per other alias naming its file, line and
    field (such an alias is ignored: nothing is measured for its model here)."""
    uri_of = uri_of or (lambda rel: rel)
    known = aliases["model"].isin(set(registry_keys))
    notes = [f"{uri_of(row.file)}: {row.location}, field 'model': {row.model!r} is not a registry model key; "
             "alias ignored" for row in aliases[~known].itertuples(index=False)]
    return aliases[known].reset_index(drop=True), notes


def check_aliases(aliases: pd.DataFrame, scores: pd.DataFrame, uri_of: Any = None) -> list[str]:
    """Problems of aliases whose (benchmark, benchmark_model_name, mode) has no score (SPEC 5)."""
    uri_of = uri_of or (lambda rel: rel)
    scores = scores[scores["model_name"].isin(set(aliases["benchmark_model_name"]))]  # only these can match
    have = set(zip(scores["benchmark"], scores["model_name"], scores["mode"], strict=True))
    names = set(zip(scores["benchmark"], scores["model_name"], strict=True))
    problems = []
    for row in aliases.itertuples(index=False):
        if (row.benchmark, row.benchmark_model_name, row.mode) in have:
            continue
        if (row.benchmark, row.benchmark_model_name) in names:
            modes = sorted(set(scores.loc[(scores["benchmark"] == row.benchmark)
                                          & (scores["model_name"] == row.benchmark_model_name), "mode"]))
            problems.append(f"{uri_of(row.file)}: {row.location}, field 'mode': {row.benchmark} has no "
                            f"{row.mode!r} scores for {row.benchmark_model_name!r} (modes: {', '.join(modes)})")
        else:
            problems.append(f"{uri_of(row.file)}: {row.location}, field 'benchmark_model_name': "
                            f"{row.benchmark_model_name!r} has no {row.benchmark} scores in {BENCHMARK_DIR}/")
    return problems


def load_model_types(files: list[SourceFile], uri_of: Any = None) -> pd.DataFrame:
    """Benchmark model types (Instruct / Mixed / Thinking) and claimed context, one table per benchmark."""
    uri_of = uri_of or (lambda rel: rel)
    problems: list[str] = []
    recs = []
    for f in files:
        uri = uri_of(f.rel)
        benchmark = MODEL_TYPES_FILES.get(f.rel.rsplit("/", 1)[-1], "")
        header, rows = _csv_rows(f, uri, problems)
        if not header or _missing(header, MODEL_TYPE_REQUIRED, uri, problems):
            continue
        seen: dict[str, int] = {}
        for line, row in rows:
            where = f"{uri}: line {line}"
            _nonempty(row, MODEL_TYPE_REQUIRED, where, problems)
            if row["model_name"] in seen:
                problems.append(f"{where}, field 'model_name': duplicate row (same as line {seen[row['model_name']]})")
            seen.setdefault(row["model_name"], line)
            recs.append({"benchmark": benchmark, "model_name": row["model_name"], "type": row["type"],
                         "claimed_context": row.get("claimed_context", ""), "url": row.get("url", ""),
                         "file": f.rel, "location": f"line {line}"})
    if problems:
        raise BenchmarkDataError(problems)
    return pd.DataFrame(recs, columns=MODEL_TYPE_COLUMNS)


def analysis_of(metric: str) -> str:
    """Which analysis produces a metric name (SPEC 2-4): pca, rotation or plasticity."""
    if metric.startswith("pca_") or metric.startswith("pc"):
        return "pca"
    if metric.startswith("ap_") or metric.startswith("pp_"):
        return "plasticity"
    return "rotation"


def load_reference(files: list[SourceFile], uri_of: Any = None) -> pd.DataFrame:
    """The thesis's published values (every CSV of ``reference/``), ``value_source = "reference"`` (SPEC 5).

    The same (model, metric, key) published in several tables with the same value is kept once (its
    sources joined with " | "); with different values it is an error naming both places.
    """
    uri_of = uri_of or (lambda rel: rel)
    problems: list[str] = []
    recs: dict[tuple[str, str, str], dict[str, Any]] = {}
    places: dict[tuple[str, str, str], str] = {}
    for f in sorted(files, key=lambda x: x.rel):
        uri = uri_of(f.rel)
        header, rows = _csv_rows(f, uri, problems)
        if not header or _missing(header, REFERENCE_REQUIRED, uri, problems):
            continue
        for line, row in rows:
            where = f"{uri}: line {line}"
            ok = _nonempty(row, ("source", "model", "metric"), where, problems)
            try:
                value = float(row["value"])
                if not math.isfinite(value):
                    raise ValueError
            except ValueError:
                problems.append(f"{where}, field 'value': {row['value']!r} is not a finite number")
                continue
            if not ok:
                continue
            ident = (row["model"], row["metric"], row["key"])
            if ident in recs:
                prev = recs[ident]
                if not math.isclose(prev["value"], value, rel_tol=1e-9, abs_tol=0.0):
                    problems.append(f"{where}, field 'value': {row['model']} / {row['metric']} / {row['key']!r} = "
                                    f"{value} contradicts {places[ident]} ({prev['value']})")
                elif row["source"] not in prev["source"].split(" | "):
                    prev["source"] += " | " + row["source"]
                continue
            places[ident] = where
            recs[ident] = {"model": row["model"], "metric": row["metric"], "key": row["key"], "value": value,
                           "median": float("nan"), "lo": float("nan"), "hi": float("nan"), "n_heads": 0,
                           "unit": "", "options": "{}", "analysis": analysis_of(row["metric"]),
                           "value_source": "reference", "source": row["source"]}
    if problems:
        raise BenchmarkDataError(problems)
    df = pd.DataFrame(list(recs.values()), columns=REFERENCE_COLUMNS)
    df["n_heads"] = df["n_heads"].astype("int64")
    return df
