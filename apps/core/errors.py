"""Domain errors raised by services; the API maps them to HTTP statuses, the admin to messages.

Services raise Django's ``ValidationError`` for bad input (HTTP 400) and :class:`ConflictError`
when the request is valid but the current state forbids it (HTTP 409), e.g. a pool that already
has an Action in flight, or a model version that is still in use.
"""


class ConflictError(Exception):
    """The request conflicts with the current state; the message says what to do instead."""
