"""The one error type for a bad request. Adapters turn it into a per-request INVALID_ARG response."""


class RequestError(ValueError):
    """Something in one request is wrong; the message says what, in the client's terms."""
