"""The server's errors in OpenAI's shape, whoever raises them: the routes (`ApiError`), request
validation, the framework itself (unknown routes, wrong methods, unreadable bodies), and the
body-size limit that answers before a body is read."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kestrel.server.protocol import ApiError, bad_request, validation_problems


class BodySizeLimit:
    """413 for a body whose declared length is over the limit, before it is read. Plain ASGI:
    Starlette's `BaseHTTPMiddleware` would hide client disconnects from the routes."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"").decode()
            if length.isdigit() and int(length) > self.limit:
                message = f"the request body is {length} bytes; the limit is {self.limit}"
                error = ApiError(413, message, "RequestTooLargeError")
                await JSONResponse(error.body(), status_code=413)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# Anthropic's error types by status, for the Messages API's routes.
ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """The error in the shape its route's clients read: Anthropic's under /v1/messages, else OpenAI's."""
    body = error.body()
    if "/v1/messages" in request.url.path:
        kind = ANTHROPIC_ERRORS.get(error.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": error.message}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # Unknown routes, wrong methods, unreadable bodies: the framework's errors, in the API's shape.
        kinds = {404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLargeError"}
        kind = kinds.get(error.status_code, "BadRequestError")
        headers = getattr(error, "headers", None)
        return error_response(request, ApiError(error.status_code, str(error.detail), kind, headers=headers))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        location = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = validation_problems(error.errors())
        return error_response(request, bad_request(message or "invalid request", location))
