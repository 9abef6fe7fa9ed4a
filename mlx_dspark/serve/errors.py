"""A refusal, whatever the protocol: :class:`ApiError` says what went wrong (the message, the
parameter, a code, the HTTP status); the route it happened on gives it its shape, OpenAI's
error object or Anthropic's, so a client of ``/v1/messages`` reads an Anthropic error even
when a guard in front of the routes refused it (a 413 body, a 403 origin)."""

from __future__ import annotations

from starlette.responses import JSONResponse

ANTHROPIC_ROUTES = ("/v1/messages",)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class ApiError(Exception):
    """A request the server refuses: its HTTP status, and what an error object says (``type``
    is OpenAI's kind; Anthropic's follows from the status)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = \
            message, param, code, status, type

    @classmethod
    def of_failure(cls, item) -> "ApiError":
        """An engine's error event as the error to send: a refusal (an ApiError) as it is,
        the reason a generation failed (a str) as a server error."""
        return item if isinstance(item, ApiError) else cls(item, status=500,
                                                            type="server_error")


class ContextExceeded(ApiError):
    """A prompt that leaves no room in the context: ``tokens`` (or at least that many)
    against the context ``limit``."""

    def __init__(self, message: str, param: str, tokens: int, limit: int):
        super().__init__(message, param, "context_length_exceeded")
        self.tokens, self.limit = tokens, limit


def openai_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def anthropic_body(e: ApiError) -> dict:
    """Anthropic's error object; a prompt over the context in Anthropic's own words first
    ("prompt is too long: N tokens > M maximum", N a lower bound when the prompt's characters
    alone are too many), which Claude Code reads to compact and retry."""
    kind = ANTHROPIC_TYPES.get(e.status, "invalid_request_error")
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    if isinstance(e, ContextExceeded):
        message = f"prompt is too long: {e.tokens} tokens > {e.limit - 1} maximum ({e.message})"
    return {"type": "error", "error": {"type": kind, "message": message}}


def body(e: ApiError, path: str = "") -> dict:
    """The error object of the protocol that ``path`` (the request's route) speaks."""
    return anthropic_body(e) if path.startswith(ANTHROPIC_ROUTES) else openai_body(e)


def response(e: ApiError, path: str = "", cors_origin: str | None = None) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else {}
    if cors_origin is not None:     # an allowed browser origin may read the error
        headers.update({"Access-Control-Allow-Origin": cors_origin, "Vary": "Origin"})
    return JSONResponse(body(e, path), status_code=e.status, headers=headers)
