"""Find and load a model: a Hugging Face directory (config.json + safetensors + tokenizer.json), or a GGUF
file, which is exported once to a cached Hugging Face directory (see gguf.export_hf_directory)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .registry import ARCHITECTURES, family_of

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def resolve_model_dir(model=None, float_weights: bool = True) -> Path:
    """The Hugging Face directory for `model`: None (the bundled default), a .gguf file, or a directory.
    A GGUF's export holds float32 weights, or with float_weights=False none (the engine's: its loaders
    then read the GGUF's own tensors, gguf.gguf_weights)."""
    from .gguf import default_model_path, export_hf_directory

    if model is None:
        return export_hf_directory(default_model_path(), float_weights=float_weights)
    path = Path(model).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if path.suffix.lower() != ".gguf" and magic != b"GGUF":
            raise ValueError(f"model path {str(model)!r} is a file but not a GGUF file")
        return export_hf_directory(path, float_weights=float_weights)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(model)!r} has no config.json")
        return path
    raise FileNotFoundError(
        f"unknown model path {str(model)!r}: pass a Hugging Face directory, a .gguf file, or None for the "
        "bundled SmolLM2-135M-Instruct (models are never downloaded)"
    )


def load_config(model_dir) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        family_of(config)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {str(model_dir)!r})") from None
    return config


def safetensors_files(model_dir) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted({_shard_name(s, index) for s in json.loads(index.read_text())["weight_map"].values()})
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(model_dir)!r} holds no .safetensors weights")
    return files


def _shard_name(entry, index: Path) -> str:
    """A weight_map entry, which must name a file inside the model directory: an absolute path or a `..`
    would read any file the process can (checked on the text; a symlink inside the directory, as the
    Hugging Face cache makes, stays allowed)."""
    if not isinstance(entry, str) or not entry or Path(entry).is_absolute() or ".." in Path(entry).parts:
        raise ValueError(f"{str(index)!r}: weight_map entry {entry!r} is not a file name inside the model "
                         "directory (no absolute path, no '..')")
    return entry


def load_state_dict(model_dir, skip=()) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files but those named in `skip`, on CPU in its stored
    dtype. For a GGUF read in place (gguf.gguf_source) with `skip` (the quantized path's blocks): the other
    tensors dequantized from the file; without: the float32 export's, which is made on first use."""
    from safetensors import safe_open

    from .gguf import export_hf_directory, gguf_source, gguf_weights

    source = gguf_source(model_dir)
    if source is not None and skip:  # the quantized path: only what has no kernel, dequantized from the file
        return gguf_weights(source, quantized=False, skip=skip)
    if source is not None:  # float weights throughout (CUDA, weights="float32"): the export, made once
        model_dir = export_hf_directory(source)
    skip = set(skip)
    state_dict: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name not in skip:
                    state_dict[name] = st.get_tensor(name)
    return state_dict


def has_quantized_weights(model_dir) -> bool:
    """True for a directory exported from a GGUF with tensors in a format ops/gguf_linear.py computes on
    (gguf.BLOCKS_FILE)."""
    from .gguf import BLOCKS_FILE, gguf_block_formats, gguf_source

    if gguf_source(model_dir) is not None:
        return bool(gguf_block_formats(model_dir))
    return model_dir is not None and (Path(model_dir) / BLOCKS_FILE).is_file()


def load_quantized_weights(model_dir) -> dict:
    """{Hugging Face name: QuantizedWeight} from the directory's GGUF blocks file (empty if it has none)."""
    from safetensors import safe_open

    from kernel_lab.ops.gguf_linear import BLOCK_BYTES, BLOCK_WEIGHTS, FORMATS, QuantizedWeight

    from .gguf import BLOCKS_FILE, gguf_source, gguf_weights

    if gguf_source(model_dir) is not None:
        return gguf_weights(gguf_source(model_dir), quantized=True)
    path = Path(model_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}
    weights = {}
    with safe_open(str(path), framework="pt") as st:
        formats = st.metadata() or {}
        for name in st.keys():
            if formats.get(name) not in FORMATS:
                raise ValueError(f"{str(path)!r}: tensor {name!r} has no known block format ({formats.get(name)!r})")
            data = st.get_tensor(name)
            ggml_type = FORMATS[formats[name]]
            k = data.shape[1] // BLOCK_BYTES[ggml_type] * BLOCK_WEIGHTS[ggml_type]
            weights[name] = QuantizedWeight(ggml_type, data.contiguous(), (data.shape[0], k))
    return weights
