"""Runs one scheduled step on the device: builds the flat batch (token ids, positions, slot_mapping, block
tables), runs the model (eagerly, or by replaying a CUDA graph for decode-only steps), and samples
(sampler.py). It owns the paged KV cache, sized by kv_sizing.py unless the user gave num_kv_blocks. The
design: projects/09_engine/README.md, "Paged KV cache", "The step on the device" and "CUDA".
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kernel_lab.models.attention import AttentionMetadata, LayerKVCache, PrefillChunk
from kernel_lab.models.layers.linear import QuantizedLinear
from kernel_lab.ops.cpu_kernels import KV_FORMATS, load_library
from kernel_lab.ops.gguf_linear import kernel_threads
from kernel_lab.ops.kv_cache import SCALED_DTYPES, check_slot_values, scale_shape
from kernel_lab.ops.paged_attention import check_table_values

from .config import EngineConfig
from .kv_sizing import default_num_kv_blocks
from .sampler import Sampler, SampleResult, score_prompts
from .sequence import Sequence
from .speculative import draft_positions

CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class StepInputs:
    """One step's flat batch, decodes first: the token ids, positions and KV slots of every scheduled token;
    per prefill chunk (first row, end row, cached tokens, offset in prefix_slots) with the slots of its
    cached prefix; and the rows whose logits are sampled, with their sequences."""

    decodes: list[tuple[Sequence, int]]
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    chunk_specs: list[tuple[int, int, int, int]]
    prefix_slots: list[int]
    sample_rows: list[int]
    sample_seqs: list[Sequence]
    row_seqs: list[Sequence]
    prompt_chunks: list[tuple[Sequence, int, int, int]]   # (seq, first row, rows, first position): scored


class ModelRunner:
    """Fills in `config.num_kv_blocks` when it is None."""

    def __init__(self, config: EngineConfig, model):
        self.config, self.model = config, model
        device = self.device = config.device    # the two facts every step reads
        self.block_size = config.block_size
        self.sampler = Sampler(config.seed, self._to_device)
        self._staging: dict[str, torch.Tensor] = {}
        self._copies_done = None
        if config.num_kv_blocks is None:
            config.num_kv_blocks = default_num_kv_blocks(config, model)
        self.num_blocks = config.num_kv_blocks
        self._allocate_kv_cache(config.kv_cache_dtype)
        # On CPU every token, prompt tokens too, attends through the paged decode kernel, one query at a time
        # over its own context. A row's result then depends on nothing else in the step: not the batch, the
        # chunking or the prefix cache, so a seeded request reproduces exactly. Prefill attention through
        # SDPA differs by an ulp with the chunk and cached-prefix lengths, and the int8 activations of the
        # quantized weights turn that into visibly different logits. The cost is small next to the linear
        # layers on a CPU; on CUDA, prefill keeps SDPA's flash kernel.
        self.quantized_weights = any(isinstance(m, QuantizedLinear) for m in model.modules())
        self.prompt_tokens_decode = (device.type == "cpu" and config.dtype == torch.float32
                                     and config.kv_cache_dtype in KV_FORMATS
                                     and load_library() is not None and load_library("norm_activation") is not None)

        self.lora = getattr(model, "lora_manager", None)   # engine/lora.py: the step's row -> adapter slot map
        self.max_num_seqs = config.max_num_seqs
        self.graph_sizes = sorted({b for b in CUDA_GRAPH_BATCH_SIZES if b < self.max_num_seqs} | {self.max_num_seqs})
        self.graphs: dict[int, tuple] = {}
        self.static_decode = config.use_cuda_graphs or config.pad_decode_batches
        if self.static_decode:
            self._allocate_static_buffers()
        if config.use_cuda_graphs:
            self._capture_graphs()

    # ------------------------------------------------------------------------------------------- memory
    def _allocate_kv_cache(self, cache_dtype: torch.dtype) -> None:
        c = self.config.model_config
        shape = (c.num_layers, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        # Uninitialised on purpose (a large cache would take seconds to zero on CPU): a slot is only read
        # after it was written, and the attention ops zero out positions past each sequence's length.
        self.k_cache = torch.empty(shape, dtype=cache_dtype, device=self.device)
        self.v_cache = torch.empty(shape, dtype=cache_dtype, device=self.device)
        self.kv_scales = None
        if cache_dtype in SCALED_DTYPES:  # float32 scales per (page, KV head) for fp8, (token, head, group) for int8
            shape = scale_shape(cache_dtype, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
            self.kv_scales = torch.zeros((c.num_layers, 2, *shape), dtype=torch.float32, device=self.device)
        self.layer_caches = [
            LayerKVCache(self.k_cache[i], self.v_cache[i],
                         None if self.kv_scales is None else self.kv_scales[i, 0],
                         None if self.kv_scales is None else self.kv_scales[i, 1])
            for i in range(c.num_layers)
        ]

    def reset_fresh_blocks(self, block_ids: list[int]) -> None:
        if self.kv_scales is not None and block_ids:
            self.kv_scales.index_fill_(2, self._to_device("fresh", block_ids, torch.int64), 0.0)

    def _to_device(self, name: str, values, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor. On CUDA it goes through a persistent pinned buffer with an
        asynchronous copy; the buffer is reused next step, after the step's token read has synchronised."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype)
        host = torch.tensor(values, dtype=dtype)
        buf = self._staging.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < host.numel():
            buf = torch.empty(max(host.numel(), 256) * 2, dtype=dtype).pin_memory()
            self._staging[name] = buf
        staged = buf[:host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------------------------------- inputs
    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prepare(self, items: list[tuple[Sequence, int]]) -> StepInputs:
        decodes = [(s, n) for s, n in items if n == 1]
        prefills = [(s, n) for s, n in items if n > 1]
        input_ids, positions, slots, sample_rows, sample_seqs = [], [], [], [], []
        prefix_slots, chunk_specs, row_seqs, prompt_chunks = [], [], [], []
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            row0 = len(input_ids)
            row_seqs += [seq] * n
            input_ids += seq.token_ids[start:start + n] + seq.draft_token_ids
            positions += range(start, start + n)
            slots += self._slots(seq, start, start + n)
            if n > 1:
                chunk_specs.append((row0, row0 + n, start, len(prefix_slots)))
                prefix_slots += self._slots(seq, 0, start)
            if seq.request.prompt_logprobs is not None and seq.index == 0 and start < seq.num_prompt_tokens - 1:
                prompt_chunks.append((seq, row0, n, start))
            if seq.draft_token_ids:     # every row of a speculative step is sampled (speculative.py)
                sample_rows += range(row0, row0 + n)
                sample_seqs += draft_positions(seq)
            elif start + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        return StepInputs(decodes, input_ids, positions, slots, chunk_specs, prefix_slots, sample_rows, sample_seqs,
                          row_seqs, prompt_chunks)

    def _query_tables(self, seqs: list[Sequence], positions: list[int], width: int | None = None):
        """Block tables (padded to `width`) and context lengths of queries at `positions` of `seqs`."""
        width = width or max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return tables, [p + 1 for p in positions]

    # ------------------------------------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, items: list[tuple[Sequence, int]], fresh_blocks: list[int], sample_as=None
                ) -> tuple[list[SampleResult], list[tuple[Sequence, Exception]]]:
        """Run the model over the scheduled tokens; sample for the sequences whose tokens are all computed (as
        `sample_as(seqs)` where given: draft_proposer.py). Returns the samples and the sequences whose own
        parameters failed the sampling (Sampler.sample_each)."""
        if self._copies_done is not None:
            # Staging buffers are about to be refilled: their previous copies must have left. Free when the
            # previous step read its sampled tokens (which synchronised); only prefill-only steps wait here.
            self._copies_done.synchronize()
        with kernel_threads(torch.get_num_threads()) if self.quantized_weights else nullcontext():
            logits, sample_seqs = self.run_model(items, fresh_blocks)
            results = self.sampler.sample_each(logits, sample_seqs if sample_as is None else sample_as(sample_seqs))
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return results

    @torch.inference_mode()
    def run_model(self, items: list[tuple[Sequence, int]], fresh_blocks: list[int]):
        """The device part of a step, with no host synchronisation: (logits of the sequences that will
        sample, those sequences)."""
        self.reset_fresh_blocks(fresh_blocks)
        step = self._prepare(items)
        if self.static_decode and not step.chunk_specs and not step.prompt_chunks \
                and len(step.decodes) <= self.max_num_seqs:
            logits = self._run_static_decode(step)
            if len(step.sample_rows) != len(step.decodes):  # some rows were one-token chunks of a prompt
                logits = logits[self._to_device("rows", step.sample_rows, torch.int64)]
        else:
            logits = self._run_eager(step)
        return logits, step.sample_seqs

    def _run_eager(self, step: StepInputs):
        every_row = self.prompt_tokens_decode
        meta = AttentionMetadata(slot_mapping=self._to_device("slots", step.slots, torch.int64),
                                 num_decode_tokens=len(step.input_ids) if every_row else len(step.decodes),
                                 fused_cpu_decode=every_row)
        if meta.num_decode_tokens:
            rows = meta.num_decode_tokens
            tables, lens = self._query_tables(step.row_seqs[:rows], step.positions[:rows])
            meta.decode_block_tables = self._to_device("tables", tables, torch.int32)
            meta.decode_seq_lens = self._to_device("lens", lens, torch.int32)
        if step.chunk_specs and not every_row:
            all_prefix = self._to_device("prefix", step.prefix_slots, torch.int64) if step.prefix_slots else None
            for start, end, num_cached, offset in step.chunk_specs:
                prefix = all_prefix[offset:offset + num_cached] if num_cached else None
                meta.prefills.append(PrefillChunk(start, end, num_cached, prefix))
        self._check_step_inputs(meta)
        if self.lora is not None:
            self.lora.set_rows(step.row_seqs)
        hidden = self.model(self._to_device("ids", step.input_ids, torch.int64),
                            self._to_device("positions", step.positions, torch.int64), self.layer_caches, meta)
        if step.prompt_chunks:
            score_prompts(self.model.compute_logits, step.prompt_chunks, hidden)
        return self.model.compute_logits(hidden[self._to_device("rows", step.sample_rows, torch.int64)])

    def _check_step_inputs(self, meta: AttentionMetadata) -> None:
        """Slot and block-table values, checked once per step so the layers' kernels skip it. Host-side
        reads: free on CPU; on CUDA they would synchronise, and the tables come from the block manager."""
        if self.device.type == "cuda":
            return
        check_slot_values(meta.slot_mapping, self.num_blocks, self.block_size)
        if meta.num_decode_tokens:
            check_table_values(meta.decode_block_tables, meta.decode_seq_lens, self.num_blocks, self.block_size)

    # ------------------------------------------------------------------------------------------- static decode
    def _allocate_static_buffers(self) -> None:
        b, dev = self.max_num_seqs, self.device
        self.static_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.static_positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.static_slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.static_tables = torch.zeros((b, self.config.blocks_per_seq), dtype=torch.int32, device=dev)
        self.static_lens = torch.zeros(b, dtype=torch.int32, device=dev)

    def _static_meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.static_slots[:size], num_decode_tokens=size,
                                 decode_block_tables=self.static_tables[:size], decode_seq_lens=self.static_lens[:size])

    def _static_forward(self, size: int) -> torch.Tensor:
        if self.lora is not None:
            self.lora.use_static_rows(size)
        hidden = self.model(self.static_ids[:size], self.static_positions[:size], self.layer_caches,
                            self._static_meta(size))
        return self.model.compute_logits(hidden)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.graph_sizes if b >= n)

    def _run_static_decode(self, step: StepInputs) -> torch.Tensor:
        decodes, input_ids, positions, slots = step.decodes, step.input_ids, step.positions, step.slots
        n = len(decodes)
        size = self._bucket(n)
        pad = size - n
        tables, lens = self._query_tables(step.row_seqs, positions, self.config.blocks_per_seq)
        # Padding rows write nothing (slot -1) and attend to nothing (length 0).
        self.static_ids[:size].copy_(self._to_device("ids", input_ids + [0] * pad, torch.int64), non_blocking=True)
        self.static_positions[:size].copy_(self._to_device("positions", positions + [0] * pad, torch.int64),
                                           non_blocking=True)
        self.static_slots[:size].copy_(self._to_device("slots", slots + [-1] * pad, torch.int64), non_blocking=True)
        self.static_lens[:size].copy_(self._to_device("lens", lens + [0] * pad, torch.int32), non_blocking=True)
        self.static_tables[:n].copy_(self._to_device("tables", tables, torch.int32), non_blocking=True)
        self._check_step_inputs(self._static_meta(size))
        if self.lora is not None:
            self.lora.fill_static_rows(step.row_seqs, size)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self._static_forward(size)
        return logits[:n]

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        pool = None
        for size in reversed(self.graph_sizes):  # largest first, so smaller graphs reuse its memory pool
            self._static_forward(size)            # warm-up: Triton compiles and autotunes outside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._static_forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
