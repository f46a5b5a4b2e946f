"""llama.cpp as a throughput baseline: continuous batching over llama-cpp-python's low-level API.

    python -m kernel_lab.bench.llama_cpp IN.json OUT.json        (PYTHONPATH=<repo>, .venv-llamacpp's Python)

IN.json: {"model": "<.gguf>", "prompts": [[token ids], ...], "output_len": N or [N per request],
"concurrency": C, "threads": T} (optional: "n_batch", "kv_unified", "kv_cache_type": "f16" or "f32", "warmup").
OUT.json: per-request output token ids, the timed loop's wall time, token counts, llama-cpp-python's version and
llama.cpp's system info.

This file runs in its own environment (projects/09_engine/llama_cpp_env.sh builds .venv-llamacpp): it
imports only the standard library, numpy and llama_cpp, never torch or the rest of kernel_lab.

The loop is what a serving engine on llama.cpp does (llama-server's slots, in miniature): one context with
`n_seq_max = concurrency` sequences; requests are admitted in order while a sequence id is free, and the
prompts admitted together are prefilled in `llama_decode` batches of at most `n_batch` tokens, logits
only for each prompt's last token; then every step decodes one token for each active sequence in a single
batch. Sampling is greedy (numpy argmax over the logits, lowest index on ties, as the engine's argmax) and
EOS is ignored, so every request yields exactly its output length; a finished request's KV is removed
(`llama_memory_seq_rm`) and its sequence id goes to the next request.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque

import numpy as np

__all__ = ["LlamaCpp", "run_workload", "llama_cpp_greedy", "main"]

# Keeps llama.cpp's log callback alive for the life of the process (ctypes would free it otherwise).
_LOG_CALLBACK = None


def _import_llama_cpp():
    import llama_cpp

    return llama_cpp


class LlamaCpp:
    """One model and one context on llama.cpp's C API. `lib` is the `llama_cpp` module (a test passes a fake);
    `concurrency` sequences of up to `max_len` tokens each; `threads` for both decode and prompt batches.
    kv_cache_type "f16" is llama.cpp's default (with flash attention where it picks it); "f32" keeps K and V
    unrounded, an f32 cache without flash attention (whose CPU kernel rounds them to f16), for agreement checks
    that must not flip near-tied greedy steps."""

    def __init__(self, model_path: str, concurrency: int, max_len: int, threads: int, n_batch: int = 512,
                 kv_unified: bool = False, lib=None, verbose: bool = False, kv_cache_type: str = "f16"):
        self.lib = lib = _import_llama_cpp() if lib is None else lib
        if concurrency < 1 or max_len < 1 or threads < 1 or n_batch < 1:
            raise ValueError("concurrency, max_len, threads and n_batch must be positive")
        if kv_cache_type not in ("f16", "f32"):
            raise ValueError(f"kv_cache_type must be 'f16' or 'f32', not {kv_cache_type!r}")
        self.concurrency, self.max_len, self.threads = concurrency, max_len, threads
        self.n_batch = max(n_batch, concurrency)  # a decode step puts one token of every sequence in one batch
        if not verbose and hasattr(lib, "llama_log_set"):
            global _LOG_CALLBACK
            if _LOG_CALLBACK is None:
                _LOG_CALLBACK = lib.llama_log_callback(lambda level, text, user_data: None)
            lib.llama_log_set(_LOG_CALLBACK, None)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path!r}")
        cparams = lib.llama_context_default_params()
        # Each sequence gets max_len KV cells (rounded up to llama.cpp's 256-cell padding); without a unified
        # KV buffer the context is split evenly between the sequences.
        per_seq = -(-max_len // 256) * 256
        cparams.n_ctx = per_seq * concurrency
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = concurrency
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = kv_unified
        if kv_cache_type == "f32":
            cparams.type_k = cparams.type_v = 0  # GGML_TYPE_F32
            if hasattr(cparams, "flash_attn_type"):
                cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            else:  # llama-cpp-python before the flash_attn_type setting
                cparams.flash_attn = False
        cparams.no_perf = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self._memory = lib.llama_get_memory(self.ctx) if hasattr(lib, "llama_get_memory") else None

    # ------------------------------------------------------------------------------------------ primitives
    def _free_sequence(self, seq: int) -> None:
        """Drop every KV cell of sequence `seq` (positions [0, inf))."""
        if self._memory is not None:
            ok = self.lib.llama_memory_seq_rm(self._memory, seq, -1, -1)
        else:  # llama-cpp-python before the llama_memory API
            ok = self.lib.llama_kv_self_seq_rm(self.ctx, seq, -1, -1)
        if ok is False:
            raise RuntimeError(f"llama.cpp could not free sequence {seq}")

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence id, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if logits else 0
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def _argmax(self, i: int) -> int:
        """Greedy token from the logits of batch entry `i`."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no logits for batch entry {i}")
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    # ---------------------------------------------------------------------------------------------- loop
    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        """Greedy outputs, exactly output_lens[i] tokens for prompt i, EOS ignored, continuous batching over
        `concurrency` sequences."""
        if len(prompts) != len(output_lens):
            raise ValueError("one output length per prompt")
        for p, n in zip(prompts, output_lens):
            if not p or n < 1:
                raise ValueError("every prompt needs a token and every request an output length >= 1")
            if len(p) + n > self.max_len:
                raise ValueError(f"a request of {len(p)} + {n} tokens exceeds max_len {self.max_len}")
        outputs: list[list[int]] = [[] for _ in prompts]
        # Wall time of each decode-only step (no prompt tokens in it): the batch-1 decode rate at concurrency 1.
        self.decode_step_seconds: list[float] = []
        pending = deque(range(len(prompts)))
        free = deque(range(self.concurrency))
        active: dict[int, int] = {}  # sequence id -> request index, in admission order

        def finish_if_done(seq: int) -> None:
            r = active[seq]
            if len(outputs[r]) == output_lens[r]:
                del active[seq]
                self._free_sequence(seq)
                free.append(seq)

        while pending or active:
            # Admit while sequence ids are free; prefill the admitted prompts together, n_batch tokens a call.
            admitted = []
            while pending and free:
                seq, r = free.popleft(), pending.popleft()
                active[seq] = r
                admitted.append((seq, r))
            entries: list[tuple[int, int, int, bool]] = []
            lasts: list[tuple[int, int]] = []  # (index in entries, sequence id) of each prompt's last token
            for seq, r in admitted:
                prompt = prompts[r]
                for pos, token in enumerate(prompt):
                    last = pos == len(prompt) - 1
                    entries.append((token, pos, seq, last))
                    if last:
                        lasts.append((len(entries) - 1, seq))
                    if len(entries) == self.n_batch:
                        self._prefill(entries, lasts, outputs, active)
                        entries, lasts = [], []
            if entries:
                self._prefill(entries, lasts, outputs, active)
            for seq, _ in admitted:
                finish_if_done(seq)
            if not active:
                continue
            # One decode step: the newest token of every active sequence, one batch.
            seqs = list(active)
            step_start = time.perf_counter()
            self._decode([(outputs[active[s]][-1], len(prompts[active[s]]) + len(outputs[active[s]]) - 1, s, True)
                          for s in seqs])
            for i, seq in enumerate(seqs):
                outputs[active[seq]].append(self._argmax(i))
            self.decode_step_seconds.append(time.perf_counter() - step_start)
            for seq in seqs:
                finish_if_done(seq)
        for r, out in enumerate(outputs):
            assert len(out) == output_lens[r], (r, len(out), output_lens[r])
        return outputs

    def _prefill(self, entries, lasts, outputs, active) -> None:
        self._decode(entries)
        for i, seq in lasts:
            outputs[active[seq]].append(self._argmax(i))

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "batch", None) is not None:
            lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def versions(lib=None) -> dict:
    """llama-cpp-python's version and llama.cpp's system info (the CPU features its build uses)."""
    lib = _import_llama_cpp() if lib is None else lib
    info = lib.llama_print_system_info()
    return {"llama_cpp_python": getattr(lib, "__version__", "unknown"),
            "system_info": (info.decode(errors="replace") if isinstance(info, bytes) else str(info)).strip()}


