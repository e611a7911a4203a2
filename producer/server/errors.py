"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from sluice.contract.logs import escape_control

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    403: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}
REDIS_DOWN = "The queue store (Redis) is unreachable; retry in a few seconds."
log = logging.getLogger("sluice.server")


class APIError(Exception):
    """An error answered with OpenAI's error body and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON response with OpenAI's error object."""
    body = {
        "message": message,
        "type": TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    """404 for an id that does not exist or belongs to another project (the two look the same)."""
    return APIError(404, f"No {kind} found with id '{object_id}'.", param=param, code="not_found")


def install(app: FastAPI) -> None:
    """Answer API errors, request validation errors and unknown routes with OpenAI's error body."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'request'}: {first.get('msg')}", param, "invalid_request")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unavailable: %s", type(exc).__name__)
        return error_response(503, REDIS_DOWN, code="service_unavailable", headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s on %s", type(exc).__name__, escape_control(request.url.path), exc_info=exc)
        return error_response(500, "The server had an error while processing your request.",
                              code="server_error")
