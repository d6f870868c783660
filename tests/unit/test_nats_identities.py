"""The NATS identities of a pipeline (libs/common/nats_identities.py) and their secrets
(libs/stack/nats_secrets.py).

The expected allow lists are written out here from the subjects and JetStream calls the services'
code makes (services/*/ and libs/common/bus.py, registry.py, consumer.py; nats-py's API subjects),
not read from the generator's tables. Pipeline: compose/pipelines/default.yaml (``omni``: thinker
x2, talker x1, code2wav x1).
"""

from __future__ import annotations

import json
import re
import stat
import subprocess
from pathlib import Path

import bcrypt
import pytest

from libs.common.nats_credentials import NatsCredentials
from libs.common.nats_identities import identities
from libs.common.pipeline import load_pipeline
from libs.stack.local_nats import nats_server_binary
from libs.stack.nats_secrets import authorization_block, ensure_passwords, password_file

REPO = Path(__file__).resolve().parents[2]
STREAMS = ["OMNI_OMNI_REQUESTS", "OMNI_OMNI_STAGES", "OMNI_OMNI_EVENTS"]
KV = ["KV_omni_services", "KV_omni_requests", "KV_omni_evictions"]


def declare(update: bool) -> list[str]:
    calls = ["INFO", "CREATE", "UPDATE"] if update else ["INFO", "CREATE"]
    return [f"$JS.API.STREAM.{c}.{s}" for s in STREAMS + KV for c in calls]


def kv_read(stream: str) -> list[str]:
    return [
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",  # nats-py's watch reads its consumer's info
        f"$JS.FC.{stream}.>",
    ]


def durable(stream: str, consumer: str) -> list[str]:
    return [
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer}",
        f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    ]


REPLICAS = [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0)]
"""The default pipeline's workers: listener, thinker x2, talker, code2wav."""

EXPECTED = {
    "gateway": (
        [
            "omni.omni.requests",
            "omni.omni.ctl.abort",
            "$KV.omni_services.gateway.omni.*",
            *declare(False),
            *kv_read("KV_omni_services"),
        ],
        ["omni.omni.out.>", "omni.omni.ctl.resume.*", "_INBOX.gateway.>"],
    ),
    "orchestrator": (
        [
            *(f"omni.omni.stage.{s}.{r}.in" for s, r in REPLICAS),
            *(f"omni.omni.ctl.alive.{s}.{r}" for s, r in REPLICAS),
            *(f"omni.omni.ctl.route.{s}.{r}" for s, r in REPLICAS),
            "omni.omni.ctl.alive.orchestrator.*",
            "omni.omni.ctl.abort",
            "omni.omni.ctl.resume.*",
            "omni.omni.out.>",
            "$KV.omni_requests.>",
            "$KV.omni_evictions.>",
            "$KV.omni_services.orchestrator.omni.*",
            *declare(True),
            *durable("OMNI_OMNI_REQUESTS", "orchestrator"),
            *durable("OMNI_OMNI_EVENTS", "orchestrator-events"),
            "$JS.API.DIRECT.GET.OMNI_OMNI_STAGES",
            "$JS.API.STREAM.MSG.GET.OMNI_OMNI_STAGES",
            "$JS.API.STREAM.MSG.DELETE.OMNI_OMNI_STAGES",
            *kv_read("KV_omni_requests"),
            *kv_read("KV_omni_services"),
            *kv_read("KV_omni_evictions"),
        ],
        ["omni.omni.ctl.alive.orchestrator.*", "_INBOX.orchestrator.>"],
    ),
    "operator": (
        [
            "$JS.API.INFO",
            "$JS.API.STREAM.NAMES",
            "$JS.API.STREAM.LIST",
            "$JS.API.STREAM.INFO.*",
            "$JS.API.CONSUMER.NAMES.*",
            "$JS.API.CONSUMER.LIST.*",
            "$JS.API.CONSUMER.INFO.*.*",
            *kv_read("KV_omni_services"),
            *kv_read("KV_omni_requests"),
            *kv_read("KV_omni_evictions"),
        ],
        ["_INBOX.operator.>"],
    ),
}


def expected_worker(s: int, r: int) -> tuple[list[str], list[str]]:
    nxt = {0: [], 1: ["omni.omni.stage.2.0.in"], 2: ["omni.omni.stage.3.0.in"], 3: []}[
        s
    ]  # the listener feeds none
    publish = [
        "omni.omni.out.>",
        "omni.omni.events.*",
        *nxt,
        f"$KV.omni_services.worker.omni.{s}.{r}",
        *declare(False),
        *durable("OMNI_OMNI_STAGES", f"stage-{s}-{r}"),
        *kv_read("KV_omni_requests"),
    ]
    if s == 2:  # the talker writes its position notes into request records
        publish.append("$KV.omni_requests.>")
    subscribe = [
        "omni.omni.ctl.abort",
        f"omni.omni.ctl.alive.{s}.{r}",
        f"omni.omni.ctl.route.{s}.{r}",
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.OMNI_OMNI_STAGES.stage-{s}-{r}",
        f"_INBOX.worker-{s}-{r}.>",
    ]
    return publish, subscribe


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(REPO / "compose/pipelines/default.yaml")


