"""Multi-LoRA through the engine (kernel_lab/engine/lora.py) against transformers with each adapter merged.

A tiny random Llama checkpoint (float32, initializer_range 0.3 as in projects/09_engine/test_families.py, the
bundled model's tokenizer) and random PEFT adapters written in PEFT's layout (keys
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`, [r, in] and [out, r]; where `peft` is
importable, one more test builds the adapter with peft itself and merges it with peft's merge_and_unload).
The reference is transformers' greedy output with W += scale * B @ A merged into the weights, one prompt at a
time. The engine runs one batch that mixes three adapters and the base model, with prefix caching on and one
prompt shared by all four; a second pass over the same engine finds the shared prompt's blocks cached for the
adapter that computed them, and only for it. With fewer slots than adapters, LRU eviction reloads them.
Refusals (DoRA, rank above max_lora_rank, modules the model lacks, lm_head, missing files, bad shapes) name
the adapter.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kernel_lab.engine import LLM, LoRARequest, SamplingParams
from kernel_lab.engine.lora import LoRAAdapterError, load_peft_adapter
from kernel_lab.harness.random_lora import write_adapter
from kernel_lab.models.config import ModelConfig

NEW_TOKENS = 6
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=512, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHARED = ("The following notes summarise a long technical report about the history of computing, from the "
          "first mechanical calculators through vacuum tubes and transistors, to the integrated circuits and "
          "microprocessors that followed them.")
OTHER = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
# name -> (rank, alpha, use_rslora, modules): ranks 8 and 32 on all seven projections, and one adapter that
# leaves slices out (k of q|k|v, gate of gate|up): those stay zero in its stacked weights
ADAPTERS = {"r8": (8, 16, False, MODULES), "r32": (32, 16, True, MODULES),
            "partial": (16, 32, False, ("k_proj", "v_proj", "up_proj", "o_proj"))}
ENGINE = dict(dtype="float32", device="cpu", weights="float32", max_model_len=256, max_num_seqs=6,
              num_kv_blocks=64, max_num_batched_tokens=32, block_size=16, enable_lora=True, max_lora_rank=32)

pytestmark = pytest.mark.usefixtures("reference_only")


def merged_state(base: dict, tensors: dict, rank: int, alpha, use_rslora: bool) -> dict:
    """The base weights with W += scale * B @ A merged, in float64 then rounded to float32."""
    scale = alpha / rank ** 0.5 if use_rslora else alpha / rank
    state = dict(base)
    for key in tensors:
        if key.endswith("lora_A.weight"):
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
            a, b = tensors[key].double(), tensors[key.replace("lora_A", "lora_B")].double()
            state[name] = (state[name].double() + scale * (b @ a)).float()
    return state


@pytest.fixture(scope="module")
def tokenizer_dir():
    try:
        from kernel_lab.models.loader import resolve_model_dir

        return resolve_model_dir(None)
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"the bundled model's tokenizer is not installed here: {exc}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    """(checkpoint dir, hf config, {name: (LoRARequest, merged state dict)})."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("lora")
    checkpoint = root / "base"
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY), dtype=torch.float32)
    model.save_pretrained(str(checkpoint))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, checkpoint / name)
    hf = json.loads((checkpoint / "config.json").read_text())
    base = load_file(str(checkpoint / "model.safetensors"))
    adapters = {}
    for i, (name, (rank, alpha, rslora, modules)) in enumerate(ADAPTERS.items()):
        tensors = write_adapter(root / name, hf, rank, alpha, rslora, modules, seed=100 + i)
        adapters[name] = (LoRARequest(name, i + 1, str(root / name)), merged_state(base, tensors, rank, alpha, rslora))
    return checkpoint, hf, adapters, base


