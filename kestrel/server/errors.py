"""The server's errors in OpenAI's shape, whoever raises them: the routes (`ApiError`), request
validation, the framework itself (unknown routes, wrong methods, unreadable bodies), and the
body-size limit that answers before a body is read. Bodies are read as strict JSON
(`StrictJsonRoute`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
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


class StrictJsonRequest(Request):
    """A request whose JSON body may not hold NaN, Infinity or a number beyond a double (read
    as infinite). Python's parser takes them, JSON does not: a request field echoed back (a
    Responses request's `text`) then could not be rendered, a 500 after the work was done."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            text = (await self.body()).decode("utf-8", errors="replace")
            self._json = json.loads(
                text,
                parse_constant=lambda constant: _not_json(constant, text),
                parse_float=lambda number: _finite(number, text),
            )
        return self._json


def _not_json(constant: str, text: str) -> Any:
    raise json.JSONDecodeError(f"{constant} is not a JSON value (its numbers are finite)", text, text.find(constant))


def _finite(number: str, text: str) -> float:
    value = float(number)
    if math.isinf(value):  # 1e400: valid JSON, but no float holds it
        raise json.JSONDecodeError(f"{number} is beyond a double's range", text, text.find(number))
    return value


class StrictJsonRoute(APIRoute):
    """Every route's body through `StrictJsonRequest` (`app.router.route_class`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handle(StrictJsonRequest(request.scope, request.receive))

        return strict


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
        if first.get("type") == "json_invalid":  # its location is a character of the body
            reason = first.get("ctx", {}).get("error", "unreadable")
            at = first.get("loc", (None, None))[-1]
            return error_response(request, bad_request(f"the body is not valid JSON: {reason} (character {at})"))
        location = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = validation_problems(error.errors())
        return error_response(request, bad_request(message or "invalid request", location))
