"""Errors for one request. Adapters turn them into a per-request error response."""


class RequestError(ValueError):
    """Something in one request is wrong; the message says what, in the client's terms (INVALID_ARG).
    `reason` names the kind of mistake for the rejection metric (kimi_vision_rejections_total)."""

    def __init__(self, message: str, reason: str = "invalid_input"):
        super().__init__(message)
        self.reason = reason


class RequestCancelled(Exception):
    """The client gave up on the request (deadline, closed connection, explicit cancel): stop its work."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message, or its type's name where it has none (a start failure
    carries the server's log below its first line)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
