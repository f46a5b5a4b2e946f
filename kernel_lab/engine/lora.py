"""Multi-LoRA in the engine (issue 34, items 2-3): PEFT adapters, a fixed number of device slots, and the
per-row LoRA delta in every projection through `kernel_lab.ops.lora.add_lora`.

    LLM(enable_lora=True, max_loras=N, max_lora_rank=R).generate(prompts, params,
                                                                 lora_request=LoRARequest(name, id, path))

- `load_peft_adapter` reads PEFT's `adapter_config.json` and `adapter_model.safetensors` and maps the
  q/k/v/o/gate/up/down (or Phi-3's stacked qkv_proj/gate_up_proj) pairs into the stacked layout the kernels
  take: per decoder layer, q|k|v and gate|up are one projection with one A per slice and B's rows side by
  side; a slice the adapter leaves out stays zero. Anything it cannot apply exactly is refused with a
  `LoRAAdapterError` naming the adapter and the reason.
- `LoRAManager` owns `max_loras` slots: per layer and projection one A [max_loras, S, R, K] and one
  B [max_loras, N, R] tensor in the model's dtype (on CPU a view of [max_loras, R, N] storage, the C
  kernel's layout), adapters zero-padded to R = max_lora_rank. An adapter is
  copied into a slot when the scheduler admits a sequence that needs it (load on demand); a slot whose
  adapter no running sequence uses may be taken over, least recently used first. A sequence whose adapter
  finds every slot in use waits (FCFS: the sequences behind it wait too).
- `LoRALinear` wraps a projection: base output, then `add_lora` with the step's row-to-slot map (-1 = base
  model, BGMV per row for decode rows and prefill chunks alike). The ModelRunner sets the map once per step
  (`set_rows`), or fills a static buffer that CUDA graphs read (`fill_static_rows`).
- The prefix cache keys blocks by adapter: `prefix_root` is the parent hash of a sequence's first block.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kernel_lab.models.config import ModelConfig
from kernel_lab.ops.lora import add_lora


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: `lora_int_id` (>= 1) identifies the adapter
    for the slots and the prefix cache; one id always names one adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path must name the adapter's directory, got {self.lora_path!r}")


class LoRAAdapterError(ValueError):
    """An adapter the engine cannot apply; the message names the adapter and the reason."""


class LoRAAdapterInUse(RuntimeError):
    """remove_lora of an adapter unfinished requests still use (not a request's fault: the server's 409)."""


# ------------------------------------------------------------------------------------------------ model layout
@dataclass(frozen=True)
class Projection:
    """One stacked projection of a decoder layer: its attribute path, input width and slice widths."""

    name: str
    path: tuple[str, ...]
    in_features: int
    slices: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for width in self.slices:
            out.append(out[-1] + width)
        return tuple(out)


def model_projections(config: ModelConfig) -> dict[str, Projection]:
    """The projections a LoRA can target in every decoder layer (an MoE's experts have none)."""
    h, q, kv, inter = (config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
                       config.intermediate_size)
    out = {"qkv_proj": Projection("qkv_proj", ("qkv_proj",), h, (q, kv, kv)),
           "o_proj": Projection("o_proj", ("o_proj",), q, (h,))}
    if not config.num_experts:
        out["gate_up_proj"] = Projection("gate_up_proj", ("mlp", "gate_up_proj"), h, (inter, inter))
        out["down_proj"] = Projection("down_proj", ("mlp", "down_proj"), inter, (h,))
    return out


def target_modules(config: ModelConfig) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """PEFT module name -> (its parent in the checkpoint, our projection, the slices it covers)."""
    if config.fused_projections:  # Phi-3's checkpoint (and so its adapters) stacks them already
        names = {"qkv_proj": ("self_attn", "qkv_proj", (0, 1, 2)), "o_proj": ("self_attn", "o_proj", (0,)),
                 "gate_up_proj": ("mlp", "gate_up_proj", (0, 1)), "down_proj": ("mlp", "down_proj", (0,))}
    else:
        names = {"q_proj": ("self_attn", "qkv_proj", (0,)), "k_proj": ("self_attn", "qkv_proj", (1,)),
                 "v_proj": ("self_attn", "qkv_proj", (2,)), "o_proj": ("self_attn", "o_proj", (0,)),
                 "gate_proj": ("mlp", "gate_up_proj", (0,)), "up_proj": ("mlp", "gate_up_proj", (1,)),
                 "down_proj": ("mlp", "down_proj", (0,))}
    projections = model_projections(config)
    return {k: v for k, v in names.items() if v[1] in projections}


# ------------------------------------------------------------------------------------------------ PEFT loading
@dataclass
class LoRAAdapter:
    """A parsed adapter on the host, float32: weights[(layer, projection)] = (A [S, r, K], B [N, r])."""

    request: LoRARequest
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_UNSUPPORTED_CONFIG = {
    "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)", "layer_replication": "layer_replication",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "fan_in_fan_out": "fan_in_fan_out weights (Conv1D layers)", "lora_bias": "LoRA biases (lora_bias)",
}


def load_peft_adapter(request: LoRARequest, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA directory against the model; every refusal names the adapter."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(request.lora_path)

    def refuse(reason: str):
        raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} ({path}): {reason}")

    if not path.is_dir():
        refuse("no such directory")
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        refuse("adapter_config.json is missing")
    if not weights_file.is_file():
        refuse("adapter_model.safetensors is missing" + (" (adapter_model.bin is not read: save with safetensors)"
                                                         if (path / "adapter_model.bin").exists() else ""))
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        refuse(f"adapter_config.json is not valid JSON ({exc})")
    if not isinstance(cfg, dict):
        refuse("adapter_config.json must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    for key, what in _UNSUPPORTED_CONFIG.items():
        if cfg.get(key):
            refuse(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias={cfg.get('bias')!r} (trained biases) is not supported")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        refuse(f"r must be an int >= 1, got {rank!r}")
    if rank > max_lora_rank:
        refuse(f"rank {rank} is above max_lora_rank {max_lora_rank}")
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        refuse(f"lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    modules = target_modules(config)
    targets = cfg.get("target_modules")
    for target in targets if isinstance(targets, list) else []:
        base = str(target).split(".")[-1]
        if base in ("embed_tokens", "lm_head", "wte"):
            refuse(f"LoRA on {base} is not supported (only the decoder layers' projections)")
        if base not in modules:
            refuse(f"target module {target!r} is not a projection this model has ({', '.join(modules)})")

    try:
        tensors = load_file(str(weights_file))
    except (OSError, SafetensorError) as exc:
        refuse(f"adapter_model.safetensors cannot be read ({exc})")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if "lora_magnitude_vector" in key:
            refuse("DoRA (lora_magnitude_vector) is not supported")
        if "embed_tokens" in key or "lm_head" in key or "lora_embedding" in key:
            refuse(f"LoRA on embeddings or lm_head ({key}) is not supported")
        match = _KEY.match(key)
        if match is None:
            refuse(f"tensor {key!r} is not a LoRA weight of a decoder-layer projection")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in modules or modules[module][0] != parent:
            refuse(f"tensor {key!r}: the model has no {parent}.{module} to adapt ({', '.join(modules)})")
        if layer >= config.num_layers:
            refuse(f"tensor {key!r}: the model has {config.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = value
    if not pairs:
        refuse("adapter_model.safetensors holds no LoRA weights")

    projections = model_projections(config)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        _, group, slices = modules[module]
        proj = projections[group]
        if set(ab) != {"A", "B"}:
            refuse(f"layers.{layer}.{module} has lora_{''.join(ab)} without its lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        out_features = sum(proj.slices[s] for s in slices)
        for which, t, want in (("A", a, (rank, proj.in_features)), ("B", b, (out_features, rank))):
            if tuple(t.shape) != want:
                refuse(f"layers.{layer}.{module}.lora_{which} has shape {tuple(t.shape)}, expected {want} (r={rank})")
        if (layer, group) not in weights:
            weights[(layer, group)] = (torch.zeros(len(proj.slices), rank, proj.in_features),
                                       torch.zeros(proj.offsets[-1], rank))
        stacked_a, stacked_b = weights[(layer, group)]
        row = 0
        for s in slices:  # a stacked module (Phi-3) shares its A across the slices its B rows cover
            stacked_a[s] = a.float()
            lo, hi = proj.offsets[s], proj.offsets[s + 1]
            stacked_b[lo:hi] = b[row:row + hi - lo].float()
            row += hi - lo
    return LoRAAdapter(request, rank, float(scale), weights)


# ------------------------------------------------------------------------------------------------ the layer
class LoRALinear(nn.Module):
    """A projection plus the LoRA delta of each row's slot (the manager's current row map)."""

    def __init__(self, base_layer: nn.Module, manager: LoRAManager, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 offsets: tuple[int, ...]):
        super().__init__()
        self.base_layer = base_layer
        self.manager = manager  # a plain attribute: the manager is not a Module
        self.lora_a, self.lora_b, self.offsets = lora_a, lora_b, offsets

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        rows = self.manager.rows
        if rows is None:
            return y
        # index values are checked once per step, where the manager builds the map
        return add_lora(y, x, self.lora_a, self.lora_b, self.manager.scale, self.offsets, row_adapters=rows,
                        validate=False)


# ------------------------------------------------------------------------------------------------ the slots
class LoRAManager:
    """The adapter slots of one model, their LRU order and which running sequences use them."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device, max_num_seqs: int):
        self.config, self.max_loras, self.max_lora_rank = config, max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.projections = model_projections(config)
        self.scale = torch.zeros(max_loras, dtype=torch.float32, device=device)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(model.layers):
            for name, proj in self.projections.items():
                a = torch.zeros(max_loras, len(proj.slices), max_lora_rank, proj.in_features, dtype=dtype,
                                device=device)
                if torch.device(device).type == "cpu":  # [L, R, N] storage: lora.c's expand reads B along N
                    b = torch.zeros(max_loras, max_lora_rank, proj.offsets[-1], dtype=dtype).transpose(1, 2)
                else:
                    b = torch.zeros(max_loras, proj.offsets[-1], max_lora_rank, dtype=dtype, device=device)
                self.stacks[(i, name)] = (a, b)
                parent = layer
                for attr in proj.path[:-1]:
                    parent = getattr(parent, attr)
                setattr(parent, proj.path[-1], LoRALinear(getattr(parent, proj.path[-1]), self, a, b, proj.offsets))
        model.lora_manager = self
        self.adapters: dict[int, LoRAAdapter] = {}        # registered (parsed) adapters, by lora_int_id
        self.retired: dict[int, str] = {}                 # removed lora_int_id -> the name it had
        self.slot_ids: list[int | None] = [None] * max_loras
        self.lru: OrderedDict[int, int] = OrderedDict()   # resident lora_int_id -> slot, least recent first
        self.pins: Counter[int] = Counter()               # slot -> running sequences using it
        self.seq_slots: dict[int, int] = {}               # seq_id -> slot
        self.num_loads = 0
        self.rows: torch.Tensor | None = None             # the step's row -> slot map (None: no row adapted)
        self.static_rows = torch.full((max_num_seqs,), -1, dtype=torch.int32, device=device)

    # ------------------------------------------------------------------------------------------- registry
    def register(self, request: LoRARequest, parsed: LoRAAdapter | None = None) -> LoRAAdapter:
        """Parse (once per lora_int_id) and check the adapter a request names; raises LoRAAdapterError.
        `parsed`: load_peft_adapter's result for it, read elsewhere (the server reads off the engine thread)."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a kernel_lab.engine.LoRARequest, got {type(request).__name__}")
        if request.lora_int_id in self.retired:
            # cached prefix blocks are keyed by lora_int_id: an id once removed never names an adapter again
            raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} "
                                   f"named adapter {self.retired[request.lora_int_id]!r}, which was removed; "
                                   f"use a new id")
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, str(known.request.lora_path)) != (request.lora_name, str(request.lora_path)):
                raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} "
                                       f"already names adapter {known.request.lora_name!r} "
                                       f"({known.request.lora_path})")
            return known
        adapter = parsed if parsed is not None else load_peft_adapter(request, self.config, self.max_lora_rank)
        if adapter.request != request:
            raise ValueError(f"the parsed adapter is {adapter.request!r}, not {request!r}")
        self.adapters[request.lora_int_id] = adapter
        return adapter

    def unregister(self, lora_int_id: int, requests) -> bool:
        """Forget an adapter and free its slot; False if it is not registered. Refused (LoRAAdapterInUse)
        while any of `requests` (the engine's unfinished ones) uses it."""
        adapter = self.adapters.get(lora_int_id)
        if adapter is None:
            return False
        users = [r.request_id for r in requests
                 if getattr(r, "lora_request", None) is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
            raise LoRAAdapterInUse(f"LoRA adapter {adapter.request.lora_name!r} is in use by {len(users)} "
                                   f"unfinished request(s) ({shown})")
        slot = self.lru.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
            self.scale[slot] = 0.0
        del self.adapters[lora_int_id]
        self.retired[lora_int_id] = adapter.request.lora_name
        return True

    # ------------------------------------------------------------------------------------------- slots
    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running sequence uses, else None."""
        for slot, lora_id in enumerate(self.slot_ids):
            if lora_id is None:
                return slot
        return next((slot for slot in self.lru.values() if not self.pins[slot]), None)

    @staticmethod
    def _lora_id(seq) -> int | None:
        request = getattr(seq.request, "lora_request", None)
        return None if request is None else request.lora_int_id

    def can_admit(self, seq) -> bool:
        lora_id = self._lora_id(seq)
        return lora_id is None or lora_id in self.lru or self._free_slot() is not None

    def acquire(self, seq) -> None:
        """Make the sequence's adapter resident (loading it into a slot if need be) and pin it."""
        lora_id = self._lora_id(seq)
        if lora_id is None or seq.seq_id in self.seq_slots:
            return
        slot = self.lru.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire() without can_admit()"
            self._load(slot, self.adapters[lora_id])
        self.lru.move_to_end(lora_id)
        self.pins[slot] += 1
        self.seq_slots[seq.seq_id] = slot

    def release(self, seq) -> None:
        slot = self.seq_slots.pop(seq.seq_id, None)
        if slot is not None:
            self.pins[slot] -= 1

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        old = self.slot_ids[slot]
        if old is not None:
            del self.lru[old]
        r = adapter.rank
        for key, (a, b) in self.stacks.items():
            a[slot].zero_()
            b[slot].zero_()
            if key in adapter.weights:
                host_a, host_b = adapter.weights[key]
                a[slot, :, :r].copy_(host_a)
                b[slot, :, :r].copy_(host_b)
        self.scale[slot] = adapter.scale
        self.slot_ids[slot] = adapter.request.lora_int_id
        self.lru[adapter.request.lora_int_id] = slot
        self.num_loads += 1

    # ------------------------------------------------------------------------------------------- steps
    def slot_of(self, seq) -> int:
        return self.seq_slots.get(seq.seq_id, -1)

    def set_rows(self, row_seqs) -> None:
        """The eager step's map; a step with no adapted row skips the LoRA ops altogether."""
        slots = [self.slot_of(seq) for seq in row_seqs]
        self.rows = (torch.tensor(slots, dtype=torch.int32).to(self.device)
                     if any(s >= 0 for s in slots) else None)

    def fill_static_rows(self, row_seqs, size: int) -> None:
        """Decode rows of a padded static batch (CUDA graphs read this buffer); padding rows are the base."""
        slots = [self.slot_of(seq) for seq in row_seqs]
        self.static_rows[:size].copy_(torch.tensor(slots + [-1] * (size - len(slots)), dtype=torch.int32))

    def use_static_rows(self, size: int) -> None:
        self.rows = self.static_rows[:size]


class LoRAEngineCalls:
    """LLMEngine's LoRA entry points, with vLLM's names (the server's /v1/load_lora_adapter and
    /v1/unload_lora_adapter call them between steps). `self.lora` is the engine's LoRAManager, or None."""

    lora: LoRAManager | None
    requests: dict

    def _register_lora(self, lora_request: LoRARequest | None, what: str = "a lora_request") -> None:
        """Read and check an adapter once per lora_int_id, before any request state holds it."""
        if lora_request is None:
            return
        if self.lora is None:
            raise ValueError(f"{what} needs an engine with enable_lora=True")
        self.lora.register(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (a request naming it later finds it registered)."""
        self._register_lora(lora_request, "adding a LoRA adapter")
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id` (False if unknown); refused while unfinished requests use it."""
        return self.lora is not None and self.lora.unregister(lora_id, self.requests.values())

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else set(self.lora.adapters)

    def lora_stats_fields(self, running_request_ids: set[str]) -> dict:
        """`stats()["lora_requests"]`: unfinished requests per adapter name, running and waiting (vLLM's
        lora_requests_info gauge reads the same), and max_loras; {} without LoRA."""
        if self.lora is None:
            return {}
        counts = {"running": {}, "waiting": {}}
        for request_id, request in self.requests.items():
            adapter = getattr(request, "lora_request", None)
            if adapter is not None:
                state = counts["running" if request_id in running_request_ids else "waiting"]
                state[adapter.lora_name] = state.get(adapter.lora_name, 0) + 1
        return {"lora_requests": {**counts, "max_lora": self.lora.max_loras}}


def prefix_root(seq) -> tuple[str, int] | None:
    """The parent of a sequence's first block hash: blocks computed under an adapter are its own."""
    request = getattr(seq.request, "lora_request", None)
    return None if request is None else ("lora", request.lora_int_id)
