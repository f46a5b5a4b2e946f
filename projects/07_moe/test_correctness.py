"""Project 07 correctness: the MoE layer vs an independent per-expert loop in float64.

On a machine without CUDA the Triton kernels run through the interpreter (see conftest.py) at small H
and I; on a GPU they run compiled, at model sizes too. The GEMMs round the SwiGLU activations to the
activation dtype before the down projection (that is the tensor-core operand), so half-precision
tolerances are twice the elementwise ones.
"""

import importlib
import re

import pytest
import torch

from kernel_lab.harness.compile import TARGETS, check_no_spills, compile_module
from kernel_lab.harness.testing import assert_close, case_seed, randn
from kernel_lab.ops import moe
from kernel_lab.ops.moe import CONFIGS, _launch, align, fp32_config, max_row_blocks, route, route_and_align

moe_module = importlib.import_module("kernel_lab.ops.moe")  # kernel_lab.ops.moe is also the function's name
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# today's design, routing + alignment in one kernel, and the grouped tile order of both expert GEMMs
DESIGNS = [{}, {"routing": "kernel"}, {"raster": "grouped"}]


@pytest.fixture(params=DESIGNS, ids=["default", "routing-kernel", "grouped"])
def design(request, monkeypatch):
    """Groups of 2 row blocks, so the few row blocks of these tests still span several groups."""
    monkeypatch.setattr(moe_module, "GROUP_M", 2)
    return request.param


def make_inputs(tokens, E, H, I, dtype, device, seed):
    if torch.device(device).type == "cuda" and E * I * H > 2**24:
        return make_inputs_on_device(tokens, E, H, I, dtype, seed)
    x = randn((tokens, H), dtype, device, seed)
    w_gate_up = randn((E, 2 * I, H), dtype, device, seed + 1, scale=H ** -0.5)
    w_down = randn((E, H, I), dtype, device, seed + 2, scale=I ** -0.5)
    logits = randn((tokens, E), torch.float32, device, seed + 3, scale=2.0)
    return x, w_gate_up, w_down, logits


def make_inputs_on_device(tokens, E, H, I, dtype, seed):
    """Model-sized weights drawn on the GPU (drawing a billion values on the CPU would take a minute)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)

    def draw(shape, scale, dt=dtype):
        return (torch.randn(shape, generator=g, device="cuda") * scale).to(dt)

    return (draw((tokens, H), 1.0), draw((E, 2 * I, H), H ** -0.5), draw((E, H, I), I ** -0.5),
            draw((tokens, E), 2.0, torch.float32))


def reference64(x, w_gate_up, w_down, logits, top_k=2, renormalize=True):
    """Float64 per-expert loop over the routing the op's contract defines (fp32 softmax + top-k)."""
    weights, ids = route(logits, top_k, renormalize)
    I = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w_gate_up.shape[0]):
        for t, j in torch.nonzero(ids == e).tolist():
            h = w_gate_up[e].double() @ x[t].double()
            act = h[:I] * torch.sigmoid(h[:I]) * h[I:]
            out[t] += weights[t, j].double() * (w_down[e].double() @ act)
    return out


def tolerance_scale(dtype):
    return 1.0 if dtype == torch.float32 else 2.0


# --- routing and alignment (pure torch, fast) ---------------------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_float64_softmax_topk(renormalize):
    logits = randn((33, 12), torch.bfloat16, "cpu", 5, scale=3.0)
    weights, ids = route(logits, 3, renormalize)
    probs = torch.softmax(logits.double(), -1)
    expected = probs.topk(3, dim=-1).values
    assert torch.allclose(probs.gather(1, ids), expected, rtol=1e-6, atol=0)  # the chosen experts are a top-3
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(weights.sum(-1).double(), torch.ones(33, dtype=torch.float64), atol=1e-6)
    assert weights.dtype == torch.float32
    assert torch.allclose(weights.double(), expected, rtol=1e-6, atol=1e-7)


