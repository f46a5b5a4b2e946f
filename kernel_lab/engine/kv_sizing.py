"""How many KV blocks the pool gets when the user gives no number: on CPU a byte budget; on CUDA what
`gpu_memory_utilization` leaves after the weights, the largest eager step's activations (measured by
running it) and the CUDA graphs' reserve. The ModelRunner calls this before it allocates the pool."""

from __future__ import annotations

import os

import torch

from kernel_lab.models.attention import AttentionMetadata, LayerKVCache, PrefillChunk

from .config import EngineConfig

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
GRAPH_MEMORY_RESERVE_BYTES = 512 << 20


def default_num_kv_blocks(config: EngineConfig, model) -> int:
    """What every running sequence can use at full length, within the memory budget."""
    per_seq = config.blocks_per_seq
    per_block, useful = config.kv_bytes_per_block(), config.max_num_seqs * per_seq + 1
    if config.device.type == "cpu":
        budget = int(float(os.environ.get("KERNEL_LAB_CPU_KV_CACHE_GB", 0)) * (1 << 30)) \
            or DEFAULT_CPU_KV_CACHE_BYTES
        return max(per_seq, min(useful, budget // per_block))
    activation_peak = profile_activations(config, model)
    free, total = torch.cuda.mem_get_info(config.device)
    budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_peak \
        - GRAPH_MEMORY_RESERVE_BYTES
    if budget < per_block * per_seq:
        raise ValueError(f"not enough GPU memory for the KV cache of one {config.max_model_len}-token sequence "
                         f"(budget {budget / 2**30:.2f} GiB); raise gpu_memory_utilization or lower max_model_len")
    return min(useful, budget // per_block)


@torch.inference_mode()
def profile_activations(config: EngineConfig, model) -> int:
    """Peak extra memory of the largest eager step: one prefill chunk of max_num_batched_tokens, run over a
    one-block dummy cache with every slot -1 (it writes nothing)."""
    c, num_tokens, device = config.model_config, config.max_num_batched_tokens, config.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    dummy = torch.empty((1, config.block_size, c.num_kv_heads, c.head_dim), dtype=config.dtype, device=device)
    caches = [LayerKVCache(dummy, dummy)] * c.num_layers
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, num_tokens, 0)])
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device) % config.max_model_len
    model.compute_logits(model(ids, positions, caches, meta)[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak
