"""Errors for one request. Adapters turn them into a per-request error response."""


class RequestError(ValueError):
    """Something in one request is wrong; the message says what, in the client's terms (INVALID_ARG)."""


class RequestCancelled(Exception):
    """The client gave up on the request (deadline, closed connection, explicit cancel): stop its work."""