def test_route_breaks_ties_towards_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    _, ids = route(logits, 2, True)
    assert ids.tolist() == [[1, 2]]


@pytest.mark.parametrize("tokens, top_k, E, block_m", [(1, 2, 8, 16), (1, 2, 256, 16), (13, 2, 8, 16),
                                                       (40, 2, 64, 32), (300, 4, 16, 64), (7, 1, 3, 128)])
def test_align_pads_used_experts_only(tokens, top_k, E, block_m):
    g = torch.Generator().manual_seed(case_seed("align", tokens, E))
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)])
    al = align(ids, E, block_m)
    A = tokens * top_k
    assert al.max_blocks == max_row_blocks(A, E, block_m) and al.sorted_ids.numel() == al.max_blocks * block_m
    flat = ids.reshape(-1)
    sorted_ids = al.sorted_ids.view(al.max_blocks, block_m).long()
    block_expert = al.block_expert.long()
    real = sorted_ids < A
    assert sorted(sorted_ids[real].tolist()) == list(range(A)), "every assignment appears exactly once"
    for b in range(al.max_blocks):
        members = sorted_ids[b][real[b]]
        if block_expert[b] >= E:
            assert members.numel() == 0, "blocks past the last segment hold no rows"
            continue
        assert members.numel() > 0, "no block is pure padding"
        assert (flat[members] == block_expert[b]).all(), "a block holds only its expert's rows"
        assert torch.equal(real[b], torch.arange(block_m) < members.numel()), "padding sits at segment ends"
    used = torch.unique(flat)
    owners = block_expert[block_expert < E]
    assert set(owners.tolist()) == set(used.tolist()), "unused experts own no block"
    assert torch.all(owners[1:] >= owners[:-1]), "segments are sorted by expert"
    counts = torch.bincount(flat, minlength=E)
    assert owners.numel() == int(((counts + block_m - 1) // block_m).sum())


@pytest.mark.parametrize("tokens, top_k, E, block_m, renormalize", [
    (1, 2, 8, 16, True), (13, 2, 8, 16, True), (40, 2, 64, 32, False), (300, 4, 16, 64, True), (7, 1, 3, 128, True),
    (1, 2, 256, 16, True), (50, 8, 8, 16, False), (70, 2, 100, 16, True)])
def test_route_and_align_kernel_equals_route_then_align(tokens, top_k, E, block_m, renormalize, device):
    """The one-kernel routing gives route()'s experts and align()'s layout exactly, and route()'s weights
    to fp32 rounding: several token chunks (300, 70 tokens), E not a power of two, top_k up to E."""
    logits = randn((tokens, E), torch.float32, device, case_seed("ra", tokens, E), scale=2.0)
    weights, ids, al = route_and_align(logits, top_k, renormalize, E, block_m)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    ref = align(ref_ids, E, block_m)
    assert torch.equal(ids.long(), ref_ids) and al.max_blocks == ref.max_blocks
    assert torch.equal(al.sorted_ids, ref.sorted_ids) and torch.equal(al.block_expert, ref.block_expert)
    assert torch.allclose(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_route_and_align_kernel_ties_and_unreachable_experts(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [-float("inf"), 2.0, -float("inf"), 2.0, 2.0]], device=device)
    weights, ids, al = route_and_align(logits, 3, True, 5, 16)
    assert ids.tolist() == [[1, 2, 3], [1, 3, 4]]  # equal probabilities: the lower expert id first
    assert torch.equal(al.sorted_ids, align(ids.long(), 5, 16).sorted_ids)
    _, ids4, _ = route_and_align(logits, 4, False, 5, 16)
    assert ids4[1].tolist() == [1, 3, 4, 0], "probability-0 experts are taken in id order, never twice"


def test_bytes_moved_counts_the_used_experts_weights_once():
    # Mixtral, one token, top-2: two experts' gate/up and down weights (352 MB each) plus x and the output
    assert moe_module.bytes_moved(1, 4096, 14336, 2, 2) == 2 * 3 * 4096 * 14336 * 2 + 2 * 4096 * 2


def test_decode_grid_does_not_scale_with_experts():
    for E in (8, 64, 256):
        assert max_row_blocks(2, E, 16) == 2  # one token, top-2: two row blocks whatever E is
    assert max_row_blocks(32, 64, 16) == 32
    assert max_row_blocks(8192 * 2, 8, 128) == (16384 + 8 * 127) // 128


# --- the layer through the kernels ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, E, H, I", [(1, 8, 64, 40), (5, 8, 96, 48), (8, 64, 64, 24)])
def test_moe_matches_float64_loop(tokens, E, H, I, dtype, design, device):
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, dtype, device, case_seed("moe", tokens, E, dtype))
    y = moe(x, wgu, wd, logits, **design)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, reference64(x, wgu, wd, logits), dtype, scale=tolerance_scale(dtype))


