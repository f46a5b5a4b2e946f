"""The engine's refusals of a request, and what the server makes of them.

`RequestFieldError` is a ValueError that names the request field it is about in `param`, so the server's
400 body names the field from the error itself, never from its message text. Every check of a request value
raises it: SamplingParams (one validation path, `SamplingParams.verify` against the model), the logits
processors' ranges, the structured-output fields and the grammar compiler's verdict.

`is_client_error(exc)` is the line between a 4xx and a 5xx for an exception that ended one request (in
add_request or inside a step): a ValueError or TypeError is the request's fault; anything else is the
engine's, for that request alone (the engine still serves the others).
"""

from __future__ import annotations


class RequestFieldError(ValueError):
    """A request value the engine refuses; `param` is the request field (dotted for nested ones)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, (ValueError, TypeError))


def error_param(exc: BaseException) -> str | None:
    """The request field an error is about, where it names one."""
    return getattr(exc, "param", None)
