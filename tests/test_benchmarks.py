"""Benchmark files -> one long score table, aliases, model types, reference values (SPEC 5).

Ground truth is independent of the parser: the seed CSVs read with the csv module, the published
LongBench-Pro numbers (fraction in the official summary file, x 100 rounded to 4 decimals in the CSV),
and planted bad rows whose file, line and field are known.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from s3 import MotoS3

from qk_core.benchmarks.scores import (
    BENCHMARK_DIR,
    SCORE_COLUMNS,
    BenchmarkDataError,
    SourceFile,
    bin_upper_tokens,
    check_aliases,
    ensure_seed_files,
    load_aliases,
    load_model_types,
    load_reference,
    load_scores,
    parse_length,
    registry_aliases,
    scan_files,
    score_files,
)
from qk_core.config.registry import load_registry
from qk_core.io.storage import Storage

REPO = Path(__file__).resolve().parent.parent
SEED = REPO / "data" / "benchmarks"
LBP_CSV = SEED / "longbench_pro.csv"
RULER_CSV = SEED / "ruler.csv"

# The published average_* entries of LongBench-Pro/output/Qwen3-8B/nonthinking_context-120000_bon-3_summary.json
# (caskcsg/longcontext, 2025-12-08), full precision.
QWEN3_8B_NONTHINKING = {
    "average_overall_metric": 0.3341263002850569,
    "average_token_length_metric": {
        "8k": 0.3784198847034242, "16k": 0.37953608827547447, "32k": 0.36499771721065843,
        "64k": 0.28008358934905153, "128k": 0.3132115847486681, "256k": 0.2885089374230642},
    "average_contextual_requirement_metric": {"Full": 0.3137072166929107, "Partial": 0.3601142248568793},
    "average_difficulty_metric": {"Easy": 0.428559130222621, "Moderate": 0.25195385511657276,
                                  "Hard": 0.31092306311632556, "Extreme": 0.2998920915703961},
    "average_language_metric": {"Chinese": 0.33785469604432067, "English": 0.3303979045257931},
}


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def summary_json(average: dict, tasks: dict[str, float]) -> bytes:
    """A summary file in the published layout, with BoN / pass@k blocks that must be ignored."""
    doc = {"date": "2025-12-08", "total_questions_num": 1500, "inference_iterations": 3,
           "average_overall_metric": average["average_overall_metric"],
           "inference_iteration_1_overall_metric": 0.01}
    for entry in ("average_token_length_metric", "average_contextual_requirement_metric",
                  "average_difficulty_metric"):
        doc[entry] = average[entry]
    doc["average_primary_task_metric"] = tasks
    doc["average_language_metric"] = average["average_language_metric"]
    for k in (1, 2, 3):  # best-of-n blocks: different numbers under similar names
        doc[f"BoN-{k}"] = {"overall_metric": 0.99, "token_length": {"8k": 0.99},
                           "difficulty": {"Easy": 0.99}, "language": {"Chinese": 0.99}}
        doc[f"pass@{k}"] = 0.5
    return json.dumps(doc, indent=4).encode()


@pytest.fixture
def local(tmp_path: Path) -> Storage:
    return Storage(tmp_path / "root")


def seed_scores(storage: Storage) -> None:
    for name in ("longbench_pro.csv", "ruler.csv"):
        storage.write_bytes(f"{BENCHMARK_DIR}/{name}", (SEED / name).read_bytes())


# ---- normalisation --------------------------------------------------------------------------------
def test_seed_csvs_normalise_to_one_long_table(local: Storage) -> None:
    seed_scores(local)
    df = load_scores(score_files(local))
    assert list(df.columns) == SCORE_COLUMNS
    lbp, ruler = csv_rows(LBP_CSV), csv_rows(RULER_CSV)
    assert len(df) == len(lbp) + len(ruler)
    assert df["score"].between(0, 100).all()
    # every LongBench-Pro row keeps its cell, score, truncation and provenance
    got = {(r.model_name, r.mode, r.breakdown, r.key): r for r in df[df["benchmark"] == "LongBench-Pro"].itertuples()}
    for row in lbp[::97]:
        rec = got[(row["model_name"], row["mode"], row["breakdown"], row["key"])]
        assert rec.score == pytest.approx(float(row["score"]), abs=1e-12)
        assert rec.input_truncation == int(row["input_truncation"])
        assert rec.source == row["source"] and rec.date == row["date"]
        assert rec.suite == "LongBench-Pro" and rec.file == f"{BENCHMARK_DIR}/longbench_pro.csv"
    # RULER rows: breakdown "length", key = the length, one suite per published table
    rul = df[df["benchmark"] == "RULER"]
    assert set(rul["breakdown"]) == {"length"}
    assert set(rul["suite"]) == {r["source"] for r in ruler}
    for row in ruler[::17]:
        sel = rul[(rul["model_name"] == row["model_name"]) & (rul["mode"] == row["mode"])
                  & (rul["key"] == row["length"]) & (rul["source"] == row["source"])]
        assert len(sel) == 1 and sel["score"].iloc[0] == pytest.approx(float(row["score"]))
        assert sel["length_tokens"].iloc[0] == int(row["length"][:-1]) * 1024
    assert json.loads(rul["extra"].iloc[0])["hf_id"]  # unknown columns are kept as provenance


def test_summary_json_reproduces_the_csv_rows(local: Storage) -> None:
    """The official per-model summary file, dropped in unchanged, gives exactly the CSV's rows."""
    want = [r for r in csv_rows(LBP_CSV) if r["model_name"] == "Qwen3-8B" and r["mode"] == "nonthinking"]
    # primary-task cells: the CSV value / 100 (the CSV keeps 4 decimals of fraction x 100)
    tasks = {r["key"]: float(r["score"]) / 100 for r in want if r["breakdown"] == "primary_task"}
    rel = f"{BENCHMARK_DIR}/longbench-pro/Qwen3-8B/nonthinking_context-120000_bon-3_summary.json"
    local.write_bytes(rel, summary_json(QWEN3_8B_NONTHINKING, tasks))
    df = load_scores(score_files(local))
    assert len(df) == len(want) == 26
    got = {(r.breakdown, r.key): r for r in df.itertuples()}
    for row in want:
        rec = got[(row["breakdown"], row["key"])]
        assert rec.score == pytest.approx(float(row["score"]), abs=5e-5)  # published rounding
        assert (rec.benchmark, rec.model_name, rec.mode) == (row["benchmark"], "Qwen3-8B", "nonthinking")
        assert rec.input_truncation == int(row["input_truncation"]) == 120000
        assert rec.date == row["date"] and rec.file == rel and rec.suite == "LongBench-Pro"
    assert got[("overall", "overall")].score == pytest.approx(33.4126, abs=5e-5)