def run_workload(model: str, prompts: list[list[int]], output_len, concurrency: int, threads: int,
                 n_batch: int = 512, kv_unified: bool = False, warmup: bool = True, lib=None,
                 kv_cache_type: str = "f16") -> dict:
    """Time the continuous-batching loop on the workload (after a short untimed warm-up request)."""
    lib = _import_llama_cpp() if lib is None else lib
    output_lens = [int(output_len)] * len(prompts) if isinstance(output_len, int) else [int(n) for n in output_len]
    max_len = max(len(p) + n for p, n in zip(prompts, output_lens))
    with LlamaCpp(model, concurrency, max_len, threads, n_batch=n_batch, kv_unified=kv_unified, lib=lib,
                  kv_cache_type=kv_cache_type) as llm:
        if warmup:
            llm.generate([prompts[0][:8]], [min(4, max_len - min(8, len(prompts[0])))])
        start = time.perf_counter()
        outputs = llm.generate(prompts, output_lens)
        elapsed = time.perf_counter() - start
        decode_step_seconds = llm.decode_step_seconds
    generated = sum(len(o) for o in outputs)
    if generated != sum(output_lens):
        raise RuntimeError(f"llama.cpp generated {generated} tokens; the workload asks for {sum(output_lens)}")
    return {"outputs": outputs, "elapsed_time": elapsed, "generated": generated,
            "prompt_tokens": sum(len(p) for p in prompts), "concurrency": concurrency, "threads": threads,
            "n_batch": llm.n_batch, "kv_unified": kv_unified, "kv_cache_type": kv_cache_type, "model": str(model),
            "decode_step_seconds": decode_step_seconds, **versions(lib)}


def llama_cpp_greedy(model_path: str, prompts_token_ids: list[list[int]], max_tokens: int, threads: int,
                     concurrency: int = 1, lib=None) -> list[list[int]]:
    """Greedy continuations (exactly max_tokens each, EOS ignored) of token-id prompts, for agreement checks."""
    return run_workload(model_path, prompts_token_ids, max_tokens, concurrency, threads, warmup=False,
                        lib=lib)["outputs"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run_workload(spec["model"], spec["prompts"], spec["output_len"], int(spec["concurrency"]),
                          int(spec["threads"]), n_batch=int(spec.get("n_batch", 512)),
                          kv_unified=bool(spec.get("kv_unified", False)), warmup=bool(spec.get("warmup", True)),
                          kv_cache_type=spec.get("kv_cache_type", "f16"))
    with open(argv[1], "w") as f:
        json.dump(result, f)
        f.write("\n")
    print(f"llama.cpp {result['llama_cpp_python']}: {result['generated']} tokens in {result['elapsed_time']:.2f} s "
          f"({result['generated'] / result['elapsed_time']:.2f} output tok/s, concurrency {result['concurrency']}, "
          f"{result['threads']} thread(s))", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
