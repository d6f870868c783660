"""The folding of ``omnirelay bench profile`` (benchmarks/token_path_profile.py): py-spy's raw
lines into frame groups and µs per output token."""

from __future__ import annotations

import pytest

from benchmarks.token_path_profile import (
    GROUPS,
    OTHER,
    Frame,
    Group,
    Rule,
    fold,
    group_of,
    parse_raw,
    render_profile,
)

ROOT = "_run_once (/usr/lib/python3.12/asyncio/base_events.py:1987);_run (/usr/lib/python3.12/asyncio/events.py:88)"
SITE = "/work/main/.venv/lib/python3.12/site-packages"
RAW = "\n".join(
    [
        # a gateway event: nats-py's subscription task → _on_event → decode → pydantic
        f"{ROOT};_wait_for_msgs ({SITE}/nats/aio/subscription.py:90);"
        "_on_event (/work/main/services/gateway/pipeline_client.py:170);"
        "decode (/work/main/libs/common/envelopes.py:58);"
        f"model_validate ({SITE}/pydantic/main.py:700) 30",
        # the same path, but the time is the callback's own
        f"{ROOT};_wait_for_msgs ({SITE}/nats/aio/subscription.py:90);"
        "_on_event (/work/main/services/gateway/pipeline_client.py:190) 10",
        # a log line written while rendering: logging wins over rendering
        f"{ROOT};sse_stream (/work/main/services/gateway/responses.py:280);"
        "_chat_render (/work/main/services/gateway/routes.py:170);"
        "info (/usr/lib/python3.12/logging/__init__.py:1500) 5",
        # rendering a chunk
        f"{ROOT};sse_stream (/work/main/services/gateway/responses.py:280);"
        "_chat_chunk (/work/main/services/gateway/routes.py:160) 20",
        # h11 writing the body: only framework frames
        f"{ROOT};send ({SITE}/uvicorn/protocols/http/h11_impl.py:480);send ({SITE}/h11/_connection.py:500) 15",
        # the event loop itself
        f"{ROOT} 20",
        # frames py-spy prints without a file (with --subprocesses/--threads)
        "process 123;thread 0x7f 0",
    ]
)


def test_parse_raw_reads_stacks_root_first_and_counts() -> None:
    samples = parse_raw(RAW)
    assert len(samples) == 7
    stack, n = samples[0]
    assert n == 30
    assert stack[0] == Frame("_run_once", "/usr/lib/python3.12/asyncio/base_events.py")
    assert stack[-1].function == "model_validate"
    assert stack[-1].label == "model_validate (pydantic/main.py)"
    assert samples[-1][1] == 0


def test_parse_raw_rejects_a_line_without_a_count() -> None:
    with pytest.raises(ValueError):
        parse_raw("main (x.py:1);other (y.py:2)")


def test_the_first_matching_group_wins_whatever_the_frame_depth() -> None:
    samples = parse_raw(RAW)
    names = [group_of(stack) for stack, _ in samples]
    assert names[0] == "event decode (msgpack + pydantic validate)"  # not nats-py, not intake
    assert names[1] == "gateway event intake (pipeline_client)"  # not nats-py's read loop
    assert names[2] == "logging"  # not rendering
    assert names[3].startswith("SSE chunk rendering")
    assert names[4].startswith("HTTP write/read")
    assert names[5].startswith("event loop")
    assert names[6] == OTHER


def test_fold_shares_and_microseconds_per_token() -> None:
    p = fold(parse_raw(RAW), interval_s=0.005, tokens=500)
    assert p.samples == 100
    by = {s.name: s for s in p.groups}
    decode = by["event decode (msgpack + pydantic validate)"]
    assert decode.samples == 30
    assert decode.pct == pytest.approx(30.0)
    assert decode.us_per_token == pytest.approx(30 * 5000 / 500)  # 300 µs
    assert p.us_per_token == pytest.approx(100 * 5000 / 500)
    assert sum(s.samples for s in p.groups) == p.samples
    assert [s.samples for s in p.groups] == sorted((s.samples for s in p.groups), reverse=True)
    # functions by self samples: the leaf frame
    assert p.functions[0].name == "model_validate (pydantic/main.py)"
    assert p.functions[0].samples == 30