def test_summary_json_flat_name_and_unaliased_model_is_fine(local: Storage) -> None:
    tasks = {"T1. Retrieval & Ranking": 0.5}
    local.write_bytes(f"{BENCHMARK_DIR}/NewModel-7B_thinking_context-128000_bon-3_summary.json",
                      summary_json(QWEN3_8B_NONTHINKING, tasks))
    df = load_scores(score_files(local))
    assert set(df["model_name"]) == {"NewModel-7B"} and set(df["mode"]) == {"thinking"}
    assert set(df["input_truncation"]) == {128000}
    aliases = load_aliases(SourceFile(f"{BENCHMARK_DIR}/model_aliases.csv", (SEED / "model_aliases.csv").read_bytes()))
    seed_scores(local)
    problems = check_aliases(aliases, load_scores(score_files(local)))
    assert problems == []  # a model no alias names is ingested without complaint


def test_lengths_and_bins() -> None:
    assert parse_length("8k") == 8192 and parse_length("128K") == 131072 and parse_length("4096") == 4096
    assert parse_length("long") is None
    # a bin [X/2, X) meets benchmark length X (SPEC 4.5)
    assert bin_upper_tokens("0-8k") == parse_length("8k")
    assert bin_upper_tokens("64k-128k") == parse_length("128k")
    assert bin_upper_tokens("4k") == 4096


# ---- bad input ----------------------------------------------------------------------------------
HEADER = "benchmark,model_name,mode,breakdown,key,score\n"