def test_experts_nobody_chooses_are_never_read(design, device):
    dtype = torch.float16
    tokens, E, H, I = 6, 8, 64, 32
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, dtype, device, 41)
    logits[:, 4:] = -float("inf")  # experts 4..7 are never chosen ...
    wgu[4:] = float("nan")  # ... so their NaN weights must not reach the output
    wd[4:] = float("nan")
    y = moe(x, wgu, wd, logits, **design)
    assert torch.isfinite(y).all()
    assert_close(y, reference64(x, wgu[:4], wd[:4], logits[:, :4]), dtype, scale=2.0)


def test_one_expert_takes_every_token(design, device):
    dtype = torch.bfloat16
    tokens, E, H, I = 40, 8, 64, 32  # 40 rows for one expert: several row blocks of 16
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, dtype, device, 42)
    logits[:, 3] += 20.0
    _, ids = route(logits, 2, True)
    assert (ids[:, 0] == 3).all()
    y = moe(x, wgu, wd, logits, **design)
    assert_close(y, reference64(x, wgu, wd, logits), dtype, scale=2.0)
    # top_k = 1 with one dominant expert: the whole batch is one expert's dense MLP
    y1 = moe(x, wgu, wd, logits, top_k=1, **design)
    assert_close(y1, reference64(x, wgu, wd, logits, top_k=1), dtype, scale=2.0)


@pytest.mark.parametrize("top_k, renormalize", [(1, False), (4, True), (4, False)])
def test_top_k_range_and_renormalize(top_k, renormalize, design, device):
    x, wgu, wd, logits = make_inputs(3, 4, 48, 24, torch.float32, device, case_seed("k", top_k, renormalize))
    y = moe(x, wgu, wd, logits, top_k=top_k, renormalize=renormalize, **design)
    assert_close(y, reference64(x, wgu, wd, logits, top_k, renormalize), torch.float32)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_every_gpu_tile_config(index, design, device):
    """The exact GPU tiles (many N blocks, a K tail, an N tail) through the same kernels."""
    limit, config = CONFIGS[index]
    dtype = [torch.bfloat16, torch.float16][index % 2]
    tokens, E, H, I = 6, 4, 80, 72  # H % 64 != 0 (K tail of the first GEMM), I % 64 != 0 (N and K tails)
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, dtype, device, case_seed("config", index))
    y = _launch(x, wgu, wd, logits, 2, True, fuse_swiglu=True, config=config, **design)
    assert_close(y, reference64(x, wgu, wd, logits), dtype, scale=2.0)


