"""``/v1/realtime``: OpenAI's Realtime API over one WebSocket per session, and
``POST /v1/realtime/client_secrets``, which mints the short-lived keys a browser connects with.

The upgrade is authorized before the socket is accepted: the API key in ``Authorization: Bearer``,
or in the ``openai-insecure-api-key.<key>`` subprotocol (what browsers can send), or a client
secret in either place; without one the answer is a 401 in OpenAI's shape and no socket. The
``model`` query parameter, when given, must name the served model. A key opens at most
``OMNIRELAY_MAX_REALTIME_SESSIONS_PER_KEY`` sessions at once (a 429 past it). Every client event is
read whole (at most 16 MiB, the server's frame limit); a bad one is answered with an ``error`` event
and the session goes on. A client that takes no event for ``SEND_TIMEOUT_S`` is disconnected.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import APIRouter, Depends, Request, WebSocket

from services.gateway.auth import authorize, bearer, principal_of
from services.gateway.errors import APIError, response_of
from services.gateway.limits import admit
from services.gateway.realtime.client_secrets import ClientSecretRequest, mint, principal_of_secret
from services.gateway.realtime.protocol import BadEvent, error_event, parse_client_event
from services.gateway.realtime.session import RealtimeSession

log = logging.getLogger(__name__)

SUBPROTOCOL_KEY = "openai-insecure-api-key."
SUBPROTOCOL_REALTIME = "realtime"
SEND_TIMEOUT_S = 30.0
"""A server event the client does not take within this closes its session (1008)."""

router = APIRouter()
secrets_api = APIRouter(dependencies=[Depends(authorize), Depends(admit)])


@secrets_api.post("/v1/realtime/client_secrets")
async def client_secrets(body: ClientSecretRequest, request: Request) -> dict[str, Any]:
    """A client secret for the caller's key, valid ``expires_after.seconds``."""
    keys = request.app.state.api_keys
    if keys is None:
        raise APIError(400, "this gateway takes no API keys: connect without one", "no_api_keys")
    value, expires_at = mint(keys, request.state.principal, body.expires_after.seconds)
    session = {
        "type": "realtime",
        "model": request.app.state.pipeline.served_model_name,
        **(body.session or {}),
    }
    return {"value": value, "expires_at": expires_at, "session": session}


def ws_principal(ws: WebSocket) -> str:
    """Who opens ``ws`` (see the module's docstring); an :class:`APIError` 401 otherwise."""
    keys = ws.app.state.api_keys
    presented = bearer(ws.headers) or next(
        (
            p[len(SUBPROTOCOL_KEY) :]
            for p in ws.scope.get("subprotocols", [])
            if p.startswith(SUBPROTOCOL_KEY)
        ),
        None,
    )
    if keys is not None and presented is not None and (found := principal_of_secret(keys, presented)):
        return found
    return principal_of(keys, presented, ws.client.host if ws.client else "-")


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    app = ws.app
    try:
        principal = ws_principal(ws)
        model = ws.query_params.get("model") or app.state.pipeline.served_model_name
        app.state.submitter.check_model(model)
        app.state.realtime_sessions.acquire(principal)
    except APIError as e:
        await ws.send_denial_response(response_of(e))
        return
    try:
        offered = ws.scope.get("subprotocols", [])
        await ws.accept(subprotocol=SUBPROTOCOL_REALTIME if SUBPROTOCOL_REALTIME in offered else None)
        await _serve(ws, model)
    finally:
        app.state.realtime_sessions.release(principal)


async def _serve(ws: WebSocket, model: str) -> None:
    """Run one session until the client closes the socket (or stops reading)."""
    stat_log = ws.app.state.submitter.stat_log
    outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def send(event: dict[str, Any]) -> None:
        outgoing.put_nowait(event)

    async def writer() -> None:
        while True:
            event = await outgoing.get()
            async with asyncio.timeout(SEND_TIMEOUT_S):
                await ws.send_text(json.dumps(event))

    session = RealtimeSession(send, ws.app.state.submitter, model, stat_log)
    stat_log.realtime_sessions(+1)
    writing = asyncio.create_task(writer())
    try:
        await session.start()
        while True:
            receive = asyncio.ensure_future(ws.receive())
            await asyncio.wait({receive, writing}, return_when=asyncio.FIRST_COMPLETED)
            if not receive.done():  # the writer stopped: the client takes no events
                receive.cancel()
                await ws.close(1008, "the client does not read its events")
                return
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                return
            await _handle(session, message.get("text") or message.get("bytes") or "")
    finally:
        stat_log.realtime_sessions(-1)
        await session.close()
        writing.cancel()


async def _handle(session: RealtimeSession, text: str | bytes) -> None:
    event_id = None
    try:
        event = parse_client_event(text)
        event_id = event.event_id
        await session.handle(event)
    except BadEvent as e:
        if e.event_id is None:
            e.event_id = event_id or _event_id_of(text)
        await session.send(error_event(e))
    except APIError as e:  # the pipeline refused what the event asked (a 4xx of the HTTP routes)
        bad = BadEvent(e.message, e.code or "invalid_request", e.param)
        bad.event_id = event_id
        await session.send(error_event(bad))


def _event_id_of(text: str | bytes) -> str | None:
    """The ``event_id`` of an event that did not validate, when its JSON has one."""
    try:
        found = json.loads(text).get("event_id")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None
