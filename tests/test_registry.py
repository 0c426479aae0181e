"""The shipped registry is complete and valid; bad entries are rejected naming entry and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from qk_core.config.registry import RegistryError, load_registry

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "data" / "registry.toml"


def test_shipped_registry_has_spec_models() -> None:
    reg = load_registry(SHIPPED)
    study = [k for k, m in reg.models.items() if m.series is None and "study" in m.groups]
    assert len(study) == 13
    assert set(reg.in_group("demo")) == {"smollm2-135m", "gemma3-270m"}
    series = reg.series["smollm3-3b"].checkpoint_keys
    assert len(series) == 10 and series[0] == "smollm3-3b@stage1-step-40000"
    windows = [reg.model(k).window for k in series]
    assert windows == [4096] * 6 + [32768] * 2 + [65536] * 2
    assert [reg.model(k).bucket for k in series] == [w // 16 for w in windows]
    q = reg.model("qwen3-8b")
    assert q.config_overrides["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert reg.model("mistral-v0.2-7b").window == 32768
    assert all(not m.trust_remote_code for m in reg.models.values())
    assert reg.model("smollm3-3b@stage2-step-4200000").source.revision == "stage2-step-4200000"
    assert reg.model("smollm3-3b@stage2-step-4200000").tokenizer.repo == "HuggingFaceTB/SmolLM3-3B"


BASE = """
[corpora.c]
kind = "local_file"
path = "x.jsonl"
"""


@pytest.mark.parametrize(
    ("body", "entry", "field"),
    [
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\ncorpus="c"\n', "m", "window"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="nope"\n', "m", "corpus"),
        ('[models.m]\nfamily="llama"\nsource={hub="not a repo"}\nwindow=64\ncorpus="c"\n', "m", "source.hub"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\nbucket=128\ncorpus="c"\n', "m", "bucket"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ndtype="int8"\n', "m", "dtype"),
        ('[models."Bad Slug"]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\n', "Bad Slug", "slug"),
        ('[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ntrust_remote_code="yes"\n',
         "m", "trust_remote_code"),
        ('[series.s]\nfamily="smollm3"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ncheckpoints=[{window=64}]\n',
         "s", "checkpoints[0].revision"),
    ],
)
def test_bad_entries_name_entry_and_field(tmp_path: Path, body: str, entry: str, field: str) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(BASE + body)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    msg = str(err.value)
    assert str(path) in msg and f"'{entry}'" in msg and f"'{field}'" in msg


def test_new_entry_adds_partitions_and_removed_ones_are_reported(tmp_path: Path) -> None:
    from qk_assets.partitions import partition_requests, registry_pairs

    shipped = load_registry(SHIPPED)
    existing = {"model": [*shipped.models, "gone-model"], "corpus": list(shipped.corpora), "series": []}
    text = SHIPPED.read_text() + (
        '\n[corpora.extra-corpus]\nkind="local_file"\npath="x.jsonl"\n'
        '\n[models.extra-model]\nfamily="llama"\nsource={local="m"}\nwindow=64\n'
        'corpora=["extra-corpus", "sotu-demo"]\n')
    path = tmp_path / "registry.toml"
    path.write_text(text)
    reg = load_registry(path)
    adds, gone = partition_requests(reg, existing)
    added = {r.partitions_def_name: list(r.partition_keys) for r in adds}
    assert added == {"model": ["extra-model"], "corpus": ["extra-corpus"], "series": list(shipped.series)}
    assert gone == {"model": ["gone-model"]}
    assert reg.model("extra-model").corpus == "extra-corpus"  # the first listed: what the study joins use
    assert [p for p in registry_pairs(reg) if p[0] == "extra-model"] == [
        ("extra-model", "extra-corpus"), ("extra-model", "sotu-demo")]
    assert reg.model("qwen3-8b").corpora == ("longbench-pro",)  # the default corpus


MODEL = '[models.m]\nfamily="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\n'


@pytest.mark.parametrize(
    ("extra", "entry", "field", "why"),
    [
        ('capture={include_sliding="true"}\n', "m", "capture.include_sliding", "valid boolean"),
        ('capture={position_sampler="bernoulli", bernoulli_rate=-1.0}\n', "m", "capture.bernoulli_rate", "greater"),
        ('capture={heads=3.5}\n', "m", "capture.heads", "valid integer"),
        ('capture={heads="300"}\n', "m", "capture.heads", "valid integer"),
        ('capture={per_bucket=0}\n', "m", "capture.per_bucket", "greater"),
        ('capture={layers=[0, -1]}\n', "m", "capture.layers[1]", "greater"),
        ('capture={hedas=3}\n', "m", "capture.hedas", "unknown"),
        ('analysis={plasticty={covariance="diagonal"}}\n', "m", "analysis.plasticty", "unknown"),
        ('analysis={pca={n_componets=3}}\n', "m", "analysis.pca.n_componets", "unknown"),
        ('analysis={pca={n_components=0}}\n', "m", "analysis.pca.n_components", "greater"),
        ('analysis={rotation={complement="yes"}}\n', "m", "analysis.rotation.complement", "valid boolean"),
        ('analysis={plasticity={bootstrap=-5}}\n', "m", "analysis.plasticity.bootstrap", "greater"),
        ('analysis={plasticity={length_bin_edges=[0, 1.5]}}\n', "m", "analysis.plasticity.length_bin_edges[1]",
         "valid integer"),
        ('analysis={plasticity={ci=nan}}\n', "m", "analysis.plasticity.ci", "less than"),
        ('window="64"\n', "m", "window", "valid integer"),
        ('groups="study"\n', "m", "groups", "valid list"),
        ('descripton="typo"\n', "m", "descripton", "unknown"),
        ('tokenizer={hub="a/b", revison="x"}\n', "m", "tokenizer.revison", "unknown"),
        ('source={hub="a/b", local="x"}\n', "m", "source", "exactly one"),
        ('analysis={interventions={corpora=["zz"]}}\n', "m", "analysis.interventions.corpora",
         "not one of the model's corpora"),
        ('analysis={interventions={corpora="c"}}\n', "m", "analysis.interventions.corpora", "valid tuple"),
    ],
)
def test_schema_rejects_wrong_types_ranges_and_unknown_keys(tmp_path: Path, extra: str, entry: str, field: str,
                                                             why: str) -> None:
    """Every nesting level is checked (issue 14.3); before the schema these loaded and changed results."""
    path = tmp_path / "registry.toml"
    body = MODEL.replace('window=64\n', "") if extra.startswith("window") else MODEL
    body = body.replace('source={hub="a/b"}\n', "") if extra.startswith("source") else body
    path.write_text(BASE + body + extra)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    msg = str(err.value)
    assert str(path) in msg and f"entry '{entry}'" in msg and f"'{field}'" in msg, msg
    assert why in msg, msg


@pytest.mark.parametrize(
    ("text", "entry", "field"),
    [
        ('[defaults]\ncapture={seed=-1}\n' + MODEL, "defaults", "capture.seed"),
        ('[defaults]\ncorpuss="c"\n' + MODEL, "defaults", "corpuss"),
        ('[corpora.d]\nkind="sotu"\nurl="https://x"\nsha256="00"\n', "d", "sha256"),
        ('[corpora.d]\nkind="local_file"\npath="x"\nn_docs="5"\n', "d", "n_docs"),
        ('[corpora.d]\nkind="local_file"\npaht="x"\n', "d", "paht"),
        ('[series.s]\nfamily="x"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\n'
         'checkpoints=[{revision="r1", capture={heads=true}}]\n', "s@r1", "capture.heads"),
        ('[series.s]\nfamily="x"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ncheckpoints=[{revision="bad rev"}]\n',
         "s", "checkpoints[0].revision"),
    ],
)
def test_schema_covers_defaults_corpora_and_series(tmp_path: Path, text: str, entry: str, field: str) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(BASE + text)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    msg = str(err.value)
    assert str(path) in msg and f"entry '{entry}'" in msg and f"'{field}'" in msg, msg


def test_valid_values_keep_their_meaning(tmp_path: Path) -> None:
    """Integers are accepted where a float belongs, lists become tuples, table merges keep both sides."""
    path = tmp_path / "registry.toml"
    path.write_text(BASE + '[defaults]\ncapture={heads=7}\nanalysis={pca={n_components=4}}\n' + MODEL
                    + 'capture={position_sampler="bernoulli", bernoulli_rate=3, layers=[0, 2]}\n'
                    + 'analysis={plasticity={covariance="diagonal"}}\n')
    m = load_registry(path).model("m")
    assert m.capture.heads == 7 and m.capture.bernoulli_rate == 3.0 and m.capture.layers == (0, 2)
    assert m.analysis == {"pca": {"n_components": 4}, "plasticity": {"covariance": "diagonal"}}


def test_local_path_with_braces(tmp_path: Path) -> None:
    """A local path may contain '{0}' or other braces; only '{revision}' is substituted."""
    path = tmp_path / "registry.toml"
    path.write_text(BASE + '[models.m]\nfamily="llama"\nsource={local="w/{0}/{x}"}\nwindow=64\ncorpus="c"\n'
                    + '[series.s]\nfamily="llama"\nsource={local="ck/{revision}"}\nwindow=64\ncorpus="c"\n'
                    + 'checkpoints=[{revision="r1"}]\n')
    reg = load_registry(path)
    assert reg.model("m").source.path == str(tmp_path / "w" / "{0}" / "{x}")
    assert reg.model("s@r1").source.path == str(tmp_path / "ck" / "r1")


def test_run_config_overrides_use_the_same_schema() -> None:
    """Registry table < run config, both checked strictly (PCA, rotation, plasticity options)."""
    from qk_core.config.options import PlasticityOptionsError, resolve_options

    assert resolve_options("plasticity", {"plasticity": {"seed": 1}}, {"seed": 3}).seed == 3
    with pytest.raises(PlasticityOptionsError, match=r"'keep_pairs'.*valid boolean"):
        resolve_options("plasticity", {}, {"keep_pairs": "false"})
    with pytest.raises(PlasticityOptionsError, match=r"'pairs_per_bucket'.*greater"):
        resolve_options("plasticity", {"plasticity": {"pairs_per_bucket": 4}}, {"pairs_per_bucket": -1})
    with pytest.raises(ValueError, match=r"'n_components'.*valid integer"):
        resolve_options("pca", None, {"n_components": "3"})
    with pytest.raises(ValueError, match="'separation'"):
        resolve_options("rotation", {"rotation": {"separation": "centriod"}})
    with pytest.raises(ValueError, match="unknown analysis 'pcaa'"):
        resolve_options("pcaa")


def test_registry_that_is_not_utf8_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_bytes((BASE + MODEL).encode() + b'description = "caf\xe9"\n')
    with pytest.raises(RegistryError, match=r"registry\.toml: not UTF-8 text"):
        load_registry(path)


@pytest.mark.parametrize("value", ['["nope"]', "[]", '["c", "c"]', '"c"'])
def test_bad_corpora_name_entry_and_field(tmp_path: Path, value: str) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(BASE + f'[models.m]\nfamily="llama"\nsource={{hub="a/b"}}\nwindow=64\ncorpora={value}\n')
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    assert str(path) in str(err.value) and "'m'" in str(err.value) and "'corpora'" in str(err.value)


def test_asset_run_config_is_checked_with_the_registry_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The geometry / plasticity assets merge registry ``analysis.*`` tables with their run config and check
    the result with the same schema: a bad run-config value fails naming the option."""
    path = tmp_path / "registry.toml"
    path.write_text(BASE + MODEL + 'analysis={pca={n_components=4}, plasticity={bootstrap=7}}\n')
    monkeypatch.setenv("QK_REGISTRY", str(path))
    from qk_assets import partitions
    from qk_assets.defs.geometry import GeometryConfig, resolve_options
    from qk_assets.defs.plasticity import plasticity_options
    from qk_assets.options import AnalysisConfig
    from qk_core.config.options import PlasticityOptionsError

    partitions.registry.cache_clear()
    try:
        pca, rot = resolve_options("m", GeometryConfig(options={"rotation": {"separation": "eigen"}}))
        assert (pca.n_components, rot.separation) == (4, "eigen")
        with pytest.raises(ValueError, match=r"pca options: field 'n_components': Input should be greater than"):
            resolve_options("m", GeometryConfig(options={"pca": {"n_components": 0}}))
        with pytest.raises(ValueError, match=r"rotation options: field 'separation'"):
            resolve_options("m", GeometryConfig(options={"rotation": {"separation": "centriod"}}))
        with pytest.raises(ValueError, match=r"\['plasticity'\] not read by this asset"):
            resolve_options("m", GeometryConfig(options={"plasticity": {"seed": 1}}))
        assert plasticity_options("m", AnalysisConfig(options={"plasticity": {"seed": 2}})).bootstrap == 7
        with pytest.raises(PlasticityOptionsError, match=r"field 'bootstrap'.*greater than or equal to 0"):
            plasticity_options("m", AnalysisConfig(options={"plasticity": {"bootstrap": -1}}))
    finally:
        partitions.registry.cache_clear()


