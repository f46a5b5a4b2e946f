"""A Llama-shaped GGUF of about 1.2B parameters with random weights, rebuilt offline, for the CPU benchmarks.

    python projects/09_engine/make_1b_gguf.py [--size 1b|tiny] [--types Q4_0 Q8_0 Q4_K_M] [--out DIR]

Writes `<out>/random-llama-<size>-v<version>/F16.gguf` (hidden 2048, 16 layers, intermediate 8192, 32 heads, 8
KV heads, head dim 64, untied lm_head: 1.17B parameters; the bundled SmolLM2's tokenizer, vocabulary and
merges), then each requested type quantized from it by llama.cpp's own quantizer (`llama_model_quantize`
through llama-cpp-python's C API, run with .venv-llamacpp's Python, `make llama-cpp-env`). Default out: the
user cache (`$KERNEL_LAB_CACHE` or ~/.cache/kernel_lab, under models/); files already there are kept, so a
second run costs a stat. Nothing here is committed: about 2.4 GB of F16 and 0.7-1.3 GB per quantized file.

Throughput does not depend on the weights' values when generation ignores EOS, so random normal weights
(std 0.02, seeded) serve; norms are ones. `--size tiny` (hidden 256, 2 layers, intermediate 768) is the same
file in miniature, for tests: its widths are multiples of 256, so llama.cpp's K-quants apply to every matrix.

`python make_1b_gguf.py quantize IN OUT TYPE [THREADS]` is the step run under .venv-llamacpp (it imports only
llama_cpp). Without llama.cpp, `write_random(path, size, formats)` writes the matrices directly as random
blocks of a GGUF block format (any of ops/gguf_linear.py's), for tests of the K-quant paths on CI.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LLAMA_CPP_PYTHON = REPO / ".venv-llamacpp" / "bin" / "python"
VERSION = 2  # bump when the written file changes (2: context length 32768, for the long-context records)
SIZES = {
    "1b": {"hidden": 2048, "layers": 16, "intermediate": 8192, "heads": 32, "kv_heads": 8},
    "tiny": {"hidden": 256, "layers": 2, "intermediate": 768, "heads": 4, "kv_heads": 2},
}
# llama.cpp's llama_ftype values (llama.h) for the types this script makes.
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
WEIGHT_STD = 0.02


def llama_cpp_ready() -> bool:
    """True when .venv-llamacpp is built (llama_cpp_env.sh leaves a stamp when it finishes)."""
    return LLAMA_CPP_PYTHON.exists() and any((REPO / ".venv-llamacpp").glob(".installed-*"))


def default_out_dir() -> Path:
    env = os.environ.get("KERNEL_LAB_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "kernel_lab") / "models"


def model_dir(size: str, out: Path | None = None) -> Path:
    return (out or default_out_dir()) / f"random-llama-{size}-v{VERSION}"


def tensor_shapes(dims: dict, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape outermost first) of every tensor, in file order."""
    h, inter = dims["hidden"], dims["intermediate"]
    head_dim = h // dims["heads"]
    kv = dims["kv_heads"] * head_dim
    shapes = [("token_embd.weight", (vocab, h))]
    for i in range(dims["layers"]):
        shapes += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (h, h)),
                   (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                   (f"blk.{i}.attn_output.weight", (h, h)), (f"blk.{i}.ffn_norm.weight", (h,)),
                   (f"blk.{i}.ffn_gate.weight", (inter, h)), (f"blk.{i}.ffn_up.weight", (inter, h)),
                   (f"blk.{i}.ffn_down.weight", (h, inter))]
    return shapes + [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]


# Where a block format keeps its fp16 scale d (Q4_1, Q4_K, Q5_K: then the minimum's), and d for weights of
# about WEIGHT_STD (the typical |quant| times, for K-quants, the typical sub-scale: 32, or 64 for Q6_K).
_SCALE_AT = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}
_SCALE = {"Q4_0": WEIGHT_STD / 4, "Q4_1": WEIGHT_STD / 4, "Q5_0": WEIGHT_STD / 8, "Q8_0": WEIGHT_STD / 64,
          "Q4_K": WEIGHT_STD / 256, "Q5_K": WEIGHT_STD / 512, "Q6_K": WEIGHT_STD / 2048}