def test_one_identity_per_role_with_exactly_its_subjects(pipeline) -> None:
    got = {i.name: i for i in identities(pipeline)}
    workers = {f"worker-{s}-{r}": expected_worker(s, r) for s, r in REPLICAS}
    assert list(got) == ["gateway", "orchestrator", *workers, "operator"]
    for name, (publish, subscribe) in {**EXPECTED, **workers}.items():
        assert sorted(got[name].publish) == sorted(publish), name
        assert sorted(got[name].subscribe) == sorted(subscribe), name
        assert len(set(got[name].publish)) == len(got[name].publish), name
        assert got[name].allow_responses == (name != "operator"), name
        assert got[name].inbox_prefix == f"_INBOX.{name}"


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching, written here from the protocol's rules: ``*`` one token, ``>`` the
    rest (one token or more)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


@pytest.mark.parametrize(
    ("who", "action", "subject"),
    [
        ("worker-1-1", "subscribe", "omni.omni.out.gw1.req1"),  # read others' answers
        ("worker-1-1", "publish", "omni.omni.ctl.abort"),  # cancel anyone's request
        ("worker-1-1", "publish", "$KV.omni_services.worker.omni.1.0"),  # another replica's key
        ("worker-1-1", "publish", "$KV.omni_services.worker.omni.1.7"),  # an undeclared replica
        ("worker-1-1", "publish", "$KV.omni_requests.req1"),  # rewrite a record (not a talker)
        ("worker-1-1", "publish", "$JS.API.CONSUMER.MSG.NEXT.OMNI_OMNI_STAGES.stage-1-0"),  # steal work
        ("worker-1-1", "publish", "$JS.API.STREAM.UPDATE.OMNI_OMNI_REQUESTS"),
        ("worker-1-1", "publish", "$JS.API.STREAM.DELETE.OMNI_OMNI_STAGES"),
        ("worker-1-1", "publish", "omni.omni.stage.1.0.in"),  # its own stage's queue
        ("worker-1-1", "publish", "omni.omni.ctl.resume.gw1"),  # fence a request's attempts
        ("worker-1-1", "subscribe", "_INBOX.gateway.x"),
        ("worker-0-0", "publish", "omni.omni.stage.1.0.in"),  # the listener feeds no thinker
        ("worker-2-0", "publish", "omni.omni.requests"),
        ("gateway", "publish", "omni.omni.stage.0.0.in"),  # skip admission
        ("gateway", "publish", "omni.omni.ctl.route.1.0"),
        ("gateway", "publish", "$KV.omni_services.worker.omni.0.0"),
        ("gateway", "subscribe", "omni.omni.requests"),
        ("orchestrator", "subscribe", "omni.omni.out.gw1.req1"),
        ("orchestrator", "publish", "omni.omni.stage.0.7.in"),  # an undeclared replica
        ("operator", "publish", "omni.omni.requests"),
        ("operator", "publish", "$KV.omni_requests.req1"),
        ("operator", "publish", "$JS.API.STREAM.MSG.GET.OMNI_OMNI_STAGES"),  # read a prompt
        ("operator", "publish", "$JS.API.CONSUMER.CREATE.OMNI_OMNI_STAGES"),
        ("operator", "subscribe", "omni.omni.out.gw1.req1"),
        ("operator", "subscribe", "omni.>"),
    ],
)
def test_what_an_identity_must_not_do_is_matched_by_none_of_its_rules(pipeline, who, action, subject) -> None:
    ident = {i.name: i for i in identities(pipeline)}[who]
    rules = ident.publish if action == "publish" else ident.subscribe
    assert not [r for r in rules if _matches(r, subject)]


def test_passwords_are_private_kept_and_hashed_in_a_config_nats_server_accepts(pipeline, tmp_path) -> None:
    ids = identities(pipeline)
    root = tmp_path / "secrets"
    first = ensure_passwords(root, [i.name for i in ids])
    assert ensure_passwords(root, [i.name for i in ids]) == first  # kept across starts
    assert len(set(first.values())) == len(ids)
    for name, pw in first.items():
        path = password_file(root, name)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", pw)

    block = authorization_block(ids, first)
    users = json.loads(block.split("users = ", 1)[1].rsplit("}", 1)[0])
    for user in users:
        assert user["password"].startswith("$2")
        assert first[user["user"]] not in block
        assert bcrypt.checkpw(first[user["user"]].encode(), user["password"].encode())
    conf = tmp_path / "server.conf"
    conf.write_text(block)
    check = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_client_credentials_from_the_environment(tmp_path, monkeypatch) -> None:
    for var in ("USER", "PASSWORD", "PASSWORD_FILE", "CA", "CERT", "KEY"):
        monkeypatch.delenv(f"OMNIRELAY_NATS_{var}", raising=False)
    assert NatsCredentials().connect_options() == {}  # a server without authorization: as before
    (tmp_path / "pw").write_text("s3cret\n")
    monkeypatch.setenv("OMNIRELAY_NATS_USER", "worker-1-0")
    monkeypatch.setenv("OMNIRELAY_NATS_PASSWORD_FILE", str(tmp_path / "pw"))
    assert NatsCredentials().connect_options() == {
        "user": "worker-1-0",
        "password": "s3cret",
        "inbox_prefix": "_INBOX.worker-1-0",
    }
    monkeypatch.setenv("OMNIRELAY_NATS_PASSWORD", "other")
    with pytest.raises(ValueError, match="not both"):
        NatsCredentials()
    monkeypatch.delenv("OMNIRELAY_NATS_PASSWORD")
    monkeypatch.setenv("OMNIRELAY_NATS_CERT", str(tmp_path / "c.pem"))
    with pytest.raises(ValueError, match="go together"):
        NatsCredentials()
