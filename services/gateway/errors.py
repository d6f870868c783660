"""Errors of the HTTP API: raised once as :class:`APIError`, rendered in one place in OpenAI's shape."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway.schemas import ErrorBody, ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An error the client sees: HTTP status, message, OpenAI error code and offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers
        """Response headers of the error (``WWW-Authenticate`` of a 401, ``Retry-After`` of a 429)."""

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
    async def _api_error(_: Request, e: APIError) -> Response:
        return response_of(e)

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
    async def _validation(_: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, param = "request body is not valid JSON", None
        return response_of(bad_request(f"{param}: {msg}" if param else msg, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> Response:
        return response_of(APIError(e.status_code, str(e.detail), code=None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> Response:
        log.exception("unhandled error")  # the detail is the operator's; the client learns nothing of it
        return response_of(APIError(500, "internal error", code="internal_error"))


def response_of(e: APIError) -> Response:
    """``e`` as its HTTP response. The JSON is ASCII (non-ASCII characters escaped), so a message
    that quotes the client's input renders whatever that input held, a lone surrogate included
    (Starlette's ``JSONResponse`` encodes UTF-8 and fails on one: a 500)."""
    body = json.dumps(e.body().model_dump()).encode()
    return Response(body, status_code=e.status, headers=e.headers, media_type="application/json")
