"""Checks against the running compose stack, from the host: through the published ports only (the
gateway with the official ``openai`` client, Prometheus's HTTP API, NATS's client port)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import signal
import time
import uuid
from dataclasses import dataclass

import httpx
import nats
from nats.js.errors import KeyNotFoundError, NotFoundError
from openai import AsyncOpenAI

from cli.compose_check.engine import log, sh
from cli.compose_check.project import ComposeProject
from libs.common.bus import evictions_kv, requests_kv
from libs.common.nats_credentials import NatsAuth
from libs.models.tiny import models_dir

IMAGE_MODELS = "/opt/omnirelay/cache/models"
IMAGE_USER = "10001:10001"

CONCURRENT_STREAMS = 16
TOKENS = 32
DISCOVERY_S = 90.0
"""How long Prometheus may take to list and scrape every service (SD refresh and scrape: 5 s each)."""
MARKER_KEY = "compose-check-marker"
"""The check's own key in ``omni_evictions`` (the orchestrator identity it connects as may write
there; no eviction key looks like it)."""


class CheckFailed(AssertionError):
    """A check saw the stack do something other than what it must."""


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


@dataclass(frozen=True)
class Gateway:
    """The stack's OpenAI API: its URL on the host and the key it requires (the one the gateway
    generated into its volume at first start, read with ``docker compose exec``)."""

    url: str
    api_key: str


def _client(gateway: Gateway) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.api_key, max_retries=0, timeout=300)


async def _text(client: AsyncOpenAI, model: str, stream: bool) -> int:
    """One text request; returns its completion tokens (checked against ``TOKENS``)."""
    kw = {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": TOKENS}
    extra = {"ignore_eos": True}
    if not stream:
        r = await client.chat.completions.create(**kw, extra_body=extra)
        expect(r.choices[0].message.content is not None, "text: no content")
        return r.usage.completion_tokens
    s = await client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    tokens, reason = 0, None
    async for chunk in s:
        reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    expect(reason == "length", f"text stream: finish_reason {reason}")
    return tokens


async def _audio(client: AsyncOpenAI, model: str, stream: bool) -> int:
    """One text + audio request; returns the audio bytes it got (WAV, or PCM16 streamed)."""
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": "Read me a story."}],
        "max_tokens": TOKENS,
        "modalities": ["text", "audio"],
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        r = await client.chat.completions.create(**kw, audio={"voice": "alloy", "format": "wav"})
        data = base64.b64decode(r.choices[0].message.audio.data)
        expect(data[:4] == b"RIFF", "audio: not a WAV file")
        return len(data)
    s = await client.chat.completions.create(**kw, audio={"voice": "alloy", "format": "pcm16"}, stream=True)
    pcm = bytearray()
    async for chunk in s:
        for c in chunk.choices:
            if c.delta.audio and c.delta.audio.data:
                pcm += base64.b64decode(c.delta.audio.data)
    return len(pcm)


async def _streams(gateway: Gateway, model: str, n: int) -> list[int]:
    """``n`` text streams at once; their completion tokens."""
    client = _client(gateway)
    try:
        return await asyncio.gather(*(_text(client, model, True) for _ in range(n)))
    finally:
        await client.close()


async def traffic(gateway: Gateway, model: str) -> str:
    """Text and audio, streamed and not, then ``CONCURRENT_STREAMS`` text streams at once."""
    client = _client(gateway)
    try:
        for stream in (False, True):
            tokens = await _text(client, model, stream)
            expect(tokens == TOKENS, f"text (stream={stream}): {tokens} tokens, not {TOKENS}")
            audio = await _audio(client, model, stream)
            expect(audio > 0, f"audio (stream={stream}): no audio")
        t = time.monotonic()
        counts = await _streams(gateway, model, CONCURRENT_STREAMS)
        expect(counts == [TOKENS] * CONCURRENT_STREAMS, f"concurrent streams: tokens {counts}")
        return f"text and audio, streamed and not; {CONCURRENT_STREAMS} concurrent streams in {time.monotonic() - t:.1f} s"
    finally:
        await client.close()


def baked_in(image: str) -> str:
    """The image runs as its unprivileged user, and its tiny models are byte for byte the ones
    ``omnirelay models make-tiny`` generates on this host (``make models``): generated from code,
    deterministically, not downloaded."""
    user = sh("docker", "image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    expect(user == IMAGE_USER, f"image user {user!r}, not {IMAGE_USER}")
    script = f"cd {IMAGE_MODELS} && find . -type f | sort | xargs sha256sum"
    listing = sh("docker", "run", "--rm", "--entrypoint", "sh", image, "-c", script).stdout
    theirs = {  # the files of each model's directory (not the cache's lock file)
        path: digest
        for digest, path in (line.split() for line in listing.splitlines())
        if path.count("/") >= 2
    }
    models = {path.split("/")[1] for path in theirs}
    host = models_dir()
    ours = {
        f"./{p.relative_to(host)}": hashlib.sha256(p.read_bytes()).hexdigest()
        for model in sorted(models)
        for p in sorted((host / model).rglob("*"))
        if p.is_file()
    }
    expect(
        bool(theirs) and bool(ours),
        f"no tiny models in the image, or on this host under {host} (make models)",
    )
    expect(
        theirs == ours,
        f"the image's tiny models differ from this host's: {sorted(set(theirs.items()) ^ set(ours.items()))[:4]}",
    )
    return f"runs as {user}; {len(theirs)} model files, byte-identical to this host's generation"


def admin_get(stack: ComposeProject, path: str) -> str:
    """The body of ``GET <path>`` on the gateway's admin port (``/metrics``, ``/prometheus/targets``),
    asked from inside the gateway's container: compose publishes that port on no host port."""
    port = stack.run("exec", "-T", "gateway", "printenv", "OMNIRELAY_ADMIN_PORT").stdout.strip()
    code = (
        "import sys, urllib.request; "
        f"sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=10).read().decode())"
    )
    return stack.run("exec", "-T", "gateway", "python", "-c", code).stdout


