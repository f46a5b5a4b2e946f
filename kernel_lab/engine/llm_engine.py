"""LLMEngine: requests in, incremental outputs out, one scheduler step at a time.

    add_request ──► Scheduler.waiting ──schedule()──► ModelRunner.execute() ──► sampled tokens
                                                        (BlockManager: blocks, prefix cache)
    step() returns a RequestOutput for every request that produced tokens or finished in that step;
    detokenisation, stop conditions and freeing of finished sequences happen here.

The engine is single-threaded; the server drives it from one dedicated thread.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from kernel_lab.models.llama import ModelConfig, build_model, random_state_dict
from kernel_lab.models.loader import load_config, load_state_dict, resolve_model_dir
from kernel_lab.models.tokenizer import IncrementalDetokenizer, Tokenizer

from .block_manager import BlockManager
from .model_runner import DEFAULT_CPU_KV_CACHE_BYTES, FP8_KV_DTYPE, ModelRunner, SampleResult, kv_bytes_per_block
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence

SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
_KV_DTYPES = {"fp8": FP8_KV_DTYPE, "fp8_e4m3": FP8_KV_DTYPE}


def resolve_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device}")
    return device


def resolve_dtype(dtype, device: torch.device, hf_config: dict) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype in (None, "auto"):
        if device.type == "cpu":
            resolved = torch.float32  # no native bf16 on the CPUs we target; fp32 is also the parity dtype
        else:
            stored = _DTYPES.get(str(hf_config.get("torch_dtype") or hf_config.get("dtype")), torch.bfloat16)
            resolved = stored if stored != torch.float32 else torch.bfloat16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {resolved}")
    if device.type == "cuda" and resolved == torch.float32:
        raise ValueError("dtype float32 is not supported on CUDA: the paged attention kernel takes fp16/bf16")
    return resolved


class LLMEngine:
    def __init__(self, model=None, dtype="auto", max_model_len: int = 2048, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, block_size: int = 16, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True, device="auto", num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False, seed: int = 0,
                 pad_decode_batches: bool = False):
        if isinstance(model, dict):  # a config.json as a dict: random weights, token-id prompts only
            self.model_dir, hf_config = None, model
        else:
            self.model_dir = resolve_model_dir(model)
            hf_config = load_config(self.model_dir)
        self.model_config = config = ModelConfig.from_hf(hf_config)
        self.model_name = _model_name(model, self.model_dir)

        for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        if config.sliding_window and max_model_len > config.sliding_window:
            raise ValueError(f"sliding-window attention is not implemented: use max_model_len <= "
                             f"{config.sliding_window} (the model's sliding_window)")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, max_num_seqs)
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens must be an integer >= max_num_seqs ({max_num_seqs}), "
                             f"got {max_num_batched_tokens!r}")
        if kv_cache_dtype not in ("auto", *_KV_DTYPES):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, hf_config)
        self.kv_cache_dtype = self.dtype if kv_cache_dtype == "auto" else _KV_DTYPES[kv_cache_dtype]
        self.max_model_len = max_model_len
        self.block_size = block_size
        if self.model_dir is None:
            self.tokenizer = TokenIdsOnly(hf_config)
            weights = random_state_dict(config, self.dtype, self.device, seed=seed)
        else:
            self.tokenizer = Tokenizer.from_directory(self.model_dir)
            weights = load_state_dict(self.model_dir)
        model_obj = build_model(config, weights, self.dtype, self.device, max_model_len)
        blocks_per_seq = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            num_kv_blocks = self._default_num_blocks(model_obj, blocks_per_seq, max_num_seqs,
                                                     max_num_batched_tokens, gpu_memory_utilization)
        if not isinstance(num_kv_blocks, int) or num_kv_blocks < blocks_per_seq:
            raise ValueError(f"num_kv_blocks ({num_kv_blocks}) must hold at least one sequence of max_model_len "
                             f"tokens: >= {blocks_per_seq} blocks of {block_size}")
        self.runner = ModelRunner(
            model_obj, config, device=self.device, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
            block_size=block_size, num_blocks=num_kv_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            use_cuda_graphs=self.device.type == "cuda" and not enforce_eager, pad_decode_batches=pad_decode_batches,
            seed=seed,
        )
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0

    # ------------------------------------------------------------------------------------------- set-up
    def _default_num_blocks(self, model, blocks_per_seq, max_num_seqs, max_num_batched_tokens, utilization) -> int:
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.kv_cache_dtype)
        useful = max_num_seqs * blocks_per_seq + 1
        if self.device.type == "cpu":
            budget = int(float(os.environ.get("KERNEL_LAB_CPU_KV_CACHE_GB", 0)) * (1 << 30)) \
                or DEFAULT_CPU_KV_CACHE_BYTES
            return max(blocks_per_seq, min(useful, budget // per_block))
        activation_peak = self._profile_activations(model, max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(self.device)
        graph_reserve = 512 << 20
        budget = int(total * utilization) - (total - free) - activation_peak - graph_reserve
        if budget < per_block * blocks_per_seq:
            raise ValueError(f"not enough GPU memory for the KV cache of one {self.max_model_len}-token sequence "
                             f"(budget {budget / 2**30:.2f} GiB); raise gpu_memory_utilization or lower max_model_len")
        return min(useful, budget // per_block)

    @torch.inference_mode()
    def _profile_activations(self, model, num_tokens: int) -> int:
        """Peak extra memory of the largest eager step: one prefill chunk of max_num_batched_tokens."""
        from kernel_lab.models.attention import AttentionMetadata, LayerKVCache, PrefillChunk

        c = self.model_config
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        dummy = torch.empty((1, self.block_size, c.num_kv_heads, c.head_dim), dtype=self.dtype, device=self.device)
        caches = [LayerKVCache(dummy, dummy)] * c.num_layers
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device)  # write nothing
        meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, num_tokens, 0)])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        model.compute_logits(model(ids, positions, caches, meta)[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------------------------------- requests
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            ids, text = list(prompt), None
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (it has no tokens)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long, longer than max_model_len {self.max_model_len}")
        return text, ids

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        request = Request(request_id, text, ids, params, next(self._arrivals))
        for seq in request.seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            self.scheduler.add(seq)
        self.requests[request_id] = request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any waiting sequence (KV pool too small?)")
            return []
        results = self.runner.execute(batch.items, self.block_manager.drain_fresh_blocks())
        self.scheduler.update_computed(batch)
        touched: dict[str, Request] = {}
        for result in results:
            self._append_token(result)
            touched[result.seq.request.request_id] = result.seq.request
        self.num_generated_tokens += len(results)
        return [self._make_output(r) for r in touched.values()]

    def _append_token(self, result: SampleResult) -> None:
        seq, token = result.seq, result.token_id
        params = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            decode = self.tokenizer.decode
            entry = {tid: Logprob(lp, rank, decode([tid], False)) for rank, (tid, lp) in
                     enumerate(result.top_logprobs or [], start=1)}
            entry.setdefault(token, Logprob(result.logprob, result.rank, decode([token], False)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += result.logprob

        if token in params.stop_token_ids:
            self._finish(seq, "stop", token, token_text=params.include_stop_str_in_output)
            return
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", None, token_text=False)
            return
        delta = seq.detokenizer.add([token]) if params.detokenize else ""
        seq.text += delta
        if delta and params.stop_strings and self._check_stop_strings(seq, len(delta)):
            return
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length", None)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        params = seq.params
        earliest = None
        for stop in params.stop_strings:
            # A stop string can only end inside the new text.
            from_index = max(0, len(seq.text) - delta_len - len(stop) + 1)
            at = seq.text.find(stop, from_index)
            if at >= 0 and (earliest is None or at < earliest[0]):
                earliest = (at, stop)
        if earliest is None:
            return False
        at, stop = earliest
        seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
        self._finish(seq, "stop", stop)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason, token_text: bool = False) -> None:
        if token_text and seq.params.detokenize:
            seq.text += seq.detokenizer.add([seq.token_ids[-1]])
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.finish(seq)

    def _visible_text(self, seq: Sequence) -> str:
        """The text safe to show: while running, hold back what could be the start of a stop string."""
        hold = max((len(s) for s in seq.params.stop_strings), default=1) - 1
        if seq.is_finished or hold == 0:
            return seq.text
        return seq.text[:max(seq.emitted_text_len, len(seq.text) - hold)]

    def _make_output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            output_ids = seq.output_token_ids
            text = self._visible_text(seq)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=output_ids, cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                new_token_ids=output_ids[seq.emitted_token_count:], new_text=text[seq.emitted_text_len:],
            ))
            seq.emitted_token_count, seq.emitted_text_len = len(output_ids), len(text)
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             num_cached_tokens=max(s.num_cached_tokens for s in request.seqs))

    # ------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_kv_blocks_total": bm.num_blocks,
            "num_kv_blocks_free": bm.num_free_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_generated_tokens": self.num_generated_tokens,
        }


class TokenIdsOnly:
    """The tokenizer of a random-weight model: prompts are token ids and nothing is detokenised."""

    chat_template_source = None
    all_special_ids: set[int] = set()

    def __init__(self, hf_config: dict):
        eos = hf_config.get("eos_token_id")
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.bos_token_id = hf_config.get("bos_token_id")
        self.vocab_size = int(hf_config["vocab_size"])

    def encode(self, text, add_special_tokens=True):
        raise TypeError("a random-weight model has no tokenizer: pass prompts as token ids")

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        raise TypeError("a random-weight model has no chat template")


def _model_name(model, model_dir: Path | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    if isinstance(model, dict):
        return f"random-{model.get('model_type', 'model')}"
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name
