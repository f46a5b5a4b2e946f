"""From sampled tokens to RequestOutputs: append each token, detokenise it incrementally, apply the stop
conditions (stop token ids, EOS, stop strings, max_tokens, max_model_len) and build the outputs.

This is the one place where a stream's deltas are computed: each output's new text, token ids and logprobs
are cut here, once, and a DELTA request's outputs hold only those, so a step costs the same at token 2,000 as
at token 2. Text that could still become a stop string is held back here, and only here (`stop_holdback`):
an output never shows characters that a later token might turn into a stop string and cut off; the
detokenizer already waits out unfinished UTF-8 characters.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from kernel_lab.models.tokenizer import IncrementalDetokenizer

from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampler import SampleResult
from .sampling_params import RequestOutputKind
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


class GrowingText:
    """A sequence's generated text. Appending costs the new characters only (`+=` on a str attribute copies
    the whole string), and the stop checks read only the tail they need."""

    __slots__ = ("_buffer", "length")

    def __init__(self):
        self._buffer = io.StringIO()
        self.length = 0

    def append(self, text: str) -> None:
        self._buffer.seek(self.length)
        self._buffer.write(text)
        self.length += len(text)

    def read(self, start: int, end: int | None = None) -> str:
        end = self.length if end is None else end
        if end <= start:
            return ""
        self._buffer.seek(start)
        return self._buffer.read(end - start)

    def truncate(self, length: int) -> None:
        self._buffer.truncate(length)
        self.length = length


class SequenceOutputState:
    """What the output processor keeps per sequence: the text, how much of it and of the tokens was already
    emitted, and the logprobs."""

    __slots__ = ("detokenizer", "text", "emitted_chars", "emitted_tokens", "logprobs", "cumulative_logprob")

    def __init__(self, detokenizer: IncrementalDetokenizer, with_logprobs: bool):
        self.detokenizer = detokenizer
        self.text = GrowingText()
        self.emitted_chars = self.emitted_tokens = 0
        self.logprobs: list[dict[int, Logprob]] | None = [] if with_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if with_logprobs else None


class OutputProcessor:
    """`finish(seq)` releases a finished sequence (the scheduler frees its blocks)."""

    def __init__(self, tokenizer, max_model_len: int, finish: Callable[[Sequence], None]):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._release = finish

    def add_request(self, request: Request) -> None:
        params = request.params
        for seq in request.seqs:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            seq.output = SequenceOutputState(detokenizer, params.logprobs is not None)

    def append_token(self, result: SampleResult) -> None:
        seq, token = result.seq, result.token_id
        params, out = seq.params, seq.output
        if params.max_tokens == 0:  # scoring only: the prompt's logprobs are the answer
            self._finish(seq, "length", None)
            return
        seq.token_ids.append(token)
        if out.logprobs is not None:
            decode = self.tokenizer.decode
            entry = {tid: Logprob(lp, rank, decode([tid], False)) for rank, (tid, lp) in
                     enumerate(result.top_logprobs or [], start=1)}
            entry.setdefault(token, Logprob(result.logprob, result.rank, decode([token], False)))
            out.logprobs.append(entry)
            out.cumulative_logprob += result.logprob

        if seq.matcher is not None and (not seq.matcher.accept_token(token) or seq.matcher.is_terminated()):
            # the grammar is complete (it accepted a stop token) and the output matches it
            self._finish(seq, "stop", None, token_text=False)
            return
        if token in params.stop_token_ids:
            self._finish(seq, "stop", token, token_text=params.include_stop_str_in_output)
            return
        if not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            self._finish(seq, "stop", None, token_text=False)
            return
        delta = out.detokenizer.add([token]) if params.detokenize else ""
        out.text.append(delta)
        if delta and params.stop_strings and self._check_stop_strings(seq, len(delta)):
            return
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length", None)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        params, text = seq.params, seq.output.text
        # A stop string can only end inside the new text.
        window_start = max(0, text.length - delta_len - max(len(s) for s in params.stop_strings) + 1)
        window = text.read(window_start)
        earliest = None
        for stop in params.stop_strings:
            at = window.find(stop, max(0, len(window) - delta_len - len(stop) + 1))
            if at >= 0 and (earliest is None or at < earliest[0]):
                earliest = (at, stop)
        if earliest is None:
            return False
        at, stop = earliest
        text.truncate(window_start + at + (len(stop) if params.include_stop_str_in_output else 0))
        self._finish(seq, "stop", stop)
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason, token_text: bool = False) -> None:
        if token_text and seq.params.detokenize:
            seq.output.text.append(seq.output.detokenizer.add([seq.token_ids[-1]]))
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._release(seq)

    def make_output(self, request: Request) -> RequestOutput | None:
        """The request's output for this step: cumulative, or only what is new (DELTA); None for a
        FINAL_ONLY request that has not finished."""
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not request.finished:
            return None
        completions = []
        for seq in request.seqs:
            out = seq.output
            visible = visible_length(seq)
            new_ids = seq.token_ids[seq.num_prompt_tokens + out.emitted_tokens:]
            new_text = out.text.read(out.emitted_chars, visible)
            if kind is RequestOutputKind.DELTA:
                text, token_ids = new_text, new_ids
                logprobs = None if out.logprobs is None else out.logprobs[out.emitted_tokens:]
            else:
                text, token_ids = out.text.read(0, visible), seq.output_token_ids
                logprobs = None if out.logprobs is None else list(out.logprobs)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids, cumulative_logprob=out.cumulative_logprob,
                logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                new_token_ids=new_ids, new_text=new_text,
            ))
            out.emitted_tokens, out.emitted_chars = seq.num_output_tokens, visible
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, num_cached_tokens=max(s.num_cached_tokens for s in request.seqs),
                             prompt_logprobs=request.prompt_logprobs if request.finished else None)


def visible_length(seq: Sequence) -> int:
    """How much of the text is safe to show: all of it once finished; while running, all but a tail that
    could still start a stop string (never less than what was already shown)."""
    out, stops = seq.output, seq.params.stop_strings
    if seq.is_finished or not stops:
        return out.text.length
    tail = out.text.read(max(0, out.text.length - max(len(s) for s in stops) + 1))
    return max(out.emitted_chars, out.text.length - stop_holdback(tail, stops))