def discovery(
    prometheus_url: str, gateway_url: str, workers: set[tuple[str, str]], stack: ComposeProject
) -> str:
    """The gateway's public port serves neither ``/metrics`` nor ``/prometheus/targets`` (404);
    Prometheus found every service the gateway lists on its admin port, scrapes it, and has worker
    series with ``stage`` and ``replica`` for every (stage, replica) in ``workers``."""
    for path in ("/metrics", "/prometheus/targets"):
        status = httpx.get(f"{gateway_url}{path}").status_code
        expect(status == 404, f"the gateway's public port answers {path} with HTTP {status}, not 404")
    listed = {
        g["labels"]["__meta_omnirelay_instance"] for g in json.loads(admin_get(stack, "/prometheus/targets"))
    }
    deadline = time.monotonic() + DISCOVERY_S
    while True:
        active = httpx.get(f"{prometheus_url}/api/v1/targets", params={"state": "active"}).json()["data"]
        up = {
            t["labels"].get("instance")
            for t in active["activeTargets"]
            if t["labels"].get("job") == "omnirelay" and t["health"] == "up"
        }
        q = 'count by (stage, replica) ({job="omnirelay", service="worker", stage!="", replica!=""})'
        result = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": q}).json()["data"]["result"]
        labelled = {(r["metric"]["stage"], r["metric"]["replica"]) for r in result}
        if listed <= up and workers <= labelled:
            return (
                f"{len(listed)} services discovered (admin port) and up; worker series for "
                f"{sorted(labelled)}; public port: 404 for /metrics and /prometheus/targets"
            )
        if time.monotonic() > deadline:
            raise CheckFailed(
                f"discovery: listed {listed}, up {up}; worker series for {labelled}, want {workers}"
            )
        time.sleep(2)


