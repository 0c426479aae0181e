"""The `interventions` multi-asset (SPEC 11) on a tiny model through Dagster: (model, corpus) partition,
registry options, every output written, figures and the verdict statements on the materialisations.

Upstream values (corpus, capture, rotation and plasticity heads) are computed with the real code and
written where the IO manager reads them; stand-in assets of the same keys tell Dagster the dependencies.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pyarrow as pa
import pytest
import tiny_models as tm
import torch
from test_interventions_study import prose

pytestmark = pytest.mark.slow  # the interventions multi-asset through Dagster (about 17 s)

torch.set_num_threads(min(2, torch.get_num_threads()))


def test_interventions_asset_materialises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster import AssetKey, DagsterInstance, asset, materialize

    from qk_assets import partitions

    tm.build_tiny_model("gemma3", tmp_path / "g")
    corpus_file = tm.write_corpus_jsonl(tmp_path / "c.jsonl", [prose(60, s) for s in range(3)])
    opts = {"window": 240, "n_docs": 2, "depths": [0.1, 0.8], "k_fractions": [0.25], "random_sets": 1,
            "bootstrap": 30, "interventions": ["ablate"]}
    reg_file = tm.write_registry(tmp_path / "r.toml", {"t": {
        "family": "gemma3", "source": {"local": str(tmp_path / "g")}, "window": 256, "bucket": 32,
        "capture": {"per_bucket": 4}, "analysis": {"interventions": opts, "plasticity": {"bootstrap": 30}}}},
        corpus_file)
    monkeypatch.setenv("QK_REGISTRY", str(reg_file))
    partitions.registry.cache_clear()
    mod = importlib.reload(importlib.import_module("qk_assets.defs.interventions"))
    try:
        from qk_assets.io_manager import ParquetIOManager, asset_rel
        from qk_assets.resources import StorageResource, TorchDeviceResource
        from qk_core.capture import capture_model
        from qk_core.capture.store import CaptureReader
        from qk_core.config.options import PlasticityOptions
        from qk_core.corpus.build import local_corpus
        from qk_core.geometry.driver import run_rotation
        from qk_core.geometry.heads import iter_capture_heads
        from qk_core.io.storage import Storage
        from qk_core.models.loading import load_model
        from qk_core.plasticity import analyse_model

        reg = partitions.registry()
        entry = reg.model("t")
        storage = Storage(tmp_path / "storage")
        docs = local_corpus({"path": str(corpus_file)})
        cap = capture_model(entry, docs, storage, loaded=load_model(entry, "cpu"))
        reader = CaptureReader(storage, cap.prefix)
        values = {
            "qk_capture": cap.heads,
            "rotation_heads": run_rotation("t", iter_capture_heads(storage, cap.heads))[0],
            "plasticity_heads": analyse_model("t", [(int(r.layer), int(r.q_head)) for r in cap.heads.itertuples()],
                                              reader.read_head, reader.doc_tokens()["example_id"].to_numpy(), 256,
                                              32, PlasticityOptions(bootstrap=30)).heads,
        }
        key = "tiny|t"
        for name, df in values.items():
            df = df.assign(a=df["a"].map(lambda v: None if v is None else list(map(float, v)))) \
                if "a" in df else df
            storage.write_parquet(asset_rel([name], key), pa.Table.from_pandas(df))
        storage.write_parquet(asset_rel(["corpus"], "tiny"), pa.Table.from_pandas(docs))

        stand_ins = [asset(name=n, partitions_def=partitions.model_corpus_partitions())(lambda: None)
                     for n in values]
        stand_ins.append(asset(name="corpus", partitions_def=partitions.corpus_partitions())(lambda: None))
        instance = DagsterInstance.ephemeral()
        partitions.sync_instance(instance, reg)
        res = StorageResource(root=str(tmp_path / "storage"))
        outs = [k.to_user_string() for k in mod.interventions.keys]
        result = materialize([*stand_ins, mod.interventions], selection=[AssetKey(o) for o in outs],
                             partition_key=partitions.pair_key("t", "tiny"), instance=instance,
                             resources={"storage": res, "io_manager": ParquetIOManager(storage=res),
                                        "device": TorchDeviceResource(device="cpu")})
        assert result.success
        mats = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()]
        meta = {m.asset_key.to_user_string(): m.metadata for m in mats}
        assert set(meta) == set(outs)
        assert "fig_accuracy" in meta["intervention_summary"] and "fig_contrast" in meta["intervention_contrast"]
        assert "fig_debias_profile" in meta["intervention_debias_profiles"]
        assert meta["intervention_summary"]["options"].value["n_docs"] == 2  # the registry's table
        trials = storage.read_parquet(asset_rel(["intervention_trials"], key)).to_pandas()
        assert set(trials["intervention"]) == {"baseline", "ablate"} and len(trials) == 4 * (1 + 3)
        verdicts = storage.read_parquet(asset_rel(["intervention_verdicts"], key)).to_pandas()
        assert set(verdicts["hypothesis"].str[:2]) == {"H1", "H2"}
        assert "**" in meta["intervention_verdicts"]["statements"].value
        # the probe's calibration: on the held-out third document only, then the study's baseline row
        cal = storage.read_parquet(asset_rel(["intervention_calibration"], key)).to_pandas()
        assert cal["phase"].iloc[-1] == "study" and (cal["phase"].iloc[:-1] == "calibration").all()
        assert cal["chosen"].iloc[-1] and cal["chosen"].sum() == 2
        held = set(docs["example_id"].iloc[2:3].astype(str))
        assert set(cal.loc[cal["phase"] == "calibration", "documents"]) == held
        assert meta["intervention_calibration"]["status"].value in ("inside", "ceiling", "floor", "outside")
        assert (tmp_path / "storage" / "figures" / "interventions" / "t" / "tiny" / "accuracy.png").exists()
    finally:
        monkeypatch.undo()
        partitions.registry.cache_clear()
        importlib.reload(mod)
