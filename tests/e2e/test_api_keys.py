"""A gateway with an API key in front of the session's pipeline, as compose runs it: bound to every
interface, its key generated into its data directory at first start. The official ``openai``
client gets ``AuthenticationError`` with a wrong key on every route and a completion with the key;
input past the gateway's bounds is refused through the real HTTP server and leaves no request
behind in its gauges."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from libs.common.pipeline import DEFAULT_PIPELINE_PATH
from libs.stack.local_nats import free_port
from libs.stack.local_stack import http_status
from libs.stack.processes import wait_for
from tests.metrics_scrape import scrape, total
from tests.procs import ServiceProcess, start_service

pytestmark = pytest.mark.e2e

START_S = 120.0
BODY_LIMIT = 16 << 10


@dataclass
class KeyedGateway:
    url: str
    key: str
    proc: ServiceProcess

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def in_flight(self) -> float:
        """Requests this gateway holds: waiting for their first stage plus running."""
        samples = scrape(self.proc.metrics_url)  # the admin port (127.0.0.1, no key)
        assert total(samples, "vllm:omni_requests_success_total") >= 1, "no request has ended here yet"
        return total(samples, "vllm:omni_num_requests_waiting") + total(
            samples, "vllm:omni_num_requests_running"
        )


@pytest.fixture(scope="module")
def gateway(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedGateway]:
    tmp = tmp_path_factory.mktemp("keyed-gateway")
    key_file = tmp / "data" / "api-key"
    port = free_port()
    env = {
        "OMNIRELAY_HOST": "0.0.0.0",
        "OMNIRELAY_API_KEYS_FILE": str(key_file),
        "OMNIRELAY_GENERATE_API_KEY": "true",
        # Small enough that the client's whole body is read by the server before it answers
        # (a large one still in the socket when the server closes it could reset the connection).
        "OMNIRELAY_MAX_BODY_BYTES": str(BODY_LIMIT),
    }
    proc = start_service(
        ["gateway", "--port", str(port)], stack.nats_url, DEFAULT_PIPELINE_PATH, tmp / "gw.log", env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: http_status(f"{url}/health") == 200, "the keyed gateway healthy", START_S, 0.2, [proc]
        )
        (key,) = [ln for ln in key_file.read_text().splitlines() if not ln.startswith("#")]
        yield KeyedGateway(url, key, proc)
    finally:
        proc.stop()


def test_the_key_is_generated_private_and_never_logged(gateway: KeyedGateway) -> None:
    path = Path(gateway.proc.env["OMNIRELAY_API_KEYS_FILE"])
    assert path.stat().st_mode & 0o777 == 0o600
    assert str(path) in gateway.proc.text() and gateway.key not in gateway.proc.text()


def test_the_openai_client_needs_the_key(gateway: KeyedGateway, pipeline) -> None:
    model = pipeline.served_model_name
    msgs = [{"role": "user", "content": "Hello!"}]
    for key in ("sk-wrong", gateway.key[:-1]):
        wrong = gateway.client(key)
        calls = [
            lambda c=wrong: c.models.list(),
            lambda c=wrong: c.chat.completions.create(model=model, messages=msgs, max_tokens=4),
            lambda c=wrong: c.completions.create(model=model, prompt="Hello", max_tokens=4),
            lambda c=wrong: c.audio.speech.create(model=model, voice="alloy", input="Hello."),
        ]
        for call in calls:
            with pytest.raises(openai.AuthenticationError) as e:
                call()
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    right = gateway.client(gateway.key)
    assert [m.id for m in right.models.list().data] == [model]
    r = right.chat.completions.create(model=model, messages=msgs, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 4
    chunks = list(right.chat.completions.create(model=model, messages=msgs, max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200  # no key: liveness


def test_bounded_input_through_the_server_leaves_nothing_behind(gateway: KeyedGateway, pipeline) -> None:
    h = httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {gateway.key}"}, timeout=60)
    base = {"model": pipeline.served_model_name, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**base, "seed": 2**70}, 400, "seed"),
        ({**base, "ignore_eos": True}, 400, "ignore_eos"),  # bound to every interface: not allowed
        ({**base, "stop": list("abcde")}, 400, "stop"),
        ({**base, "messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}, 413, None),
    ]
    for body, status, param in cases:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
    assert gateway.in_flight() == 0
    assert h.post("/v1/chat/completions", json={**base, "max_tokens": 2}).status_code == 200
