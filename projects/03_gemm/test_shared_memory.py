"""Project 03: every GEMM config the dispatcher can launch fits the GPU's shared memory.

An L4 (sm_89) gives a block 101,376 B of shared memory; the first configs of the autotune lists need up to
147 KB, and with autotuning off the dispatcher launches the first config it keeps. The configs are filtered
by the device's limit (`gemm.fit_shared_memory`, from an upper-bound estimate); here Triton's own count
(`compiled.metadata.shared`) for sm_80, sm_89 and sm_90 shows, for the tiled, persistent and TMA kernels, that
each config kept for a target fits it and that the estimate is an upper bound.
"""

import re

import pytest
import torch

from kernel_lab.harness.compile import SHARED_MEMORY_PER_BLOCK, arch_name, finish_compile_child, start_compile_child
from kernel_lab.ops import gemm

L4_SHARED = SHARED_MEMORY_PER_BLOCK[89]
M_CASES = (1, 16, 32, 33, 64, 65, 100, 128, 129, 4096)


@pytest.fixture(scope="module")
def dispatch_compiled():
    """{(spec name, target): summary entry with "shared_bytes"}, one child process per target, concurrently."""
    children = [start_compile_child("kernel_lab.ops.gemm", targets=(t,), specs="dispatch_config_specs")
                for t in SHARED_MEMORY_PER_BLOCK]
    entries = [e for child in children for e in finish_compile_child(child)]
    return {(e["name"], e["target"]): e for e in entries}


def _tiles(config):
    return tuple(config.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + (config.num_stages,)


def test_dispatchable_configs_fit_shared_memory(dispatch_compiled):
    for target, limit in SHARED_MEMORY_PER_BLOCK.items():
        compiled = {name: r for (name, t), r in dispatch_compiled.items() if t == arch_name(target)}
        expected = 2 * len(gemm.fit_shared_memory(gemm._pointer_configs(), limit))  # tiled and persistent
        if target >= 90 and gemm.TensorDescriptor is not None:
            expected += len(gemm.fit_shared_memory(gemm._tma_configs(), limit))
        assert len(compiled) == expected, (target, sorted(compiled))
        for name, result in compiled.items():
            bm, bn, bk, stages = (int(x) for x in re.search(r"_(\d+)x(\d+)x(\d+)s(\d+)w", name).groups())
            shared = result["shared_bytes"]
            assert shared is not None and 0 < shared <= limit, (name, shared, limit)
            assert shared <= gemm.config_shared_bytes(bm, bn, bk, stages), (name, shared, "estimate too low")


def test_l4_limit_removes_the_configs_that_do_not_fit():
    kept = [_tiles(c) for c in gemm.fit_shared_memory(gemm._pointer_configs(), L4_SHARED)]
    assert (128, 256, 64, 3) not in kept and (128, 128, 64, 4) not in kept  # 147 KB and 131 KB
    assert (128, 128, 32, 4) in kept and (16, 64, 128, 4) in kept
    assert len(gemm.fit_shared_memory(gemm._pointer_configs(), SHARED_MEMORY_PER_BLOCK[90])) == len(
        gemm._pointer_configs())


@pytest.mark.parametrize("autotune", ["0", "1"])
@pytest.mark.parametrize("limit", [L4_SHARED, SHARED_MEMORY_PER_BLOCK[80], SHARED_MEMORY_PER_BLOCK[90]])
def test_pruning_keeps_only_configs_that_fit_the_device(monkeypatch, limit, autotune):
    """What the autotuner may time or (autotuning off) launch, for every M bucket, under a device limit."""
    monkeypatch.setenv("KERNEL_LAB_GEMM_AUTOTUNE", autotune)
    monkeypatch.setattr(gemm, "device_shared_memory", lambda index: limit)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for configs in (gemm._pointer_configs(), gemm._tma_configs()):
        for m in M_CASES:
            chosen = gemm._prune_by_m(configs, {"M": m})
            assert chosen and len(chosen) <= (3 if autotune == "1" else 1), (m, chosen)
            for c in chosen:
                assert gemm.config_shared_bytes(*_tiles(c)) <= limit, (m, _tiles(c), limit)


def test_without_the_filter_an_l4_would_get_an_oversized_first_config(monkeypatch):
    """The test above can fail: with no limit, M > 128 launches a 147 KB config."""
    monkeypatch.setenv("KERNEL_LAB_GEMM_AUTOTUNE", "0")
    monkeypatch.setattr(gemm, "device_shared_memory", lambda index: 1 << 30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    (first,) = gemm._prune_by_m(gemm._pointer_configs(), {"M": 4096})
    assert gemm.config_shared_bytes(*_tiles(first)) > L4_SHARED


@pytest.mark.gpu
@pytest.mark.parametrize("M", [300, 100, 16])
def test_gpu_first_config_launches_with_autotuning_off(monkeypatch, M):
    """On this GPU, the config the dispatcher launches without autotuning fits (an L4 raised OutOfResources)."""
    from kernel_lab.harness.testing import assert_close, case_seed, randn

    monkeypatch.setenv("KERNEL_LAB_GEMM_AUTOTUNE", "0")
    gemm._autotuned.cache_clear()  # a fresh autotuner: the environment variable is read when it prunes
    a = randn((M, 1024), torch.bfloat16, "cuda", case_seed("smem", M))
    b = randn((1024, 768), torch.bfloat16, "cuda", case_seed("smem-b", M))
    for variant in ("tiled", "auto"):
        assert_close(gemm.matmul(a, b, variant=variant), torch.matmul(a.float(), b.float()), torch.bfloat16,
                     scale=1.25)
