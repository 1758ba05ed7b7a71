"""OpenAI-style API errors: one exception type and its JSON body.

Every error the server returns has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}

with a 4xx status for requests the client must fix and 5xx for the server's own failures.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class OpenAIError(Exception):
    """An error to return to the client as OpenAI error JSON.

    Args:
        status_code: HTTP status (400 invalid request, 404 unknown model, 500 server error,
            503 draining or not ready).
        message: what was wrong and, where possible, how to fix it.
        type: OpenAI error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if any (dotted path for nested fields).
        code: a short machine-readable code (``invalid_value``, ``invalid_type``,
            ``context_length_exceeded``, ``model_not_found``, ...).
    """

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """A JSONResponse with this error's status and body."""
        headers = {"Connection": "close"} if self.status_code == 503 else None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def invalid(message: str, *, param: str | None = None, code: str = "invalid_value") -> OpenAIError:
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, param=param, code=code)