def transformers_greedy(checkpoint, state: dict, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations under `state`, one prompt at a time (no padding), float32; checks the margins."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    model.load_state_dict(state, strict=False)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
            margin = min(float(s[0].topk(2).values.diff().abs()) for s in out.scores)
            assert margin > 1e-3, f"a greedy step has top-2 margin {margin}: the comparison is not decisive"
            outs.append(out.sequences[0, len(ids):].tolist())
    return outs


PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def run(llm: LLM, cases: list[tuple[str, str | None]], adapters) -> list[list[int]]:
    """Greedy tokens of (prompt, adapter name or None) cases, all in one generate call."""
    outs = llm.generate([p for p, _ in cases], PARAMS,
                        lora_request=[adapters[a][0] if a else None for _, a in cases])
    return [o.outputs[0].token_ids for o in outs]


def references(setup, llm, cases):
    checkpoint, _, adapters, base = setup
    ids = {p: llm.tokenizer.encode(p, add_special_tokens=True) for p, _ in cases}
    want = {}
    for p, a in cases:
        if (p, a) not in want:
            want[(p, a)] = transformers_greedy(checkpoint, adapters[a][1] if a else base, [ids[p]])[0]
    return [want[c] for c in cases]


def test_mixed_batch_matches_merged_transformers(setup):
    """Three adapters and the base model in one batch, one prompt shared by all four; then a second pass in
    which the shared prompt's cached blocks serve only the adapter that computed them."""
    checkpoint, _, adapters, _ = setup
    llm = LLM(str(checkpoint), max_loras=3, **ENGINE)
    seen = []
    set_rows = llm.engine.lora.set_rows
    llm.engine.lora.set_rows = lambda seqs: (seen.append({llm.engine.lora.slot_of(s) for s in seqs}),
                                             set_rows(seqs))[1]
    first = [(SHARED, "r8"), (SHARED, "r32"), (SHARED, None), (SHARED, "partial"), (OTHER, "r32"), (OTHER, None)]
    want = references(setup, llm, first)
    assert len({tuple(w) for w in want[:4]}) == 4, "each adapter must change the shared prompt's output"
    assert run(llm, first, adapters) == want
    assert any(len(s - {-1}) == 3 and -1 in s for s in seen), f"no step mixed 3 adapters and the base: {seen}"

    # the shared prompt's blocks are now cached under r8, r32, partial and the base; permuted, each must still
    # find only its own (a block computed under one adapter is never served to another)
    hits = llm.engine.block_manager.prefix_cache_hits
    second = [(SHARED, "partial"), (SHARED, None), (SHARED, "r8"), (SHARED, "r32"), (OTHER, "partial")]
    assert run(llm, second, adapters) == references(setup, llm, second)
    full_blocks = (len(llm.tokenizer.encode(SHARED, add_special_tokens=True)) - 1) // 16
    assert full_blocks >= 2
    assert llm.engine.block_manager.prefix_cache_hits - hits == 4 * full_blocks * 16, \
        "the shared prompt must hit its own adapter's cached blocks, for each of the four"
    stats = llm.engine.stats()
    assert stats["kv_cache_blocks_free"] == stats["kv_cache_blocks_total"], "blocks leaked"
    assert not llm.engine.lora.seq_slots and not +llm.engine.lora.pins, "adapter slots leaked"


def test_bfloat16_slots_equal_float32_slots_of_the_rounded_adapters(setup):
    """--lora-dtype bfloat16 (CPU, float32 activations): the same tokens as float32 slots holding each adapter
    rounded to bfloat16, in a batch mixing three adapters and the base (the kernel widens the weights exactly,
    so the two engines compute the same bits)."""
    checkpoint, _, adapters, _ = setup
    cases = [(SHARED, "r8"), (SHARED, "r32"), (SHARED, None), (OTHER, "partial"), (OTHER, "r32")]
    narrow = LLM(str(checkpoint), max_loras=3, lora_dtype="bfloat16", **ENGINE)
    assert all(a.dtype == torch.bfloat16 for a, _ in narrow.engine.lora.stacks.values())
    wide = LLM(str(checkpoint), max_loras=3, **ENGINE)
    for name in ("r8", "r32", "partial"):
        parsed = wide.engine.lora.register(adapters[name][0])
        for key, (a, b) in parsed.weights.items():
            parsed.weights[key] = (a.bfloat16().float(), b.bfloat16().float())
    assert run(narrow, cases, adapters) == run(wide, cases, adapters)


@pytest.mark.parametrize("options, match", [
    (dict(lora_dtype="float16"), "lora_dtype 'float16' under float32 activations on cpu has no LoRA kernel"),
    (dict(lora_dtype="int4"), "lora_dtype must be"),
])
def test_lora_dtype_without_a_kernel_is_refused_by_name(setup, options, match):
    checkpoint, _, _, _ = setup
    with pytest.raises(ValueError, match=match):
        LLM(str(checkpoint), max_loras=1, **{**ENGINE, **options})


def test_lru_eviction_with_fewer_slots_than_adapters(setup):
    """Two slots, three adapters and the base: sequences wait for a slot, least recently used adapters are
    evicted and reloaded, and every output still equals the merged reference."""
    checkpoint, _, adapters, _ = setup
    llm = LLM(str(checkpoint), max_loras=2, **ENGINE)
    cases = [(OTHER, "r8"), (OTHER, "r32"), (OTHER, "partial"), (SHARED, None), (SHARED, "r8"), (OTHER, "partial")]
    assert run(llm, cases, adapters) == references(setup, llm, cases)
    manager = llm.engine.lora
    assert manager.num_loads >= 4, f"expected evictions and reloads, got {manager.num_loads} loads"
    assert len(manager.lru) == 2 and not manager.seq_slots


def test_requests_per_adapter_in_stats_and_metrics(setup):
    """stats()["lora_requests"] counts unfinished requests per adapter, running and waiting, and /metrics
    exports them (vLLM's lora_requests_info and a gauge per adapter); a finished request leaves no count."""
    from kernel_lab.server.metrics import ServerMetrics

    checkpoint, _, adapters, _ = setup
    llm = LLM(str(checkpoint), max_loras=2, **{**ENGINE, "max_num_seqs": 2})
    engine = llm.engine
    assert "lora_requests" not in LLM(str(checkpoint), **{**ENGINE, "enable_lora": False}).engine.stats()
    for i, name in enumerate(("r8", "r8", "r32", None)):
        ids = llm.tokenizer.encode(OTHER, add_special_tokens=True)
        engine.add_request(str(i), ids, PARAMS, lora_request=adapters[name][0] if name else None)
    engine.step()
    lora = engine.stats()["lora_requests"]
    assert lora["max_lora"] == 2
    assert lora["running"] == {"r8": 2} and lora["waiting"] == {"r32": 1}, lora
    metrics = ServerMetrics("m")
    metrics.on_step(engine.stats())
    text = metrics.render()
    assert 'kernel_lab_lora_requests_running{model_name="m",lora_name="r8"} 2' in text
    assert 'kernel_lab_lora_requests_waiting{model_name="m",lora_name="r32"} 1' in text
    assert 'running_lora_adapters="r8",waiting_lora_adapters="r32",max_lora="2"' in text
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["lora_requests"] == {"running": {}, "waiting": {}, "max_lora": 2}


def test_peft_built_adapter(setup, tmp_path):
    """An adapter made and saved by peft itself, merged by peft's merge_and_unload for the reference."""
    peft = pytest.importorskip("peft")
    import transformers

    checkpoint = setup[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    torch.manual_seed(3)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=24, target_modules=list(MODULES),
                                                      init_lora_weights=False, use_rslora=True))
    lora.save_pretrained(str(tmp_path / "peft"))
    merged = lora.merge_and_unload().state_dict()
    llm = LLM(str(checkpoint), max_loras=1, **ENGINE)
    request = LoRARequest("peft", 9, str(tmp_path / "peft"))
    out = llm.generate([SHARED], PARAMS, lora_request=request)[0].outputs[0].token_ids
    ids = llm.tokenizer.encode(SHARED, add_special_tokens=True)
    assert out == transformers_greedy(checkpoint, merged, [ids])[0]
    assert out != transformers_greedy(checkpoint, setup[3], [ids])[0], "the adapter must change the output"


