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

from .errors import RequestFieldError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampler import SampleResult
from .sampling_params import RequestOutputKind
from .sequence import Request, Sequence


def _borders(stop: str) -> list[int]:
    """Knuth-Morris-Pratt's table: borders[i] is the length of the longest proper prefix of stop[:i + 1]
    that is also its suffix."""
    borders, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = borders[k - 1]
        if stop[i] == stop[k]:
            k += 1
        borders[i] = k
    return borders


class StopPrefixes:
    """How much of a sequence's text could still become a stop string: per stop string, the longest of its
    proper prefixes that the text ends with, advanced as characters arrive (Knuth-Morris-Pratt). A step
    costs its new characters times the number of stop strings, whatever their lengths; trying every prefix
    of every stop string against the text's tail, as before, cost the square of their length every step.
    A complete stop string falls back to its longest border: whether it stops the sequence is
    `_check_stop_strings`'s call (not before min_tokens), and a match that did not stop is never held."""

    __slots__ = ("_stops", "_matched")

    def __init__(self, stops: list[tuple[str, list[int]]]):
        self._stops = stops                    # (stop string, its borders), shared by a request's sequences
        self._matched = [0] * len(stops)

    @classmethod
    def for_stops(cls, stops: list[str]) -> StopPrefixes:
        return cls([(stop, _borders(stop)) for stop in stops])

    def feed(self, text: str) -> None:
        for i, (stop, borders) in enumerate(self._stops):
            k = self._matched[i]
            for char in text:
                while k and stop[k] != char:
                    k = borders[k - 1]
                if stop[k] == char:
                    k += 1
                    if k == len(stop):
                        k = borders[k - 1]
            self._matched[i] = k

    def holdback(self) -> int:
        return max(self._matched, default=0)


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could still be the start of a stop string."""
    prefixes = StopPrefixes.for_stops(stops)
    prefixes.feed(text)
    return prefixes.holdback()


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

    __slots__ = ("detokenizer", "text", "stop_prefixes", "emitted_chars", "emitted_tokens", "logprobs",
                 "cumulative_logprob")

    def __init__(self, detokenizer: IncrementalDetokenizer, with_logprobs: bool,
                 stop_prefixes: StopPrefixes | None = None):
        self.detokenizer = detokenizer
        self.text = GrowingText()
        self.stop_prefixes = stop_prefixes
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
        stops = [(stop, _borders(stop)) for stop in params.stop_strings]
        for seq in request.seqs:
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
            seq.output = SequenceOutputState(detokenizer, params.logprobs is not None,
                                             StopPrefixes(stops) if stops else None)

    def process(self, results: list[SampleResult], failures=()) -> list[RequestOutput]:
        """The one loop over a step's sampled tokens: each appended (stop checks, detokenizing, logprobs),
        then one output per request that got a token. A request whose own values make any of that raise,
        or whose row failed in the sampler (`failures`: (sequence, exception)), ends alone (`fail`), and
        the others go on as if it had not been there. Each request's work is wrapped on its own, which
        costs nothing until something raises and is what lets the error name its request."""
        touched: dict[str, Request] = {}
        errors: dict[str, Exception] = {}
        for seq, exc in failures:
            touched[seq.request.request_id] = seq.request
            errors.setdefault(seq.request.request_id, exc)
        for result in results:
            request = result.seq.request
            touched[request.request_id] = request
            if request.request_id in errors or result.seq.is_finished:
                continue
            try:
                self.append_token(result)
            except Exception as exc:  # noqa: BLE001 - this request's fault, reported in its output
                errors[request.request_id] = exc
        outputs = []
        for request_id, request in touched.items():
            if request_id not in errors:
                try:
                    out = self.make_output(request)
                except Exception as exc:  # noqa: BLE001
                    errors[request_id] = exc
                else:
                    if out is not None:
                        outputs.append(out)
                    continue
            outputs.append(self.fail(request, errors[request_id]))
        return outputs

    def fail(self, request: Request, error: Exception) -> RequestOutput:
        """End a request with `error`: every unfinished sequence is released (its blocks and slot) and the
        final output carries the error instead of completions."""
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._release(seq)
        request.error = error
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], True, error=error)

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

        if seq.matcher is not None:
            if not seq.matcher.accept_token(token):
                # The bitmask leaves only grammar tokens, so a rejected one means the request's own token
                # rules (allowed_token_ids, bad_words) masked every token the grammar allows: a finish here
                # would pass off a non-matching output as complete.
                param = params.structured_outputs.param
                raise RequestFieldError(param, f"no token can continue the output under {param}: the request's "
                                        "other token constraints (allowed_token_ids, bad_words) exclude every "
                                        "token the grammar allows here")
            if seq.matcher.is_terminated():  # the grammar is complete (it accepted a stop token)
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
        if delta and out.stop_prefixes is not None:
            out.stop_prefixes.feed(delta)
            # vLLM's rule: stop strings count only once min_tokens tokens were generated, and the text of
            # the tokens before is never searched again (a stop string may still start in it)
            if seq.num_output_tokens > params.min_tokens and self._check_stop_strings(seq, len(delta)):
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
    out = seq.output
    if seq.is_finished or out.stop_prefixes is None:
        return out.text.length
    return max(out.emitted_chars, out.text.length - out.stop_prefixes.holdback())
