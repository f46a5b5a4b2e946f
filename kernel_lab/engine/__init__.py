"""The assembled engine: paged KV cache, continuous batching, prefix caching, on kernel_lab.ops.

    from kernel_lab.engine import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
"""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .lora import LoRARequest
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob", "LoRARequest"]
