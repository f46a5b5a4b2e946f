"""From sampled tokens to RequestOutputs: append each token, detokenise it incrementally, apply the stop
conditions (stop token ids, EOS, stop strings, max_tokens, max_model_len) and build the outputs.

Text that could still become a stop string is held back here, and only here (`stop_holdback`): an output
never shows characters that a later token might turn into a stop string and cut off.
"""

from __future__ import annotations

from collections.abc import Callable

from kernel_lab.models.tokenizer import IncrementalDetokenizer

from .model_runner import SampleResult
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sequence import Request, Sequence


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could still be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


class OutputProcessor:
    """`finish(seq)` releases a finished sequence (the scheduler frees its blocks)."""

    def __init__(self, tokenizer, max_model_len: int, finish: Callable[[Sequence], None]):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._release = finish

    def add_request(self, request: Request) -> None:
        params = request.params
        for seq in request.seqs:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                                     params.skip_special_tokens)
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0

    def append_token(self, result: SampleResult) -> None:
        seq, token = result.seq, result.token_id
        params = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            decode = self.tokenizer.decode
            entry = {tid: Logprob(lp, rank, decode([tid], False)) for rank, (tid, lp) in
                     enumerate(result.top_logprobs or [], start=1)}
            entry.setdefault(token, Logprob(result.logprob, result.rank, decode([token], False)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += result.logprob

        if token in params.stop_token_ids:
            self._finish(seq, "stop", token, token_text=params.include_stop_str_in_output)
            return
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", None, token_text=False)
            return
        delta = seq.detokenizer.add([token]) if params.detokenize else ""
        seq.text += delta
        if delta and params.stop_strings and self._check_stop_strings(seq, len(delta)):
            return
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length", None)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        params = seq.params
        earliest = None
        for stop in params.stop_strings:
            # A stop string can only end inside the new text.
            from_index = max(0, len(seq.text) - delta_len - len(stop) + 1)
            at = seq.text.find(stop, from_index)
            if at >= 0 and (earliest is None or at < earliest[0]):
                earliest = (at, stop)
        if earliest is None:
            return False
        at, stop = earliest
        seq.text = seq.text[:at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
        self._finish(seq, "stop", stop)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason, token_text: bool = False) -> None:
        if token_text and seq.params.detokenize:
            seq.text += seq.detokenizer.add([seq.token_ids[-1]])
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq)

    def make_output(self, request: Request) -> RequestOutput:
        completions = []
        for seq in request.seqs:
            output_ids = seq.output_token_ids
            text = visible_text(seq)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=output_ids, cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                new_token_ids=output_ids[seq.emitted_token_count:], new_text=text[seq.emitted_text_len:],
            ))
            seq.emitted_token_count, seq.emitted_text_len = len(output_ids), len(text)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, num_cached_tokens=max(s.num_cached_tokens for s in request.seqs))


def visible_text(seq: Sequence) -> str:
    """The text safe to show: all of it once finished; while running, all but a tail that could still
    start a stop string (never less than what was already shown)."""
    if seq.is_finished or not seq.params.stop_strings:
        return seq.text
    return seq.text[:max(seq.emitted_text_len, len(seq.text) - stop_holdback(seq.text, seq.params.stop_strings))]
