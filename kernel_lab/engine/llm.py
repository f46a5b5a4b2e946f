"""LLM: the offline API. `generate` and `chat` run a batch to completion through continuous batching;
`stream` yields text as it is produced."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def _is_token_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _is_conversation(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(m, dict) for m in x)


class LLM:
    """`LLM(model=None, **options)`: the options are EngineConfig's fields (`kernel-lab generate --help`
    lists them with their defaults); every keyword goes to LLMEngine."""

    def __init__(self, model=None, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (several wrappers may share one; their request ids never collide)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    def _next_id(self) -> str:
        return f"llm-{id(self):x}-{next(self._ids)}"

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without SamplingParams uses: the model's generation_config.json values
        (--generation-config auto, EngineConfig.sampling_defaults) over SamplingParams' own defaults."""
        return SamplingParams(**self.engine.config.sampling_defaults)

    def _run(self, prompts: list, params, lora_request=None) -> list[RequestOutput]:
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
            params_list = list(params)
        else:
            params_list = [params if params is not None else self.get_default_sampling_params()] * len(prompts)
        if isinstance(lora_request, (list, tuple)):  # vLLM's form: one per prompt
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras, strict=True):
                request_id = self._next_id()
                self.engine.add_request(request_id, prompt, p, lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """prompts: a str, a list of str, a list of token ids, or a list of token-id lists. Outputs keep
        the prompts' order. lora_request: a LoRARequest for every prompt, or a list with one (or None, the
        base model) per prompt (an engine with enable_lora=True)."""
        if isinstance(prompts, str) or _is_token_ids(prompts):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, lora_request)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, lora_request=None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        conversations = [messages] if _is_conversation(messages) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self._run(prompts, sampling_params, lora_request)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one completion as they are produced. `prompt` may be a conversation."""
        if _is_conversation(prompt):
            prompt = self.tokenizer.apply_chat_template(prompt)
        request_id = self._next_id()
        self.engine.add_request(request_id, prompt,
                                sampling_params if sampling_params is not None else self.get_default_sampling_params())
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.error is not None:
                        done = True
                        raise out.error
                    if out.outputs[0].new_text:
                        yield out.outputs[0].new_text
                    done = out.finished
        finally:
            if not done:
                self.engine.abort_request(request_id)