def test_fp32_tile_config(device):
    config = fp32_config(CONFIGS[-1][1])
    x, wgu, wd, logits = make_inputs(6, 4, 80, 72, torch.float32, device, 60)
    y = _launch(x, wgu, wd, logits, 2, True, fuse_swiglu=True, config=config)
    assert_close(y, reference64(x, wgu, wd, logits), torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # padding rows hold uninitialised values
def test_unfused_path_through_project_02(device):
    dtype = torch.bfloat16
    x, wgu, wd, logits = make_inputs(3, 4, 64, 40, dtype, device, 43)
    y = moe(x, wgu, wd, logits, fuse_swiglu=False)
    # one more rounding (the [rows, 2*I] product) than the fused path
    assert_close(y, reference64(x, wgu, wd, logits), dtype, scale=3.0)


def test_strided_x_and_weights(design, device):
    dtype = torch.float16
    tokens, E, H, I = 4, 4, 48, 24
    x_base, _, _, logits = make_inputs(tokens, E, H + 16, I, dtype, device, 44)
    x = x_base[:, 8:8 + H]  # row stride H + 16
    wgu = randn((E, H, 2 * I), dtype, device, 45, scale=H ** -0.5).transpose(1, 2)  # K not contiguous
    wd = randn((H, E, I), dtype, device, 46, scale=I ** -0.5).transpose(0, 1)  # expert stride I, not H*I
    y = moe(x, wgu, wd, logits.t().contiguous().t(), **design)  # column-major router logits too
    assert_close(y, reference64(x, wgu, wd, logits), dtype, scale=2.0)


def test_zero_tokens(design, device):
    x, wgu, wd, logits = make_inputs(1, 4, 32, 16, torch.float16, device, 47)
    y = moe(x[:0], wgu, wd, logits[:0], **design)
    assert y.shape == (0, 32) and y.dtype == torch.float16


def test_reference_path_agrees(reference_only):
    x, wgu, wd, logits = make_inputs(5, 8, 64, 32, torch.float32, "cpu", 48)
    assert_close(moe(x, wgu, wd, logits), reference64(x, wgu, wd, logits), torch.float32)


def _bad(device, **override):
    x, wgu, wd, logits = make_inputs(3, 4, 16, 8, torch.float32, device, 49)
    args = {"x": x, "w_gate_up": wgu, "w_down": wd, "router_logits": logits, **override}
    return moe(**args)


@pytest.mark.parametrize(
    "override, error, pattern",
    [
        (lambda d: {"x": torch.ones(16, device=d)}, ValueError, "x must be 2-D"),
        (lambda d: {"x": torch.ones(3, 16, dtype=torch.int32, device=d)}, TypeError, "x must have dtype"),
        (lambda d: {"x": "tokens"}, TypeError, "x must be a torch.Tensor"),
        (lambda d: {"w_gate_up": torch.ones(4, 16, 16, dtype=torch.half, device=d)}, TypeError,
         "w_gate_up must have dtype"),
        (lambda d: {"w_gate_up": torch.ones(4, 15, 16, device=d)}, ValueError, "w_gate_up's second dimension"),
        (lambda d: {"w_gate_up": torch.ones(4, 16, 12, device=d)}, ValueError, "w_gate_up must have shape"),
        (lambda d: {"w_gate_up": torch.ones(16, 16, device=d)}, ValueError, "w_gate_up must be 3-D"),
        (lambda d: {"w_down": torch.ones(5, 16, 8, device=d)}, ValueError, "w_down must have shape"),
        (lambda d: {"w_down": torch.ones(4, 8, 16, device=d)}, ValueError, "w_down must have shape"),
        (lambda d: {"router_logits": torch.ones(3, 5, device=d)}, ValueError, "router_logits must have shape"),
        (lambda d: {"router_logits": torch.ones(3, 4, dtype=torch.long, device=d)}, TypeError,
         "router_logits must have dtype"),
        (lambda d: {"top_k": 0}, ValueError, "top_k must be an int in"),
        (lambda d: {"top_k": 5}, ValueError, "top_k must be an int in"),
        (lambda d: {"top_k": 2.0}, ValueError, "top_k must be an int in"),
        (lambda d: {"top_k": True}, ValueError, "top_k must be an int in"),
        (lambda d: {"renormalize": 1}, TypeError, "renormalize must be a bool"),
        (lambda d: {"routing": "cuda"}, ValueError, "routing must be one of"),
        (lambda d: {"raster": "swizzled"}, ValueError, "raster must be one of"),
    ],
)
def test_bad_input_is_rejected_with_a_named_argument(override, error, pattern, device):
    with pytest.raises(error, match=pattern):
        _bad(device, **override(device))


def test_mixed_devices_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")  # pragma: no cover
    with pytest.raises(ValueError, match="share a device"):
        _bad("cuda", router_logits=torch.ones(3, 4))


# --- generated code -----------------------------------------------------------------------------------
SM89_MAX_SHARED = 99 * 1024  # the most shared memory one block may use on sm_86/sm_89


@pytest.fixture(scope="module")
def compiled():
    return compile_module("kernel_lab.ops.moe", targets=TARGETS)


def test_compiles_for_every_target_without_spills(compiled):
    names = check_no_spills(compiled)
    assert {n.split("_")[1] for n in names} == {"gate", "down", "combine", "route"}
    assert any("grouped" in n for n in names)
    for (name, target), result in compiled.items():
        if result["shared_bytes"] is not None and target != "sm_90a":
            assert result["shared_bytes"] <= SM89_MAX_SHARED, (name, target, result["shared_bytes"])


def test_route_align_is_one_kernel_of_warp_reductions_and_scans(compiled):
    """Softmax, top-k and counts reduce with butterfly shuffles, the segment offsets and ranks are scans
    (SHFL.UP); no atomics, so the alignment is the same on every run."""
    routes = [(key, r) for key, r in compiled.items() if "route" in key[0]]
    assert routes
    for (name, target), result in routes:
        sass = result["sass"]
        assert "SHFL.BFLY" in sass and "SHFL.UP" in sass, (name, target)
        assert not re.search(r"\b(ATOM|RED)\.", sass), (name, target)
        assert result["stack_frame"] == 0, f"{name} {target} uses local memory"


def test_sass_uses_tensor_cores(compiled):
    for (name, target), result in compiled.items():
        if "combine" in name or "route" in name:
            continue
        sass = result["sass"]
        if "fp32" in name:  # IEEE fp32 dots run on the FMA units; HMMA here would mean tf32 rounding
            assert "FFMA" in sass and "HMMA" not in sass and "HGMMA" not in sass, (name, target)
        elif target == "sm_90a":
            assert "HGMMA" in sass or "HMMA" in sass, (name, target)
        else:
            assert "HMMA" in sass, (name, target)


def test_sass_weight_tiles_use_wide_loads(compiled):
    # weights stream through shared memory with 16-byte async copies (LDGSTS) or 128-bit loads
    for (name, target), result in compiled.items():
        if "combine" in name or "route" in name:
            continue
        sass = result["sass"]
        wide = re.findall(r"(?:LDGSTS|LDG)\.E[A-Z0-9.]*\.128", sass)
        assert wide, (name, target)


# --- GPU-only checks -----------------------------------------------------------------------------------
def reference32(x, w_gate_up, w_down, logits, top_k=2):
    from kernel_lab.ops.moe import moe_reference

    return moe_reference(x.float(), w_gate_up.float(), w_down.float(), logits, top_k).double()


# Mixtral-sized weights are checked once, in bf16, to keep the GPU suite short
GPU_SHAPES = [(1, 8, 4096, 14336, torch.bfloat16), (16, 8, 4096, 14336, torch.bfloat16)] + [
    (*shape, dtype) for dtype in (torch.bfloat16, torch.float16)
    for shape in [(3, 64, 2048, 768), (333, 64, 2048, 768), (2048, 8, 1024, 2816), (77, 8, 1000, 3000)]]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, E, H, I, dtype", GPU_SHAPES)
def test_gpu_model_shapes(tokens, E, H, I, dtype):
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, dtype, "cuda", case_seed("gpu", tokens, E, H, dtype))
    y = moe(x, wgu, wd, logits)
    # fp32 reference over the same half-precision weights; accumulation is fp32, so the error is the
    # rounding of the activations and of the output, independent of K
    assert_close(y, reference32(x, wgu, wd, logits), dtype, scale=3.0)
    # and a subsample against the independent float64 loop (the fp32 reference is the op's own)
    rows = sorted({0, tokens // 2, tokens - 1})
    assert_close(y[rows], reference64(x[rows], wgu, wd, logits[rows]), dtype, scale=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, E, H, I", [(16, 8, 4096, 14336), (2048, 8, 1024, 2816), (333, 64, 2048, 768)])
@pytest.mark.parametrize("gpu_design", DESIGNS[1:], ids=["routing-kernel", "grouped"])
def test_gpu_new_designs_match_the_default(tokens, E, H, I, gpu_design):
    x, wgu, wd, logits = make_inputs(tokens, E, H, I, torch.bfloat16, "cuda", case_seed("gpu-d", tokens, E))
    y = moe(x, wgu, wd, logits, **gpu_design)
    assert_close(y, reference32(x, wgu, wd, logits), torch.bfloat16, scale=3.0)
    weights, ids, al = route_and_align(logits, 2, True, E, 16)
    ref_ids = route(logits, 2, True)[1]
    assert torch.equal(ids.long(), ref_ids) and torch.equal(al.sorted_ids, align(ref_ids, E, 16).sorted_ids)


@pytest.mark.gpu
def test_gpu_routing_kernel_under_cuda_graph():
    x, wgu, wd, logits = make_inputs(4, 8, 1024, 2048, torch.bfloat16, "cuda", 55)
    out = torch.empty_like(x)
    out.copy_(moe(x, wgu, wd, logits, routing="kernel"))  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(moe(x, wgu, wd, logits, routing="kernel"))
    logits.copy_(make_inputs(4, 8, 1024, 2048, torch.bfloat16, "cuda", 56)[3])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference32(x, wgu, wd, logits), torch.bfloat16, scale=2.0)


@pytest.mark.gpu
def test_gpu_fp32_uses_ieee_dots():
    x, wgu, wd, logits = make_inputs(64, 8, 512, 384, torch.float32, "cuda", 50)
    assert_close(moe(x, wgu, wd, logits), reference64(x.cpu(), wgu.cpu(), wd.cpu(), logits.cpu()), torch.float32)


@pytest.mark.gpu
def test_gpu_unused_experts_with_nan_weights():
    x, wgu, wd, logits = make_inputs(16, 64, 2048, 768, torch.bfloat16, "cuda", 51)
    logits[:, 8:] = -float("inf")
    wgu[8:] = float("nan")
    wd[8:] = float("nan")
    y = moe(x, wgu, wd, logits)
    assert torch.isfinite(y).all()
    assert_close(y, reference32(x, wgu[:8], wd[:8], logits[:, :8]), torch.bfloat16, scale=2.0)


@pytest.mark.gpu
def test_gpu_deterministic_and_fused_equals_unfused_closely():
    x, wgu, wd, logits = make_inputs(512, 8, 1024, 2048, torch.bfloat16, "cuda", 52)
    a, b = moe(x, wgu, wd, logits), moe(x, wgu, wd, logits)
    assert torch.equal(a, b), "the combine is a gather-sum: results must be bitwise reproducible"
    assert_close(moe(x, wgu, wd, logits, fuse_swiglu=False), reference32(x, wgu, wd, logits), torch.bfloat16,
                 scale=3.0)


@pytest.mark.gpu
def test_gpu_under_cuda_graph():
    x, wgu, wd, logits = make_inputs(4, 8, 1024, 2048, torch.bfloat16, "cuda", 53)
    out = torch.empty_like(x)
    out.copy_(moe(x, wgu, wd, logits))  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(moe(x, wgu, wd, logits))
    x2, _, _, logits2 = make_inputs(4, 8, 1024, 2048, torch.bfloat16, "cuda", 54)
    x.copy_(x2)
    logits.copy_(logits2)  # new routing: the alignment must be recomputed on the device
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference32(x, wgu, wd, logits), torch.bfloat16, scale=2.0)
