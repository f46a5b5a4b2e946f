"""Request state. A request with n completions is n Sequences that share the prompt.

A sequence's tokens are prompt + generated. `num_computed_tokens` counts the tokens whose K/V are in the
cache; every scheduled step computes some of the rest (a prefill chunk, or the one newest token when
decoding) and, once all are computed, samples one more token.
"""

from __future__ import annotations

import itertools
from enum import Enum

from .sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    def __init__(self, request: Request, index: int, prompt_token_ids: list[int], arrival: int):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.arrival = arrival                  # FCFS order; preempted sequences keep theirs
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []       # chain hashes of the full blocks of token_ids, filled lazily
        self.num_committed_blocks = 0           # leading blocks registered in the prefix cache
        self.num_cached_tokens = 0              # prefix-cache hit at the latest admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output = None                      # the OutputProcessor's text and logprob state
        self.matcher = None                     # the grammar's SequenceMatcher, when structured
        self.draft_token_ids: list[int] = []    # this step's speculative drafts (speculative.py)
        self.draft_masks: list = []             # the grammar's mask ahead of each draft row, when structured
        self.draft_logits = None                # [drafts, V] the draft model's q logits, under `rejection`

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: int):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.controls = None                    # SamplingControls: the logits processors' inputs, if any
        self.grammar = None                     # GrammarRequest, when the output is structured
        self.lora_request = None                # LoRARequest (lora.py), when it runs under an adapter
        self.error: Exception | None = None     # why the engine refused it after add_request (a bad grammar)
        # SamplingParams.prompt_logprobs: per prompt position, {token id: Logprob} (None for the first)
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * len(prompt_token_ids)
        self.seqs = [Sequence(self, i, prompt_token_ids, arrival) for i in range(params.n)]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