def test_fold_with_no_tokens_or_no_samples_is_zero_not_an_error() -> None:
    assert fold(parse_raw(RAW), 0.005, tokens=0).us_per_token == 0.0
    empty = fold([], 0.005, tokens=10)
    assert empty.samples == 0 and empty.groups == [] and empty.functions == []


def test_custom_groups_and_rule_function_filter() -> None:
    groups = (Group("decode only", (Rule("envelopes.py", ("decode",)),)),)
    samples = parse_raw(RAW)
    assert group_of(samples[0][0], groups) == "decode only"
    assert group_of(samples[1][0], groups) == OTHER


def test_group_names_are_unique() -> None:
    names = [g.name for g in GROUPS]
    assert len(names) == len(set(names)) and OTHER not in names


def test_rule_functions_match_py_spy_qualified_names() -> None:
    rule = Rule("nats/aio/client.py", ("_flusher",))
    assert rule.matches(Frame("Client._flusher", "/x/nats/aio/client.py"))
    assert rule.matches(Frame("_flusher", "/x/nats/aio/client.py"))
    assert not rule.matches(Frame("Client.not_flusher", "/x/nats/aio/client.py"))
    assert not rule.matches(Frame("Client._flusher", "/x/other.py"))
    timed = Frame("ResponseTimer.__call__.<locals>.timed_send", "/w/services/gateway/app.py")
    assert group_of([timed]) == "ResponseTimer and middlewares (own code)"
    # the body write under ResponseTimer's send is the HTTP write's, its timeout asyncio's
    h11 = Frame("Connection.send", "/v/site-packages/h11/_connection.py")
    assert group_of([timed, h11]).startswith("HTTP write/read")
    assert group_of([timed, Frame("timeout", "/usr/lib/python3.11/asyncio/timeouts.py")]) == (
        "asyncio.timeout (enter/exit)"
    )


def test_render_profile_has_the_cpu_column_only_with_a_cpu_reading() -> None:
    p = fold(parse_raw(RAW), 0.005, tokens=500)
    with_cpu = render_profile("gateway, c = 1", p, cpu_us_per_token=200.0)
    assert "share × CPU" in with_cpu
    assert "| event decode (msgpack + pydantic validate) | 30 | 30.0 % | 300.0 | 60.0 |" in with_cpu
    assert "share × CPU" not in render_profile("gateway, c = 1", p, None)


LOOP = "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)"
BOOT = (
    "<module> (/w/cli/__main__.py:9);serve (/w/services/gateway/app.py:167);"
    "run (/v/site-packages/uvicorn/main.py:600);Server.run (/v/site-packages/uvicorn/server.py:60)"
)


def test_frames_above_the_event_loop_are_cut_before_grouping() -> None:
    # the gateway runs under uvicorn.run and app.py: without the cut, every sample would be the
    # HTTP framework's
    read = parse_raw(
        f"{BOOT};{LOOP};Client._read_loop ({SITE}/nats/aio/client.py:2100);"
        f"Parser.parse ({SITE}/nats/protocol/parser.py:80) 4"
    )[0][0]
    assert group_of(read) == "nats-py read loop + subscription tasks"
    own = parse_raw(f"{BOOT};{LOOP} 3")[0][0]
    assert group_of(own) == "event loop (uvloop/asyncio, tasks, selectors)"


def test_a_leaf_rule_takes_a_middleware_own_time_only() -> None:
    mw = "ResponseTimer.__call__ (/w/services/gateway/app.py:55)"
    own = parse_raw(f"{BOOT};{LOOP};{mw} 1")[0][0]
    below = parse_raw(f"{BOOT};{LOOP};{mw};Submitter.chat (/w/services/gateway/submission.py:90) 1")[0][0]
    assert group_of(own) == "ResponseTimer and middlewares (own code)"
    assert group_of(below).startswith("request admission")