@pytest.mark.parametrize(("name", "text", "where", "field"), [
    ("missing.csv", "benchmark,model_name,mode,breakdown,key\nX,M,m,overall,overall\n", "line 1", "score"),
    ("nonnum.csv", HEADER + "X,M,m,overall,overall,50\nX,M,m,length,8k,n/a\n", "line 3", "score"),
    ("range.csv", HEADER + "X,M,m,overall,overall,0.5\nX,M,m,length,8k,150\n", "line 3", "score"),
    ("dup.csv", HEADER + "X,M,m,overall,overall,50\nX,M,m,length,8k,40\nX,M,m,overall,overall,50\n",
     "line 4", "key"),
    ("len.csv", "benchmark,model_name,mode,length,score\nR,M,m,4k,90\nR,M,m,huge,80\n", "line 3", "length"),
    ("empty.csv", HEADER + "X,,m,overall,overall,50\n", "line 2", "model_name"),
    ("neither.csv", "model,score\nM,5\n", "line 1", "breakdown"),
])
def test_bad_score_file_names_file_line_and_field(local: Storage, name: str, text: str, where: str,
                                                  field: str) -> None:
    local.write_text(f"{BENCHMARK_DIR}/{name}", text)
    with pytest.raises(BenchmarkDataError) as err:
        load_scores(score_files(local), local.uri)
    msg = str(err.value)
    assert local.uri(f"{BENCHMARK_DIR}/{name}") in msg
    assert f"{where}, field '{field}'" in msg


def test_non_utf8_bytes_name_the_file_and_line(local: Storage) -> None:
    """Read as a stream, a file that stops being UTF-8 part-way is an error naming where (issue 14)."""
    body = HEADER + "".join(f"X,M{i},m,overall,overall,50\n" for i in range(3000))
    bad = "X,Caf\xe9,m,overall,overall,50\n".encode("latin-1")
    local.write_bytes(f"{BENCHMARK_DIR}/latin1.csv", body.encode() + bad)
    with pytest.raises(BenchmarkDataError) as err:
        load_scores(score_files(local), local.uri)
    (msg,) = err.value.problems
    assert msg.startswith(f"{local.uri(BENCHMARK_DIR + '/latin1.csv')}: after line ") and "not UTF-8 text" in msg