def random_blocks(fmt: str, shape: tuple[int, int], rng):
    """uint8 [n, row bytes]: random GGUF blocks of `fmt`, every quant and sub-scale bit pattern, with fp16
    scales that keep the weights near WEIGHT_STD (centred: Q4_1's and the K-quants' minimums offset them)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // weights, nbytes), dtype=np.uint8)
    d = (_SCALE[fmt] * (0.5 + rng.random(blocks.shape[:2] + (1,)))).astype(np.float16)
    blocks[..., _SCALE_AT[fmt]:_SCALE_AT[fmt] + 2] = d.view(np.uint8)
    if fmt in ("Q4_1", "Q4_K", "Q5_K"):  # the minimum: about the mean of the scaled quants, so w is centred
        centre = {"Q4_1": -7.5, "Q4_K": 7.5, "Q5_K": 15.5}[fmt]  # the mean quant (times the mean sub-scale)
        blocks[..., 2:4] = (d * centre).astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def write_f16(path: Path, size: str, seed: int = 0) -> Path:
    """The random F16 GGUF of `size` (llama.cpp's quantizer's input)."""
    return write_random(path, size, {}, seed)


def write_random(path: Path, size: str, formats: dict[str, str], seed: int = 0, rope_freqs=None) -> Path:
    """A random GGUF of `size`: matrices in F16, or as random blocks of `formats[role]` (Q4_0, Q4_1, Q5_0,
    Q8_0, Q4_K, Q5_K, Q6_K) where the role (the name's part before `.weight`, e.g. attn_v, ffn_down,
    token_embd, output) is listed; norms F32 ones; `rope_freqs` (float32 [head_dim / 2], as llama.cpp's
    converter writes it for Llama 3.1+) as the `rope_freqs.weight` tensor where given.
    Written tensor by tensor (peak memory: one tensor), then renamed into place so an interrupted run leaves
    no partial file under the final name."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

    sys.path.insert(0, str(REPO))
    from kernel_lab.models.gguf import default_model_path
    from kernel_lab.models.gguf_file import GGUFFile

    dims = SIZES[size]
    source = GGUFFile(default_model_path())
    tokenizer = {name: value for name, value in source.metadata.items() if name.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    tmp = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(tmp), "llama")
    head_dim = dims["hidden"] // dims["heads"]
    writer.add_name(f"random-llama-{size}")
    writer.add_context_length(32768)  # Llama 3.2 1B's order: the long-context benchmarks run to 8K+
    writer.add_embedding_length(dims["hidden"])
    writer.add_block_count(dims["layers"])
    writer.add_feed_forward_length(dims["intermediate"])
    writer.add_head_count(dims["heads"])
    writer.add_head_count_kv(dims["kv_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(1)  # LLAMA_FTYPE_MOSTLY_F16
    for name, value in tokenizer.items():
        value_type, item_type = source.value_types[name]
        writer.add_key_value(name, value, GGUFValueType(value_type),
                             sub_type=None if item_type is None else GGUFValueType(item_type))
    shapes = tensor_shapes(dims, vocab)
    if rope_freqs is not None:
        shapes.append(("rope_freqs.weight", (head_dim // 2,)))
    rng = np.random.default_rng(seed)

    def block_format(name, shape):  # None: F16 (or F32 for norms)
        fmt = formats.get(name.removesuffix(".weight").rpartition(".")[2]) if len(shape) == 2 else None
        return None if fmt == "F16" else fmt

    for name, shape in shapes:  # the header lists every tensor's type and size before any values
        fmt = block_format(name, shape)
        if fmt:
            weights, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
            byte_shape = (shape[0], shape[1] // weights * nbytes)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=GGMLQuantizationType[fmt])
        else:
            dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
            writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in shapes:
        fmt = block_format(name, shape)
        if name == "rope_freqs.weight":
            writer.write_tensor_data(np.asarray(rope_freqs, dtype=np.float32))
        elif len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
        elif fmt:
            writer.write_tensor_data(random_blocks(fmt, shape, rng))
        else:
            writer.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float16))
    writer.close()
    os.replace(tmp, path)
    return path


def quantize(source: Path, out: Path, type_name: str, threads: int = 0) -> None:
    """llama.cpp's quantizer, in this process (which must have llama_cpp: .venv-llamacpp's Python)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.nthread = threads
    tmp = out.with_name(out.name + ".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {type_name}) failed with status {status}")
    os.replace(tmp, out)


def build(size: str = "1b", types=("Q4_0", "Q8_0", "Q4_K_M"), out: Path | None = None,
          python: Path = LLAMA_CPP_PYTHON, threads: int = 0, log=print) -> dict[str, Path]:
    """{type: path} for F16 and each of `types`, made where missing (quantizing needs `python` with
    llama_cpp)."""
    directory = model_dir(size, out)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"F16": directory / "F16.gguf"}
    if not paths["F16"].exists():
        start = time.perf_counter()
        write_f16(paths["F16"], size)
        log(f"wrote {paths['F16']} ({paths['F16'].stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    for type_name in types:
        if type_name not in FTYPES:
            raise ValueError(f"types must be among {sorted(FTYPES)}, got {type_name!r}")
        paths[type_name] = directory / f"{type_name}.gguf"
        if paths[type_name].exists():
            continue
        if not Path(python).exists():
            raise FileNotFoundError(f"quantizing needs a Python with llama_cpp ({python}): run `make llama-cpp-env`")
        start = time.perf_counter()
        subprocess.run([str(python), __file__, "quantize", str(paths["F16"]), str(paths[type_name]), type_name,
                        str(threads)], check=True)
        log(f"wrote {paths[type_name]} ({paths[type_name].stat().st_size / 1e9:.2f} GB) "
            f"in {time.perf_counter() - start:.0f} s")
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "quantize":
        quantize(Path(argv[1]), Path(argv[2]), argv[3], int(argv[4]) if len(argv) > 4 else 0)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "Q4_K_M"], choices=sorted(FTYPES))
    parser.add_argument("--out", type=Path, default=None, help="directory for the model directory (default: cache)")
    parser.add_argument("--llama-cpp-python", type=Path, default=LLAMA_CPP_PYTHON)
    parser.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all cores)")
    args = parser.parse_args(argv)
    for type_name, path in build(args.size, args.types, args.out, args.llama_cpp_python, args.threads).items():
        print(f"{type_name}\t{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