async def _retrying(what: str, attempt, timeout_s: float = 30.0):
    """``await attempt()`` until it succeeds or ``timeout_s`` passes (the server may still be
    restoring its streams, the KV watcher may time out meanwhile); the last error is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await attempt()
        except (nats.errors.Error, TimeoutError) as e:
            if time.monotonic() > deadline:
                raise CheckFailed(f"{what}: {e!r}") from e
            await asyncio.sleep(0.5)


async def _records(nats_url: str, auth: NatsAuth) -> dict[str, bytes]:
    """Every request record (``omni_requests``) by key."""
    nc = await nats.connect(nats_url, **auth.connect_options())
    try:
        kv = await requests_kv(nc.jetstream())
        keys = await _retrying("omni_requests keys", kv.keys)
        return {k: (await _retrying(f"record {k}", lambda k=k: kv.get(k))).value for k in keys}
    finally:
        await nc.close()


async def _marker(
    nats_url: str, auth: NatsAuth, streams: list[str], value: str | None
) -> tuple[set[str], str]:
    """(which of ``streams`` exist, the check's marker in ``omni_evictions``), writing ``value``
    first when given."""
    nc = await nats.connect(nats_url, **auth.connect_options())
    try:
        js = nc.jetstream()
        kv = await _retrying("omni_evictions", lambda: evictions_kv(js))
        if value is not None:
            await kv.put(MARKER_KEY, value.encode())

        async def existing() -> set[str]:
            found = set()
            for name in streams:
                with contextlib.suppress(NotFoundError):
                    await js.stream_info(name)
                    found.add(name)
            return found

        found = await _retrying("streams", existing)
        try:
            return found, (await kv.get(MARKER_KEY)).value.decode()
        except KeyNotFoundError:
            return found, ""
    finally:
        await nc.close()


def jetstream_survives_restart(
    stack: ComposeProject, nats_url: str, gateway: Gateway, model: str, names: list[str]
) -> str:
    """``docker compose restart nats``: every stream of ``names``, every request record (same key,
    same value) and a value the check wrote are there after it, and the stack serves again. Read and
    written as the orchestrator's NATS identity (TLS verified against the stack's CA)."""
    auth = stack.nats_auth("orchestrator")
    streams, _ = asyncio.run(_marker(nats_url, auth, names, marker := uuid.uuid4().hex))
    records = asyncio.run(_records(nats_url, auth))
    expect(bool(records), "no request records before the restart")
    pid = stack.state("nats")["Pid"]
    stack.run("restart", "nats", timeout_s=300)
    expect(stack.state("nats")["Pid"] != pid, "nats was not restarted")
    stack.wait_healthy(["nats"], 120)
    streams_after, value = asyncio.run(_marker(nats_url, auth, names, None))
    expect(value == marker, f"KV value lost in the restart: {value!r}")
    expect(streams <= streams_after, f"streams lost: {streams - streams_after}")
    after = asyncio.run(_records(nats_url, auth))
    lost = [k for k, v in records.items() if after.get(k) != v]
    expect(not lost, f"{len(lost)} of {len(records)} request records lost or changed: {lost[:3]}")

    expect(asyncio.run(_streams(gateway, model, 1)) == [TOKENS], "no request served after the NATS restart")
    return (
        f"{len(streams_after)} streams, all {len(records)} request records and the marker kept; served after"
    )


@dataclass
class Outage:
    docker_kill_restarted: bool
    """Whether the restart policy brought back a container stopped by ``docker kill``."""
    restarted_s: float
    """From the process kill to the container healthy again, seconds."""
    completed: int
    """Requests sent during the outage that completed (all must)."""


def worker_dies(stack: ComposeProject, service: str, gateway: Gateway, model: str, n: int = 8) -> Outage:
    """``docker kill`` of ``service``'s container, then ``kill -9`` of its main process from the host
    (what a crash or the OOM killer does): the restart policy brings the container back, healthy,
    and ``n`` requests sent right after the kill all complete."""
    container = stack.container(service)
    sh("docker", "kill", container)
    time.sleep(10)
    state = stack.state(service)
    docker_kill_restarted = state["Running"]
    log(
        f"docker kill {service}: running again 10 s later: {docker_kill_restarted} (status {state['Status']})"
    )
    if not docker_kill_restarted:
        stack.run("start", service)
    stack.wait_healthy([service], 300)

    pid, restarts = stack.state(service)["Pid"], stack.restart_count(service)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        expect(time.monotonic() - t0 < 10, f"{service}: pid {pid} still there 10 s after kill -9")
        time.sleep(0.05)
    log(f"kill -9 of {service}'s process {pid}: gone")
    counts = asyncio.run(_streams(gateway, model, n))
    expect(counts == [TOKENS] * n, f"requests during the outage: tokens {counts}")
    deadline = time.monotonic() + 300
    while stack.restart_count(service) <= restarts:
        expect(time.monotonic() < deadline, f"{service}: not restarted by its policy")
        time.sleep(1)
    stack.wait_healthy([service], 300)
    return Outage(docker_kill_restarted, time.monotonic() - t0, n)
