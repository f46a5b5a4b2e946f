"""Wall-clock accounting of `LLMEngine.step()` by part, for the CPU decode profile (cpu_step_profile.py).

    with StepProfile(engine) as prof:
        engine.step()
    prof.steps[-1]   # {"projections": ms, "attention": ms, ..., "step": ms}

Inside the block the engine's real callables (the scheduler's, the runner's, every projection, norm,
activation and attention call of the model, the sampler and the output processor) are wrapped with timers;
outside it nothing is wrapped, so the hook costs nothing when off and no engine file carries timing code.
Time is exclusive: a part's time excludes the timed calls inside it, so the parts of a step sum to the
step exactly, and what no named call covers lands in the glue parts (engine step, runner, model forward,
decoder layer: Python, ctypes and torch overhead between the named calls, the timers' own cost included).
The C calls (ctypes functions of the built libraries) are timed too, as "<calling part> (C)", so each
part splits into its native work and the Python and ctypes around it. The thread pool's wake-ups and
barrier happen inside `kl_gguf_linear` and count as "projections (C)" (or "lm_head (C)").
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

from kernel_lab import ops
from kernel_lab.models import decode_stack, llama
from kernel_lab.ops import cpu_kernels

from . import model_runner

PARTS = ("scheduling", "step inputs (python)", "embedding", "rope table", "projections", "lm_head",
         "attention (+rope+kv write)", "norms", "activation", "kernel_threads enter/exit", "sampling",
         "output processing", "decoder layer glue", "model forward glue", "runner glue", "engine step glue")
# The C calls inside the parts above, timed apart: "projections (C)" is kl_gguf_linear's own time inside the
# projections (quantizing x, the tiles, the pool's hand-off and barrier), "projections" then the Python and
# ctypes around it. A C call counts toward the part that made it.
NATIVE = {"gguf_linear": ("kl_gguf_linear", "kl_gguf_dequantize_rows"),
          "norm_activation": ("kl_add_rms_norm_f32", "kl_silu_and_mul_f32", "kl_gelu_and_mul_f32"),
          "paged_decode_attention": ("kl_rope_write_paged_attention", "kl_paged_decode_attention"),
          "decode_stack": ("kl_decode_stack",)}
NATIVE_PARTS = ("embedding", "projections", "lm_head", "attention (+rope+kv write)", "norms", "activation")
# With models/decode_stack.py on, a decode step's layers are one C call: their norms, projections,
# attention and activation then show as "decoder layers (C)" only (KERNEL_LAB_DECODE_STACK=0 splits them).
PARTS = PARTS + tuple(f"{p} (C)" for p in NATIVE_PARTS) + ("decoder layers", "decoder layers (C)")


class StepProfile:
    """A context manager wrapping the engine's calls with exclusive wall-clock timers (see the module doc).
    `steps` holds one dict of ms per part (and "step", their sum) for each `engine.step()` in the block."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[dict[str, float]] = []
        self._undo: list = []
        self._stack: list[list[float]] = []   # per open timed call: [time spent in timed calls inside it]
        self._current: dict[str, float] | None = None

    def _timed(self, part: str | None, fn):
        """`fn` timed as `part`; part None: a C call, counted as "<the calling part> (C)"."""
        clock, stack = time.perf_counter, self._stack

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = part if part is not None else f"{stack[-1][1] if stack else 'other'} (C)"
            children = [0.0, name]
            stack.append(children)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                stack.pop()
                if stack:
                    stack[-1][0] += elapsed
                current = self._current
                if current is not None:
                    current[name] = current.get(name, 0.0) + (elapsed - children[0]) * 1e3
        return wrapper

    def _patch(self, owner, name: str, part: str) -> None:
        current = getattr(owner, name)
        own = name in vars(owner)     # a module's function; else an instance's method, shadowed until exit
        setattr(owner, name, self._timed(part, current))
        self._undo.append((lambda: setattr(owner, name, current)) if own else (lambda: vars(owner).pop(name)))

    def _patch_context(self, module, name: str, part: str) -> None:
        """A context-manager factory whose entry and exit are timed (the step's thread settings)."""
        factory = getattr(module, name)
        timed = self._timed

        @contextmanager
        def wrapped(*args, **kwargs):
            cm = factory(*args, **kwargs)
            timed(part, cm.__enter__)()
            try:
                yield
            finally:
                timed(part, cm.__exit__)(None, None, None)
        setattr(module, name, wrapped)
        self._undo.append(lambda: setattr(module, name, factory))

    def __enter__(self) -> StepProfile:
        engine = self.engine
        runner, model = engine.runner, engine.runner.model
        for lib_name, functions in NATIVE.items():
            lib = cpu_kernels.load_library(lib_name)
            if lib is not None:
                for name in functions:
                    original = getattr(lib, name)   # a ctypes function; the CDLL keeps it as an attribute
                    setattr(lib, name, self._timed(None, original))
                    self._undo.append(lambda lib=lib, name=name, original=original: setattr(lib, name, original))
        for name in ("schedule", "update_computed"):
            self._patch(engine.scheduler, name, "scheduling")
        self._patch(engine, "_admit_compiled", "scheduling")
        self._patch(engine.block_manager, "drain_fresh_blocks", "scheduling")
        for name in ("_prepare", "_query_tables", "_check_step_inputs", "_to_device", "reset_fresh_blocks"):
            self._patch(runner, name, "step inputs (python)")
        for name in ("execute", "run_model", "_run_eager", "_run_static_decode"):
            self._patch(runner, name, "runner glue")
        self._patch(runner.sampler, "sample_each", "sampling")
        self._patch(engine.output_processor, "process", "output processing")
        self._patch_context(model_runner, "kernel_threads", "kernel_threads enter/exit")
        self._patch(model, "forward", "model forward glue")
        self._patch(decode_stack, "run", "decoder layers")
        self._patch(model.embed, "forward", "embedding")
        self._patch(model.rotary, "forward", "rope table")
        self._patch(model.lm_head, "forward", "lm_head")
        for layer in model.layers:
            self._patch(layer, "forward", "decoder layer glue")
            self._patch(layer.mlp, "forward", "decoder layer glue")
            for proj in (layer.qkv_proj, layer.o_proj, *layer.mlp.projections()):
                self._patch(proj, "forward", "projections")
        for name in ("rope_write_paged_attention", "paged_attention", "apply_rope"):
            self._patch(llama, name, "attention (+rope+kv write)")
        for name in ("add_rms_norm_decode",):
            self._patch(cpu_kernels, name, "norms")
        for name in ("fused_add_rms_norm", "rms_norm"):
            self._patch(ops, name, "norms")
        self._patch(cpu_kernels, "silu_and_mul_decode", "activation")
        for name in ("silu_and_mul", "gelu_and_mul"):
            self._patch(ops, name, "activation")
        step = engine.step

        @functools.wraps(step)
        def profiled_step(*args, **kwargs):
            self._current = {}
            try:
                return self._timed("engine step glue", step)(*args, **kwargs)
            finally:
                parts, self._current = self._current, None
                parts["step"] = sum(parts.values())
                self.steps.append(parts)
        engine.step = profiled_step
        self._undo.append(lambda: engine.__dict__.pop("step", None))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()
