"""LLMEngine: requests in, incremental outputs out, one scheduler step at a time.

    add_request ──► Scheduler.waiting ──schedule()──► ModelRunner.execute() ──► sampled tokens
                                                        (BlockManager: blocks, prefix cache)
    step() returns a RequestOutput for every request that produced tokens or finished in that step.

The configuration is checked by EngineConfig (config.py) and passed whole; model_loader.py loads the model;
tokens become text, stop conditions and outputs in OutputProcessor (output_processor.py). The engine is
single-threaded; the server drives it from one dedicated thread.
"""

from __future__ import annotations

import itertools

from .block_manager import BlockManager
from .config import EngineConfig
from .errors import RequestFieldError
from .grammar import GrammarCompileService, StructuredOutputManager
from .interface import EngineStats
from .logits_processors import bad_words_token_ids
from .lora import LoRAEngineCalls, LoRAManager, LoRARequest
from .model_loader import load_model
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request
from .speculative import make_speculator


class LLMEngine(LoRAEngineCalls):
    """`LLMEngine(model=None, **options)`: the options are EngineConfig's fields."""

    def __init__(self, model=None, **options):
        self.config = config = EngineConfig(model, **options)
        model, self.tokenizer = load_model(config)
        self.lora = (LoRAManager(model, config.model_config, config.max_loras, config.max_lora_rank,
                                 config.lora_dtype, config.device, config.max_num_seqs) if config.enable_lora else None)
        self.runner = ModelRunner(config, model)    # sizes the KV pool: config.num_kv_blocks
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.lora = self.lora
        self.output_processor = OutputProcessor(self.tokenizer, config.max_model_len, self.scheduler.finish)
        self.requests: dict[str, Request] = {}
        self.structured_outputs = StructuredOutputManager(self.tokenizer, config.vocab_size)
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0
        self.speculator = make_speculator(config)

    # ------------------------------------------------------------------------------------------- requests
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str) and prompt:
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        if isinstance(prompt, str):
            raise RequestFieldError("prompt", "prompt is empty")
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Everything that can refuse the request runs before any of the engine's state holds it (a LoRA
        adapter is read and checked here, once per lora_int_id)."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise RequestFieldError("prompt", "prompt is empty (it has no tokens)")
        params.verify(self.config.vocab_size, self.config.max_model_len, ids)
        self._register_lora(lora_request)
        request = Request(request_id, text, ids, params, next(self._arrivals))
        request.lora_request = lora_request
        request.controls = params.controls(self.tokenizer.eos_token_ids,
                                           bad_words_token_ids(self.tokenizer, params.bad_words))
        self.output_processor.add_request(request)
        if params.structured_outputs is not None:
            self.structured_outputs.add(request)     # enters the scheduler once its grammar is compiled
        self.requests[request_id] = request
        if request.grammar is None:
            for seq in request.seqs:
                self.scheduler.add(seq)

    @property
    def grammar_service(self) -> GrammarCompileService | None:
        return self.structured_outputs.service

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready enter the scheduler; one whose grammar failed ends at once (it
        holds no blocks) with its error in the output."""
        ready, failed = self.structured_outputs.take_compiled()
        for seq in (seq for request in ready for seq in request.seqs):
            self.scheduler.add(seq)
        for request in failed:
            self.requests.pop(request.request_id, None)
        return [self.output_processor.fail(request, request.error) for request in failed]

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        self.structured_outputs.remove(request)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if self.structured_outputs.waiting else []
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule any waiting sequence (KV pool too small?)")
            if self.structured_outputs.waiting and not failed:
                self.structured_outputs.wait(0.05)   # nothing else to do
            return failed
        # A fault in the model's forward belongs to no request and raises out of the step (the server then
        # fails everything); a request's own fault in sampling or output processing ends that request alone.
        results, sample_failures = self.runner.execute(batch.items, self.block_manager.drain_fresh_blocks())
        self.scheduler.update_computed(batch)
        results, sample_failures = self.speculator.verify(results, sample_failures)
        self.num_generated_tokens += len(results)
        outputs = failed + self.output_processor.process(results, sample_failures)
        self.speculator.rollback(batch, self.block_manager, self.scheduler.running)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    # ------------------------------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        bm = self.block_manager
        running = {seq.request.request_id for seq in self.scheduler.running}   # requests, as vLLM counts
        return EngineStats(
            num_running=len(running), num_waiting=len(self.requests) - len(running),
            kv_cache_blocks_total=bm.num_blocks, kv_cache_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, num_generated_tokens=self.num_generated_tokens,
            weights=self.config.weights, weight_bytes=self.runner.model.decode_weight_bytes(),
            resident_weight_bytes=self.runner.model.resident_weight_bytes(), **self.speculator.stats_fields(),
            **self.lora_stats_fields(running))