def _registry_families() -> dict:
    """projects/09_engine/test_families.py's tiny checkpoint settings, one per registered family."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "09_engine" / "test_families.py"
    spec = importlib.util.spec_from_file_location("_families_for_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: {**module.COMMON, **settings, "_class": cls} for name, (cls, settings) in module.FAMILIES.items()}


FAMILY_SETTINGS = _registry_families()


@pytest.mark.parametrize("family", list(FAMILY_SETTINGS))
def test_every_family_matches_merged_transformers(family, tmp_path, tokenizer_dir):
    """Each registered family's tiny checkpoint with a rank-8 adapter on every projection it has (Phi-3: its
    stacked qkv_proj and gate_up_proj; the MoE families: attention only), in a batch with the base model."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    settings = dict(FAMILY_SETTINGS[family])
    cls = settings.pop("_class")
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**settings),
                                                          dtype=torch.float32)
    checkpoint = tmp_path / "base"
    model.save_pretrained(str(checkpoint))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, checkpoint / name)
    hf = json.loads((checkpoint / "config.json").read_text())
    if cls == "Phi3Config":
        modules = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    elif "num_local_experts" in settings or "num_experts" in settings:
        modules = ("q_proj", "k_proj", "v_proj", "o_proj")
    else:
        modules = MODULES
    tensors = write_adapter(tmp_path / "adapter", hf, 8, 16, False, modules, seed=5)
    base = load_file(str(checkpoint / "model.safetensors"))
    request = LoRARequest(family, 1, str(tmp_path / "adapter"))
    setup = (checkpoint, hf, {family: (request, merged_state(base, tensors, 8, 16, False))}, base)
    llm = LLM(str(checkpoint), max_loras=1, **ENGINE)
    cases = [(SHARED, family), (SHARED, None), (OTHER, family)]
    want = references(setup, llm, cases)
    assert want[0] != want[1], "the adapter must change the output"
    assert run(llm, cases, setup[2]) == want


