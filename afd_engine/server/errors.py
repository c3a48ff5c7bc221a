"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

OpenAI SDKs read ``error.message`` into the exception they raise and branch on the HTTP status
(400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, ...), so every error the
server returns goes through :func:`openai_error`. Validation errors are rewritten from
pydantic's list of dicts into one readable sentence naming the offending field, always with
status 400 (the server never answers 422); FastAPI's own errors (unparsable body, unknown route,
wrong method) and unexpected exceptions get the same shape instead of ``{"detail": ...}`` or a
plain-text 500. :func:`error_responses` documents these in the OpenAPI schema.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd_engine.errors import InvalidRequestError


def _printable(text: str | None) -> str | None:
    # A message may quote the client's input, which can hold a lone surrogate ("\ud800" in JSON);
    # writing that as UTF-8 would fail, so it is spelt as its escape instead.
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """The error object; also what a stream sends as its last event when it fails midway."""
    return {"error": {"message": _printable(message), "type": type, "param": _printable(param), "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for the OpenAPI document."""

    error: ErrorDetail


_ERROR_MEANINGS = {
    400: "Invalid request: the message says why and `param` names the field",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model",
    413: "Request body larger than the server's --max-request-bytes",
    503: "The engine is not running, or the server drains before it stops (with Retry-After)",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """``responses=`` for a route: each status with OpenAI's error body."""
    return {s: {"model": ErrorResponse, "description": _ERROR_MEANINGS[s]} for s in statuses}


def without_422(schema: dict) -> dict:
    """The OpenAPI document minus FastAPI's automatic 422 responses: validation errors are 400s here."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema


def openai_error(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """A JSON error response in OpenAI's format."""
    return JSONResponse(status_code=status, content=error_body(message, type, param, code))


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields, raised anywhere in a handler.

    :func:`install_exception_handlers` turns it into the response.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return openai_error(self.status, self.message, self.type, self.param, self.code)


# --- Validation errors ------------------------------------------------------------------------


def loc_to_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``; None for the body itself.

    FastAPI prefixes body errors with "body"; it is dropped, since clients know nothing of it.
    """
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += f".{p}" if out else str(p)
    return out or None


def _describe_input(value: Any) -> str:
    """A short rendering of the offending value, for scalars only (never a large dump)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 40 else text[:37] + "..."
    return ""


def _message_for(err: dict, param: str | None) -> str:
    kind = err.get("type", "")
    if kind == "json_invalid":
        reason = str((err.get("ctx") or {}).get("error", err.get("msg", ""))).rstrip(".")
        return f"We could not parse the JSON body of your request: {reason}."
    if kind == "missing":
        return f"Missing required parameter: '{param}'." if param else "The request body is missing."
    if kind == "extra_forbidden":
        return f"Unrecognized parameter: '{param}'."
    msg = str(err.get("msg") or "invalid value").rstrip(".")
    if not param:
        # Only the body as a whole can fail without a field location (e.g. it is not an object).
        return f"Invalid request body: {msg}."
    got = _describe_input(err.get("input"))
    # Our own checks word the whole reason; pydantic's built-in messages read "Input should be ...".
    suffix = f" (got {got})" if got and msg.startswith("Input should") else ""
    return f"Invalid value for '{param}': {msg}{suffix}."


def validation_error_response(exc: ValidationError | RequestValidationError) -> JSONResponse:
    """A 400 naming the first offending field, e.g. param "max_tokens" and the message
    "Invalid value for 'max_tokens': Input should be a valid integer (got "5")."."""
    errors = exc.errors()
    if not errors:
        return openai_error(400, "Invalid request.")
    if isinstance(getattr(exc, "body", None), (bytes, bytearray)):
        # FastAPI hands over the raw bytes when the content type is not JSON.
        return openai_error(400, "The request body must be a JSON object sent with 'Content-Type: application/json'.")
    first = errors[0]
    # FastAPI locates a JSON syntax error by its character position, which is no parameter.
    param = None if first.get("type") == "json_invalid" else loc_to_param(tuple(first.get("loc", ())))
    message = _message_for(first, param)
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''} in the request.)"
    return openai_error(400, message, param=param)


# --- Engine and server errors -----------------------------------------------------------------


def invalid_request_response(exc: InvalidRequestError) -> JSONResponse:
    """400 for a request the engine refused; a too-long prompt gets OpenAI's
    ``context_length_exceeded`` code so clients can recognise it."""
    message = str(exc)
    code = "context_length_exceeded" if "context length" in message.lower() else None
    return openai_error(400, message, param=exc.param, code=code)


def model_not_found(model: str) -> JSONResponse:
    return openai_error(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")


def invalid_api_key() -> JSONResponse:
    return openai_error(401, "Incorrect API key provided.", code="invalid_api_key")


def server_error(
    message: str = "The server had an error while processing your request.", status: int = 500
) -> JSONResponse:
    """500 (or 503 while the engine is down): OpenAI clients retry these."""
    return openai_error(status, message, type="server_error")


def _body_parse_message(exc: BaseException | None) -> str:
    """Why FastAPI could not parse a body; it raises a bare 400 with the cause chained."""
    if isinstance(exc, UnicodeDecodeError):
        return "The request body is not valid UTF-8."
    if isinstance(exc, RecursionError):
        return "The JSON body is nested too deeply."
    return "We could not parse the body of your request."


def http_error_response(exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's and Starlette's own errors (body parsing, unknown route, wrong method)."""
    if exc.status_code == 400:
        message = _body_parse_message(exc.__cause__)
    elif exc.status_code == 404:
        message = "Unknown route; see /docs for the API."
    else:
        message = str(exc.detail)
    response = openai_error(exc.status_code, message)
    response.headers.update(exc.headers or {})  # e.g. a 405's Allow
    return response


def install_exception_handlers(app) -> None:
    """Register the mappings above on a FastAPI app: FastAPI's body validation errors and HTTP
    errors, InvalidRequestError, APIError, and any other exception (a 500 in OpenAI's shape).

    A bare pydantic ``ValidationError`` is deliberately not mapped: raised from server code
    (say, while building a response) it is a server bug and must stay a 500. A handler that
    validates a body itself (``Model.model_validate_json(raw)``) should catch it and return
    :func:`validation_error_response`.
    """

    async def on_request_validation(_request, exc):
        return validation_error_response(exc)

    async def on_invalid_request(_request, exc):
        return invalid_request_response(exc)

    async def on_api_error(_request, exc):
        return exc.response()

    async def on_http_error(_request, exc):
        return http_error_response(exc)

    async def on_bug(_request, exc):
        # Starlette re-raises after sending this, so the server still logs the traceback.
        return server_error()

    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(InvalidRequestError, on_invalid_request)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_bug)
