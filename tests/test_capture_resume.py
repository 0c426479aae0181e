"""Resumable and lossless capture (SPEC 1.9): a capture killed mid-way (SIGKILL) resumes with only the
missing documents, and the result equals an uninterrupted capture row for row."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
import torch

from qk_core.capture import capture_model
from qk_core.capture.store import CaptureError, CaptureReader
from qk_core.config.registry import load_registry
from qk_core.corpus.build import local_corpus
from qk_core.io.storage import Storage

pytestmark = pytest.mark.slow  # captures in child processes killed with SIGKILL

torch.set_num_threads(min(2, torch.get_num_threads()))
REPO = Path(__file__).resolve().parent.parent
N_DOCS = 10

CHILD = textwrap.dedent("""
    import sys, time, torch
    torch.set_num_threads(1)
    from qk_core.capture import capture_model
    from qk_core.corpus.build import local_corpus
    from qk_core.config.registry import load_registry
    from qk_core.io.storage import Storage
    reg = load_registry(sys.argv[1])
    entry = reg.model("m")
    df = local_corpus(reg.corpus("tiny").params)
    capture_model(entry, df, Storage(sys.argv[2]), device="cpu", on_document=lambda e, n: time.sleep(0.7))
""")


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    tm.build_tiny_model("qwen3", tmp_path / "model")
    tm.write_corpus_jsonl(tmp_path / "corpus.jsonl", tm.sample_texts(N_DOCS, 150, seed=3),
                          ids=list(range(100, 100 + N_DOCS)))
    reg = tm.write_registry(tmp_path / "registry.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp_path / "model")}, "window": 128, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 10}}}, tmp_path / "corpus.jsonl")
    return reg, tmp_path


def test_killed_capture_resumes_missing_documents_only(setup: tuple[Path, Path]) -> None:
    reg_path, tmp = setup
    root = tmp / "storage"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(reg_path), str(root)], env=env, cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    docs_dir = None
    try:
        while time.time() < deadline and child.poll() is None:
            found = list(root.glob("captures/m/*/docs/doc-*.parquet"))
            if len(found) >= 2:
                docs_dir = found[0].parent
                break
            time.sleep(0.05)
        assert docs_dir is not None, "the child never committed two documents"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    storage = Storage(root)
    prefix = str(docs_dir.parent.relative_to(root))
    assert not storage.exists(f"{prefix}/complete.json")
    with pytest.raises(CaptureError, match="not complete"):
        CaptureReader(storage, prefix)
    committed = sorted(int(n.rsplit("doc-", 1)[1][:-8]) for n in storage.ls(f"{prefix}/docs"))
    assert 2 <= len(committed) < N_DOCS

    reg = load_registry(reg_path)
    corpus = local_corpus(reg.corpus("tiny").params)
    seen: list[int] = []
    resumed = capture_model(reg.model("m"), corpus, storage, device="cpu", on_document=lambda e, n: seen.append(e))
    assert resumed.prefix == prefix
    assert sorted(resumed.skipped_docs) == committed
    assert sorted(seen) == sorted(set(range(100, 100 + N_DOCS)) - set(committed))

    fresh = capture_model(reg.model("m"), corpus, Storage(tmp / "fresh"), device="cpu")
    assert fresh.fingerprint == resumed.fingerprint
    a, b = CaptureReader(storage, prefix), CaptureReader(Storage(tmp / "fresh"), fresh.prefix)
    assert a.manifest["heads"] == b.manifest["heads"]
    assert resumed.heads.drop(columns="capture_prefix").equals(fresh.heads.drop(columns="capture_prefix"))
    for h in a.manifest["heads"]:
        x, y = a.read_head(h["layer"], h["q_head"]), b.read_head(h["layer"], h["q_head"])
        for kind in ("q", "k"):
            kx = np.lexsort((getattr(x, f"{kind}_pos"), getattr(x, f"{kind}_doc")))
            ky = np.lexsort((getattr(y, f"{kind}_pos"), getattr(y, f"{kind}_doc")))
            assert len(kx) == len(ky) == N_DOCS * 8 * 2
            for field in (kind, f"{kind}_pos", f"{kind}_doc"):
                assert np.array_equal(getattr(x, field)[kx], getattr(y, field)[ky])
    pd_tokens = a.doc_tokens().sort_values("example_id")
    assert list(pd_tokens["example_id"]) == list(range(100, 100 + N_DOCS))

    again = capture_model(reg.model("m"), corpus, storage, device="cpu")  # complete: nothing recomputed
    assert again.already_complete and again.captured_docs == []


def test_capture_finalized_before_checksums_is_refinalized(tmp_path: Path) -> None:
    """A complete capture whose complete.json has no checksums (older layout, document files kept) is
    finalized again by the next run, without a forward, and then verifies; the head data are unchanged."""
    tm.build_tiny_model("qwen3", tmp_path / "model")
    tm.write_corpus_jsonl(tmp_path / "corpus.jsonl", tm.sample_texts(3, 80, seed=4), ids=[1, 2, 3])
    reg_path = tm.write_registry(tmp_path / "registry.toml", {"m": {
        "family": "qwen3", "source": {"local": str(tmp_path / "model")}, "window": 64, "bucket": 16,
        "capture": {"per_bucket": 2, "heads": 4, "keep_doc_files": True}}}, tmp_path / "corpus.jsonl")
    reg = load_registry(reg_path)
    corpus = local_corpus(reg.corpus("tiny").params)
    storage = Storage(tmp_path / "storage")
    first = capture_model(reg.model("m"), corpus, storage, device="cpu")
    assert len(storage.ls(f"{first.prefix}/docs")) == 3  # kept
    h = first.manifest["heads"][0]
    before = CaptureReader(storage, first.prefix).read_head(h["layer"], h["q_head"])
    old = storage.read_json(f"{first.prefix}/complete.json")
    storage.write_json(f"{first.prefix}/complete.json", {"n_docs": old["n_docs"], "rows": old["rows"]})
    with pytest.raises(CaptureError, match="no file checksums"):
        CaptureReader(storage, first.prefix)
    seen: list[int] = []
    again = capture_model(reg.model("m"), corpus, storage, device="cpu", on_document=lambda e, n: seen.append(e))
    assert seen == [] and again.already_complete and again.verification["passed"]
    after = CaptureReader(storage, first.prefix).read_head(h["layer"], h["q_head"])
    np.testing.assert_array_equal(after.q, before.q)
    np.testing.assert_array_equal(after.k_pos, before.k_pos)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_failed_commit_stops_the_capture_and_a_resume_completes_it(setup: tuple[Path, Path],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      overlap: bool) -> None:
    """With ``overlap_commits`` a document's commit runs while the next document's forward runs (the default on
    an accelerator), else before it. A commit that fails (the disk, on the 4th document) stops the capture with
    that error after at most one more forward; the documents committed before it stay, and the next run commits
    only the others, to the same rows and the same merged moments, bit for bit, as an uninterrupted capture
    (SPEC 1.9, 12.1)."""
    from qk_core.capture import hook
    from qk_core.capture.store import CaptureWriter

    reg_path, tmp = setup
    reg = load_registry(reg_path)
    corpus = local_corpus(reg.corpus("tiny").params)
    storage = Storage(tmp / "storage")
    commit, positions = CaptureWriter.write_document, hook.CaptureSession.set_positions
    attempts: list[int] = []
    forwards: list[int] = []

    def failing_commit(self: Any, example_id: int, *args: Any, **kwargs: Any) -> None:
        attempts.append(int(example_id))
        if len(attempts) == 4:
            raise OSError(28, "No space left on device")
        commit(self, example_id, *args, **kwargs)

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.heads is not None:  # a document's forward (not the layers' probe)
            forwards.append(1)
        positions(self, *args, **kwargs)

    monkeypatch.setattr(CaptureWriter, "write_document", failing_commit)
    monkeypatch.setattr(hook.CaptureSession, "set_positions", counted)
    seen: list[int] = []
    with pytest.raises(OSError, match="No space left"):
        capture_model(reg.model("m"), corpus, storage, device="cpu", on_document=lambda e, n: seen.append(e),
                      overlap_commits=overlap)
    assert seen == [100, 101, 102] and attempts == [100, 101, 102, 103]
    assert len(forwards) == (5 if overlap else 4)  # with overlap, the next document's ran beside the commit
    monkeypatch.undo()

    resumed = capture_model(reg.model("m"), corpus, storage, device="cpu", on_document=lambda e, n: seen.append(e))
    assert sorted(resumed.skipped_docs) == [100, 101, 102]
    assert seen[3:] == list(range(103, 100 + N_DOCS))
    fresh = capture_model(reg.model("m"), corpus, Storage(tmp / "fresh"), device="cpu")
    a, b = CaptureReader(storage, resumed.prefix), CaptureReader(Storage(tmp / "fresh"), fresh.prefix)
    assert a.moment_layers() and a.moment_layers() == b.moment_layers()
    for layer in a.moment_layers():
        x, y = a.read_moments(layer), b.read_moments(layer)
        assert x.docs == y.docs == list(range(100, 100 + N_DOCS))
        for key in y.sums:
            assert np.array_equal(x.sums[key], y.sums[key]), (layer, key)
    for h in a.manifest["heads"]:
        x, y = a.read_head(h["layer"], h["q_head"]), b.read_head(h["layer"], h["q_head"])
        ox, oy = np.lexsort((x.q_pos, x.q_doc)), np.lexsort((y.q_pos, y.q_doc))
        assert np.array_equal(x.q[ox], y.q[oy]) and np.array_equal(x.q_doc[ox], y.q_doc[oy])