@pytest.mark.parametrize(("table", "field"), [("models", "slug"), ("series", "slug"), ("corpora", "name")])
def test_a_name_with_a_trailing_newline_is_refused(tmp_path: Path, table: str, field: str) -> None:
    """Names are checked whole (``fullmatch``): ``"m\\n"`` would make a folder with a newline in its name."""
    path = tmp_path / "registry.toml"
    bodies = {"models": 'family="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\n',
              "series": 'family="llama"\nsource={hub="a/b"}\nwindow=64\ncorpus="c"\ncheckpoints=[{revision="r1"}]\n',
              "corpora": 'kind = "local_file"\npath = "y.jsonl"\n'}
    path.write_text(BASE + f'[{table}."x\\n"]\n{bodies[table]}')
    with pytest.raises(RegistryError, match=f"'{field}'") as err:
        load_registry(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("extra", "field", "why"), [
    ("window=1000000000000\n", "window", "less than or equal to 16777216"),
    ("window=9223372036854775807\n", "window", "less than or equal to 16777216"),
    ("window=64\nbucket=1\n", "bucket", "greater than or equal to 4"),
    ("window=16\nbucket=16\n", "bucket", "at most half the window"),
    ("window=64\nbucket=8\ncapture={per_bucket=9}\n", "capture.per_bucket", "9 positions per bucket of 8"),
    ("window=64\ncapture={position_sampler='bernoulli', bernoulli_rate=5e-324}\n", "capture.bernoulli_rate",
     "greater than or equal to 0.01"),
    ("window=64\nanalysis={plasticity={bootstrap=1000000000000}}\n", "analysis.plasticity.bootstrap", "100000"),
    ("window=64\nanalysis={plasticity={pairs_per_bucket=1000000000000}}\n", "analysis.plasticity.pairs_per_bucket",
     "1048576"),
    ("window=64\nanalysis={interventions={repeats=0}}\n", "analysis.interventions.repeats", "greater than or equal"),
    ("window=64\nconfig_overrides={num_hidden_layers=1000000}\n", "config_overrides", "'num_hidden_layers'"),
    ("window=64\nconfig_overrides={text_config={hidden_size=-1}}\n", "config_overrides", "'text_config.hidden_size'"),
    ("window=64\nconfig_overrides={a={b={c={d={e={f=1}}}}}}\n", "config_overrides", "nests deeper than 4"),
])
def test_absurd_values_are_refused_naming_entry_and_field(tmp_path: Path, extra: str, field: str, why: str) -> None:
    """Every numeric option has a range that means something (issue 25.1): refused before anything runs."""
    path = tmp_path / "registry.toml"
    path.write_text(BASE + '[models.m]\nfamily="llama"\nsource={hub="a/b"}\ncorpus="c"\n' + extra)
    with pytest.raises(RegistryError) as err:
        load_registry(path)
    msg = str(err.value)
    assert str(path) in msg and "entry 'm'" in msg and f"field '{field}'" in msg and why in msg, msg


def test_tables_nested_too_deep_to_parse_are_a_registry_error(tmp_path: Path) -> None:
    path = tmp_path / "registry.toml"
    path.write_text(BASE + '[models.m]\nfamily="llama"\nsource={hub="a/b"}\ncorpus="c"\nwindow=64\n'
                    "config_overrides=" + "{a=" * 3000 + "1" + "}" * 3000 + "\n")
    with pytest.raises(RegistryError, match="nested too deep"):
        load_registry(path)