def test_files_over_the_size_limit_are_refused_naming_them(local: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    seed_scores(local)
    size = local.size(f"{BENCHMARK_DIR}/ruler.csv")
    monkeypatch.setenv("QK_BENCHMARK_MAX_BYTES", str(size - 1))
    with pytest.raises(BenchmarkDataError) as err:
        score_files(local)
    assert any(p.startswith(f"{local.uri(BENCHMARK_DIR + '/ruler.csv')}: {size:,} bytes is over the limit of "
                            f"{size - 1:,} bytes") and "QK_BENCHMARK_MAX_BYTES" in p for p in err.value.problems)
    monkeypatch.setenv("QK_BENCHMARK_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="QK_BENCHMARK_MAX_BYTES: 'lots' is not an integer"):
        score_files(local)
    assert len(load_scores(score_files(local, max_bytes=10**7))) > 0


def test_duplicate_across_files_names_both(local: Storage) -> None:
    seed_scores(local)
    local.write_text(f"{BENCHMARK_DIR}/extra.csv",
                     HEADER + "LongBench-Pro,Qwen3-8B,nonthinking,overall,overall,33.4\n")
    with pytest.raises(BenchmarkDataError) as err:
        load_scores(score_files(local))
    (msg,) = err.value.problems  # files are read in name order: extra.csv first
    line = next(i for i, r in enumerate(csv_rows(LBP_CSV), start=2)
                if (r["model_name"], r["mode"], r["breakdown"]) == ("Qwen3-8B", "nonthinking", "overall"))
    assert msg.startswith(f"benchmarks/longbench_pro.csv: line {line}, field 'key': duplicate row")
    assert msg.endswith("already given by benchmarks/extra.csv: line 2")


@pytest.mark.parametrize(("rel", "doc", "needle"), [
    ("Qwen9/nonthinking_context-1000_bon-3_summary.json", {"average_overall_metric": 0.3},
     "entry 'average_token_length_metric': missing"),
    ("Qwen9/nonthinking_context-1000_bon-3_summary.json",
     {"average_overall_metric": 0.3, "average_token_length_metric": {"8k": "x"}},
     "entry 'average_token_length_metric.8k', field 'score'"),
    ("nonthinking_context-1000_bon-3_summary.json",
     {"average_overall_metric": 0.3, "average_token_length_metric": {"8k": 0.3}}, "no model name"),
    ("Qwen9/nonthinking_context-1000_bon-3_summary.json",  # a table where a number belongs
     {"average_overall_metric": {"mean": 0.3}, "average_token_length_metric": {"8k": 0.3}},
     "entry 'average_overall_metric', field 'score': {'mean': 0.3} is not a number"),
])
def test_bad_summary_json(local: Storage, rel: str, doc: dict, needle: str) -> None:
    local.write_text(f"{BENCHMARK_DIR}/{rel}", json.dumps(doc))
    with pytest.raises(BenchmarkDataError) as err:
        load_scores(score_files(local))
    assert f"{BENCHMARK_DIR}/{rel}" in str(err.value) and needle in str(err.value)


def test_alias_to_absent_benchmark_model_is_flagged(local: Storage) -> None:
    seed_scores(local)
    scores = load_scores(score_files(local))
    text = (SEED / "model_aliases.csv").read_text()
    text += "qwen3-1.7b,Qwen/Qwen3-1.7B,LongBench-Pro,Qwen3-1.7B,nonthinking,same,\n"  # no such LBP entry
    text += "qwen3-0.6b,Qwen/Qwen3-0.6B,LongBench-Pro,Qwen3-4B,non-thinking,same,\n"  # mode LBP does not use
    n_lines = text.count("\n")
    f = SourceFile(f"{BENCHMARK_DIR}/model_aliases.csv", text.encode())
    aliases, ignored = registry_aliases(load_aliases(f), load_registry().model_keys)
    assert ignored == []
    problems = check_aliases(aliases, scores)
    assert problems == [
        f"benchmarks/model_aliases.csv: line {n_lines - 1}, field 'benchmark_model_name': 'Qwen3-1.7B' has no "
        "LongBench-Pro scores in benchmarks/",
        f"benchmarks/model_aliases.csv: line {n_lines}, field 'mode': LongBench-Pro has no 'non-thinking' scores "
        "for 'Qwen3-4B' (modes: nonthinking, thinking)",
    ]


def test_alias_file_validation() -> None:
    text = ("model,hf_repo,benchmark,benchmark_model_name,mode,checkpoint_relation,note\n"
            "qwen3-4b,Qwen/Qwen3-4B,LongBench-Pro,Qwen3-4B,nonthinking,cousin,\n"
            "no-such-model,x,LongBench-Pro,Qwen3-4B,nonthinking,same,\n"
            "qwen3-4b,Qwen/Qwen3-4B,LongBench-Pro,Qwen3-4B,nonthinking,same,\n"
            "qwen3-8b,Qwen/Qwen3-8B,LongBench-Pro,,nonthinking,same,\n")
    with pytest.raises(BenchmarkDataError) as err:
        load_aliases(SourceFile("benchmarks/model_aliases.csv", text.encode()))
    msg = str(err.value)
    assert "line 2, field 'checkpoint_relation'" in msg
    assert "line 4, field 'benchmark_model_name': duplicate alias (same as line 2)" in msg
    assert "line 5, field 'benchmark_model_name'" in msg
    assert "line 3" not in msg  # a model the registry lacks is not a malformed file (registry_aliases)
    with pytest.raises(BenchmarkDataError, match="line 1, field 'checkpoint_relation': missing column"):
        load_aliases(SourceFile("a.csv", b"model,benchmark,benchmark_model_name,mode\nx,y,z,w\n"))


def test_aliases_of_models_the_registry_lacks_are_set_aside_naming_file_line_and_field() -> None:
    text = ("model,hf_repo,benchmark,benchmark_model_name,mode,checkpoint_relation,note\n"
            "qwen3-4b,Qwen/Qwen3-4B,LongBench-Pro,Qwen3-4B,nonthinking,same,\n"
            "no-such-model,x,LongBench-Pro,Qwen3-8B,nonthinking,same,\n"
            "qwen3-8b,Qwen/Qwen3-8B,LongBench-Pro,Qwen3-8B,nonthinking,same,\n")
    aliases = load_aliases(SourceFile("benchmarks/model_aliases.csv", text.encode()))
    assert list(aliases["model"]) == ["qwen3-4b", "no-such-model", "qwen3-8b"]
    kept, ignored = registry_aliases(aliases, ["qwen3-4b", "qwen3-8b"], lambda rel: f"/root/{rel}")
    assert list(kept["model"]) == ["qwen3-4b", "qwen3-8b"] and list(kept["location"]) == ["line 2", "line 4"]
    assert ignored == ["/root/benchmarks/model_aliases.csv: line 3, field 'model': 'no-such-model' is not a "
                       "registry model key; alias ignored"]


def test_seed_aliases_model_types_and_reference() -> None:
    aliases = load_aliases(SourceFile("benchmarks/model_aliases.csv", (SEED / "model_aliases.csv").read_bytes()))
    assert len(aliases) == len(csv_rows(SEED / "model_aliases.csv"))
    assert registry_aliases(aliases, load_registry().model_keys)[1] == []  # the shipped registry has them all
    types = load_model_types([SourceFile("benchmarks/longbench_pro_models.csv",
                                         (SEED / "longbench_pro_models.csv").read_bytes())])
    assert len(types) == 46 and set(types["benchmark"]) == {"LongBench-Pro"}
    assert types.set_index("model_name").loc["Qwen3-8B", "type"] == "Mixed"
    ref_rows = csv_rows(REPO / "data" / "reference" / "thesis_metrics.csv")
    ref = load_reference([SourceFile("reference/thesis_metrics.csv",
                                     (REPO / "data" / "reference" / "thesis_metrics.csv").read_bytes())])
    assert set(ref["value_source"]) == {"reference"}
    assert len(ref) == len({(r["model"], r["metric"], r["key"]) for r in ref_rows})
    row = ref[(ref["model"] == "llama3.1-8b") & (ref["metric"] == "bias_strength")].iloc[0]
    assert row["value"] == pytest.approx(7.83e-4) and "Table 1" in row["source"] and "Table 9" in row["source"]
    assert ref.set_index(["model", "metric"]).loc[("qwen3-4b", "ap_drop"), "analysis"] == "plasticity"


def test_reference_contradiction_is_an_error() -> None:
    text = ("source,model,metric,key,value\nT1,m,ap_drop,,0.1\nT2,m,ap_drop,,0.2\nT3,m,ap_overall,,abc\n")
    with pytest.raises(BenchmarkDataError) as err:
        load_reference([SourceFile("reference/thesis_metrics.csv", text.encode())])
    assert "line 3, field 'value'" in str(err.value) and "contradicts" in str(err.value)
    assert "line 4, field 'value': 'abc'" in str(err.value)


# ---- seeds and change detection, local and S3 ---------------------------------------------------------
@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(tmp_path / "root")
    s3: MotoS3 = request.getfixturevalue("moto_s3")
    return Storage(s3.root("bench"), s3.endpoint)


def test_seeds_copied_once_never_over_user_files(storage: Storage) -> None:
    storage.write_text("benchmarks/ruler.csv", "user's own file")
    written = ensure_seed_files(storage)
    assert "benchmarks/ruler.csv" not in written
    assert storage.read_text("benchmarks/ruler.csv") == "user's own file"
    assert storage.read_bytes("benchmarks/longbench_pro.csv") == LBP_CSV.read_bytes()
    ref = (REPO / "data" / "reference" / "thesis_metrics.csv").read_bytes()
    assert storage.read_bytes("reference/thesis_metrics.csv") == ref
    storage.delete("benchmarks/longbench_pro.csv")  # the user removes a seed: it stays removed
    assert ensure_seed_files(storage) == []
    assert not storage.exists("benchmarks/longbench_pro.csv")


def test_scan_detects_new_changed_removed_by_content(storage: Storage) -> None:
    storage.write_text("benchmarks/a.csv", HEADER + "X,M,m,overall,overall,50\n")
    storage.write_text("reference/r.csv", "source,model,metric,key,value\n")
    storage.write_text("benchmarks/notes.txt", "ignored")
    state, changed = scan_files(storage, {})
    assert changed == ["benchmarks/a.csv", "reference/r.csv"]
    _, changed = scan_files(storage, state)
    assert changed == []
    # same bytes written again: a new token (mtime / ETag may change) but the same content
    storage.write_text("benchmarks/a.csv", HEADER + "X,M,m,overall,overall,50\n")
    state2, changed = scan_files(storage, state)
    assert changed == []
    storage.write_text("benchmarks/a.csv", HEADER + "X,M,m,overall,overall,51\n")
    storage.write_text("benchmarks/sub/b.json", "{}")
    state3, changed = scan_files(storage, state2)
    assert changed == ["benchmarks/a.csv", "benchmarks/sub/b.json"]
    storage.delete("reference/r.csv")
    _, changed = scan_files(storage, state3)
    assert changed == ["reference/r.csv"]
