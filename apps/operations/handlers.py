"""Registry of Action handlers by kind; execution issues register theirs with :func:`register`.

A handler takes the running ``Action`` and performs it; it raises :class:`ActionError` to fail
the Action with a message (any other exception also fails it and is re-raised to Celery).
"""

from __future__ import annotations

from collections.abc import Callable

from apps.operations.models import Action

Handler = Callable[[Action], None]
HANDLERS: dict[str, Handler] = {}


class ActionError(Exception):
    """The action could not be carried out; the message is stored as the Action's error.

    ``retryable`` is recorded on the Action: whether retrying it as is may succeed later.
    """

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def register(kind: str) -> Callable[[Handler], Handler]:
    """Decorator registering ``fn`` as the handler of ``kind``.

    Raises:
        ValueError: a handler for ``kind`` is already registered.
    """

    def decorator(fn: Handler) -> Handler:
        if kind in HANDLERS and HANDLERS[kind] is not fn:
            raise ValueError(f"a handler for action kind {kind!r} is already registered: {HANDLERS[kind]!r}")
        HANDLERS[kind] = fn
        return fn

    return decorator