def test_moe_mlp_adapter_is_refused(tmp_path):
    """An MoE family's experts have no dense gate/up/down to adapt: refused, naming the adapter."""
    settings = dict(FAMILY_SETTINGS["mixtral"])
    settings.pop("_class")
    hf = {**settings, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    write_adapter(tmp_path / "moe", hf, 8, 16, False, ("q_proj", "gate_proj"), seed=6)
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'moe'.*target module 'gate_proj' is not a projection"):
        load_peft_adapter(LoRARequest("moe", 1, str(tmp_path / "moe")), ModelConfig.from_hf(hf), 32)


# ------------------------------------------------------------------------------------------------ refusals
@pytest.fixture
def model_config(setup):
    return ModelConfig.from_hf(setup[1])


def test_scales_and_stacked_layout(setup, model_config):
    """alpha/r, rsLoRA's alpha/sqrt(r), and the partial adapter's missing slices stored as zeros."""
    _, _, adapters, _ = setup
    assert load_peft_adapter(adapters["r8"][0], model_config, 32).scale == 16 / 8
    assert load_peft_adapter(adapters["r32"][0], model_config, 32).scale == pytest.approx(16 / 32 ** 0.5)
    partial = load_peft_adapter(adapters["partial"][0], model_config, 32)
    a, b = partial.weights[(0, "qkv_proj")]
    assert not a[0].any() and not b[:64].any() and a[1].any() and b[64:96].any() and b[96:].any()
    a, b = partial.weights[(1, "gate_up_proj")]
    assert not a[0].any() and not b[:96].any() and a[1].any() and b[96:].any()
    assert (1, "down_proj") not in partial.weights


@pytest.mark.parametrize("case, extra, match", [
    ("dora", {"use_dora": True}, "DoRA"),
    ("rank", {"r": 64}, "rank 64 is above max_lora_rank 32"),
    ("module", {"target_modules": ["q_proj", "c_attn"]}, "target module 'c_attn' is not a projection"),
    ("lm_head", {"target_modules": ["q_proj", "lm_head"]}, "lm_head is not supported"),
    ("modules_to_save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ("bias", {"bias": "all"}, "biases"),
])
def test_refusals_name_the_adapter(setup, model_config, tmp_path, case, extra, match):
    hf = setup[1]
    rank = extra.get("r", 8)
    write_adapter(tmp_path / case, hf, rank, 16, False, ("q_proj",), seed=1)
    cfg = json.loads((tmp_path / case / "adapter_config.json").read_text())
    (tmp_path / case / "adapter_config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'bad-{case}'.*{match}"):
        load_peft_adapter(LoRARequest(f"bad-{case}", 5, str(tmp_path / case)), model_config, 32)


def test_refusals_of_weights(setup, model_config, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = setup[1]
    tensors = write_adapter(tmp_path / "w", hf, 8, 16, False, ("q_proj", "k_proj"), seed=2)
    path = tmp_path / "w" / "adapter_model.safetensors"

    def refused(bad: dict, match: str):
        save_file(bad, str(path))
        with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'w'.*{match}"):
            load_peft_adapter(LoRARequest("w", 5, str(tmp_path / "w")), model_config, 32)

    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    refused({**tensors, key: torch.randn(33, 8)}, r"k_proj.lora_B has shape \(33, 8\), expected \(32, 8\)")
    refused({**tensors, key.replace("k_proj", "qkv"): torch.randn(32, 8)}, "the model has no self_attn.qkv")
    refused({**tensors, key.replace("layers.0", "layers.5"): torch.randn(32, 8),
             key.replace("layers.0", "layers.5").replace("lora_B", "lora_A"): torch.randn(8, 64)}, "has 2 layers")
    refused({**tensors, "base_model.model.lm_head.lora_A.weight": torch.randn(8, 64)}, "lm_head")
    refused({**tensors, key.replace("lora_B.weight", "lora_magnitude_vector"): torch.randn(32)}, "DoRA")
    refused({k: v for k, v in tensors.items() if k != key}, "lora_A without its lora_B")
    save_file(tensors, str(path))
    assert load_file(str(path))  # restored: the directory loads again
    path.unlink()
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'w'.*adapter_model.safetensors is missing"):
        load_peft_adapter(LoRARequest("w", 5, str(tmp_path / "w")), model_config, 32)
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'nowhere'.*no such directory"):
        load_peft_adapter(LoRARequest("nowhere", 5, str(tmp_path / "nowhere")), model_config, 32)


def test_engine_refusals_leave_no_state(setup, tmp_path):
    """A refused adapter fails add_request alone: nothing is queued, and the engine serves the next one."""
    checkpoint, hf, adapters, _ = setup
    write_adapter(tmp_path / "big", hf, 64, 16, False, ("q_proj",), seed=4)
    llm = LLM(str(checkpoint), max_loras=1, **{**ENGINE, "max_num_seqs": 2})
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'big'.*rank 64 is above max_lora_rank 32"):
        llm.generate([OTHER], PARAMS, lora_request=LoRARequest("big", 4, str(tmp_path / "big")))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 1 already names adapter 'r8'"):
        llm.generate([OTHER, OTHER], PARAMS, lora_request=[adapters["r8"][0], LoRARequest("other", 1, "/x")])
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        llm.generate([OTHER, OTHER], PARAMS, lora_request=[adapters["r8"][0]])
    assert not llm.engine.requests and not llm.engine.scheduler.waiting
    assert len(run(llm, [(OTHER, "r8")], adapters)[0]) == NEW_TOKENS
    with pytest.raises(ValueError, match="enable_lora=True"):
        LLM(str(checkpoint), **{**ENGINE, "enable_lora": False}).generate([OTHER], PARAMS,
                                                                         lora_request=adapters["r8"][0])
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("x", 0, "/x")


# ------------------------------------------------------------------------------------------------ the server
def serve_args(checkpoint, *extra: str):
    import argparse

    from kernel_lab.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(["--model", str(checkpoint), "--dtype", "float32", "--device", "cpu", "--weights",
                              "float32", "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "4",
                              *extra])


def test_server_selects_adapters_by_model(setup, tmp_path):
    """`serve --enable-lora --lora-modules r8=... r32=...`: /v1/models lists them with the base as parent, a
    request's `model` picks the adapter (outputs equal the merged references), an unknown name is a 404
    model_not_found; a malformed adapter fails the start, and --lora-modules needs --enable-lora."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    import httpx

    from kernel_lab.server.background import BackgroundServer
    from kernel_lab.server.launch import ServeArgumentError, build_server

    checkpoint, hf, adapters, _ = setup
    paths = {name: adapters[name][0].lora_path for name in ("r8", "r32")}
    args = serve_args(checkpoint, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--lora-modules",
                      *(f"{n}={p}" for n, p in paths.items()))
    app, async_engine = build_server(args)
    with BackgroundServer(app) as server:
        assert async_engine.ready_event.wait(60) and async_engine.state == "ready", async_engine.error
        listing = httpx.get(server.url + "/v1/models").json()["data"]
        base_name = listing[0]["id"]
        assert [(m["id"], m["parent"]) for m in listing] == [(base_name, None), ("r8", base_name),
                                                              ("r32", base_name)]
        assert httpx.get(server.url + "/v1/models/r32").json()["root"] == paths["r32"]
        engine = async_engine.engine
        # the server's prompt ids are the engine's (the same tokenizer); the references are per adapter
        want = references(setup, engine, [(OTHER, "r8"), (OTHER, "r32"), (OTHER, None)])
        assert len({tuple(w) for w in want}) == 3, "each adapter must change the output"
        for (name, _), tokens in zip([("r8", 0), ("r32", 0), (base_name, 0)], want):
            body = {"model": name, "prompt": OTHER, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            got = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
            assert got["choices"][0]["text"] == engine.tokenizer.decode(tokens), name
        chats = {name: httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": OTHER}], "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}).json()["choices"][0]["message"]["content"]
            for name in ("r8", base_name)}
        assert chats["r8"] != chats[base_name], "chat must route the adapter too"
        missing = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": OTHER}, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert httpx.get(server.url + "/v1/models/nope").status_code == 404

    bad = tmp_path / "dora"
    write_adapter(bad, hf, 8, 16, False, ("q_proj",), seed=8, use_dora=True)
    app, async_engine = build_server(serve_args(checkpoint, "--enable-lora", "--lora-modules", f"bad={bad}"))
    with BackgroundServer(app):
        async_engine.ready_event.wait(60)
        assert async_engine.state == "failed" and "LoRA adapter 'bad'" in str(async_engine.error)
    with pytest.raises(ServeArgumentError, match="--lora-modules needs --enable-lora"):
        build_server(serve_args(checkpoint, "--lora-modules", f"r8={paths['r8']}"))
    with pytest.raises(ServeArgumentError, match="NAME=PATH"):
        build_server(serve_args(checkpoint, "--enable-lora", "--lora-modules", "r8"))


def test_server_loads_and_unloads_adapters_at_runtime(setup, tmp_path, monkeypatch):
    """With VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter serves a new adapter by name (outputs equal
    the merged reference), malformed adapters are 400s naming the reason and leave nothing listed, unload is a
    409 while a request uses the adapter and succeeds after; then its name is a 404 and its id is never served
    again. Without the switch the routes do not exist."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    import threading
    import time

    import httpx

    from kernel_lab.server.background import BackgroundServer
    from kernel_lab.server.launch import build_server

    checkpoint, hf, adapters, _ = setup
    r8 = adapters["r8"][0].lora_path
    args = serve_args(checkpoint, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
    app, async_engine = build_server(args)
    with BackgroundServer(app) as server:
        assert async_engine.ready_event.wait(60) and async_engine.state == "ready", async_engine.error
        rsp = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "r8", "lora_path": r8})
        assert rsp.status_code == 404, "the routes exist only behind VLLM_ALLOW_RUNTIME_LORA_UPDATING"

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    from kernel_lab.server import serving_lora

    readers = []   # the threads that read adapter files: never the engine's (a load must not stall steps)

    def reading(*a):
        readers.append(threading.current_thread().name)
        return load_peft_adapter(*a)

    monkeypatch.setattr(serving_lora, "load_peft_adapter", reading)
    (tmp_path / "corrupt").mkdir()
    shutil.copy(adapters["r8"][0].lora_path + "/adapter_config.json", tmp_path / "corrupt")
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / "adapter_config.json").write_text("{r: 8")
    shutil.copy(adapters["r8"][0].lora_path + "/adapter_model.safetensors", tmp_path / "badjson")
    write_adapter(tmp_path / "dora", hf, 8, 16, False, ("q_proj",), seed=9, use_dora=True)
    malformed = {"corrupt": "cannot be read", "badjson": "not valid JSON", "dora": "DoRA",
                 "missing": "no such directory", "r32": "rank 32 is above max_lora_rank 16"}
    app, async_engine = build_server(args)
    with BackgroundServer(app) as server:
        assert async_engine.ready_event.wait(60) and async_engine.state == "ready", async_engine.error
        url, engine = server.url, async_engine.engine

        def post(route, **body):
            return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)

        for name, reason in malformed.items():
            path = adapters[name][0].lora_path if name in adapters else str(tmp_path / name)
            rsp = post("load_lora_adapter", lora_name=name, lora_path=path)
            assert rsp.status_code == 400 and f"LoRA adapter {name!r}" in rsp.json()["error"]["message"], rsp.text
            assert reason in rsp.json()["error"]["message"], (name, rsp.text)
        assert post("load_lora_adapter", lora_name="x").status_code == 400       # no lora_path
        rsp = post("load_lora_adapter", lora_name="r8", lora_path=r8)
        assert rsp.status_code == 200, rsp.text
        assert len(readers) == len(malformed) + 1 and "kernel-lab-engine" not in readers, readers
        assert post("load_lora_adapter", lora_name="r8", lora_path=r8).status_code == 400  # already loaded
        listing = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listing] == [(listing[0]["id"], None), ("r8", listing[0]["id"])]
        (want,) = references(setup, engine, [(OTHER, "r8")])
        body = {"model": "r8", "prompt": OTHER, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        assert post("completions", **body).json()["choices"][0]["text"] == engine.tokenizer.decode(want)

        # a request holds the adapter (the engine paused, so it stays unfinished): unload is refused
        async_engine.pause()
        held = {}
        client = threading.Thread(target=lambda: held.update(rsp=post("completions", **body)))
        client.start()
        deadline = time.monotonic() + 30
        while not engine.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        rsp = post("unload_lora_adapter", lora_name="r8")
        assert rsp.status_code == 409 and rsp.json()["error"]["code"] == "lora_adapter_in_use", rsp.text
        async_engine.resume()
        client.join(60)
        assert held["rsp"].json()["choices"][0]["text"] == engine.tokenizer.decode(want)

        assert post("unload_lora_adapter", lora_name="r8", lora_int_id=99).status_code == 404
        (lora_id,) = engine.list_loras()
        assert post("unload_lora_adapter", lora_name="r8").status_code == 200
        assert engine.list_loras() == set() and engine.lora.slot_ids == [None, None]   # its slot freed
        assert post("completions", **body).status_code == 404
        assert post("unload_lora_adapter", lora_name="r8").status_code == 404
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == [listing[0]["id"]]
        # loading it again gives it a new id; the old one is refused (the prefix cache keys blocks by id)
        assert post("load_lora_adapter", lora_name="r8", lora_path=r8).status_code == 200
        assert post("completions", **body).json()["choices"][0]["text"] == engine.tokenizer.decode(want)
        assert engine.list_loras() == {lora_id + 1}
    with pytest.raises(LoRAAdapterError, match="was removed"):
        engine.lora.register(LoRARequest("r8", lora_id, r8))
    app, async_engine = build_server(serve_args(checkpoint))   # the switch on, LoRA off
    with BackgroundServer(app) as server:
        assert async_engine.ready_event.wait(60) and async_engine.state == "ready", async_engine.error
        rsp = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "r8", "lora_path": r8})
        assert rsp.status_code == 400 and "--enable-lora" in rsp.json()["error"]["message"], rsp.text
