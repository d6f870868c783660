"""The reference of ``omnirelay bench token-cost``: the floor any server pays per streamed token.

A bare Starlette app on uvicorn — the HTTP implementation the gateway runs (httptools, as vLLM's
server runs too; uvicorn's default event loop; no access log) — that answers ``POST /v1/chat/completions`` with a stream of
chat-completion-shaped chunks: the role chunk, ``max_tokens`` content chunks of one token each, the
finish chunk, the usage chunk when ``stream_options.include_usage`` asks for it, and ``[DONE]``;
one write per chunk. No NATS, no workers, no model, no validation beyond reading the JSON body: what
is left is parsing the request, rendering each chunk as JSON and writing it to the socket, which
every OpenAI-compatible streaming server does for every token.

Run as ``python -m benchmarks.sse_reference --port P`` (``GET /health`` answers 200 once it serves).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator

TOKEN_TEXT = " tok"
"""The text of every content chunk (one token each)."""


def _chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None) -> str:
    """One ``data:`` event of a ``chat.completion.chunk`` (the keys the gateway writes; ``json.dumps``)."""
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def stream_chunks(rid: str, model: str, max_tokens: int, usage: bool) -> AsyncIterator[str]:
    """The SSE body of one streamed chat completion of ``max_tokens`` tokens (one chunk each)."""
    created = int(time.time())
    yield _chunk(rid, model, created, {"role": "assistant", "content": ""})
    for _ in range(max_tokens):
        yield _chunk(rid, model, created, {"content": TOKEN_TEXT})
    yield _chunk(rid, model, created, {}, "length")
    if usage:
        tail = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": max_tokens, "total_tokens": max_tokens + 1},
        }
        yield f"data: {json.dumps(tail, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


def create_app():
    """The Starlette app: ``POST /v1/chat/completions`` (streamed) and ``GET /health``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    counter = iter(range(1 << 62))

    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunks = stream_chunks(f"chatcmpl-{next(counter)}", body["model"], int(body["max_tokens"]), usage)
        return StreamingResponse(chunks, media_type="text/event-stream")

    async def health(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(
        create_app(), host="127.0.0.1", port=args.port, http="httptools", access_log=False, log_level="info"
    )


if __name__ == "__main__":
    main()
