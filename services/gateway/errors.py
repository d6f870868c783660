"""Errors of the HTTP API: raised once as :class:`APIError`, rendered in one place in OpenAI's shape."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.schemas import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error the client sees: HTTP status, message, OpenAI error code and offending parameter."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(
                message=self.message,
                type=_TYPES.get(self.status, "server_error"),
                param=self.param,
                code=self.code,
            )
        )

    def sse(self) -> str:
        """The error as one Server-Sent Event (for failures after a stream has started)."""
        return f"data: {json.dumps(self.body().model_dump())}\n\n"


class ClientGone(Exception):
    """The client hung up before its response began (the request has been aborted); the
    answer, 499 with no body, reaches nobody and only shows in logs and ``http_*`` metrics."""


CLIENT_CLOSED_REQUEST = 499


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, code, param)


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, ours and the framework's, as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body().model_dump(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone) -> Response:
        job = getattr(request.state, "job", None)
        log.info(
            "%s %s %s: %d, the client hung up before its response began; aborted",
            request.method,
            request.url.path,
            job.id if job is not None else "-",
            CLIENT_CLOSED_REQUEST,
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, param = "request body is not valid JSON", None
        err = bad_request(f"{param}: {msg}" if param else msg, param)
        return JSONResponse(err.body().model_dump(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), code=None)
        return JSONResponse(err.body().model_dump(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = APIError(500, f"internal error: {type(e).__name__}", code="internal_error")
        return JSONResponse(err.body().model_dump(), status_code=500)
