"""The folding of ``omnirelay bench profile`` (benchmarks/token_path_profile.py): py-spy's raw
lines by package and by omnirelay function, and µs per output token."""

from __future__ import annotations

import pytest

from benchmarks.token_path_profile import (
    NOT_OURS,
    Frame,
    fold,
    innermost_ours,
    package_of,
    parse_raw,
    render_profile,
)

BOOT = (
    "<module> (cli/__main__.py:9);serve (services/gateway/app.py:167);"
    "run (uvicorn/main.py:600);Server.run (uvicorn/server.py:60);"
    "Runner.run (asyncio/runners.py:118);_run_once (asyncio/base_events.py:1987)"
)
"""Above the event loop's entry: ancestors of every sample (py-spy's short file names)."""
RAW = "\n".join(
    [
        # a gateway event: nats-py's subscription task → _on_event → decode → pydantic
        f"{BOOT};_wait_for_msgs (nats/aio/subscription.py:90);"
        "_on_event (services/gateway/pipeline_client.py:170);"
        "decode (libs/common/envelopes.py:58);"
        "model_validate (pydantic/main.py:700) 30",
        # the same path, but the time is the callback's own
        f"{BOOT};_wait_for_msgs (nats/aio/subscription.py:90);"
        "_on_event (services/gateway/pipeline_client.py:190) 10",
        # a log line written while rendering a chunk
        f"{BOOT};sse_stream (services/gateway/responses.py:280);"
        "_chat_render (services/gateway/routes.py:170);"
        "info (logging/__init__.py:1500) 5",
        # rendering a chunk
        f"{BOOT};sse_stream (services/gateway/responses.py:280);_chat_chunk (services/gateway/routes.py:160) 20",
        # h11 writing the body: only framework frames below the loop
        f"{BOOT};send (uvicorn/protocols/http/h11_impl.py:480);send (h11/_connection.py:500) 15",
        # the event loop itself
        f"{BOOT} 20",
        # frames py-spy prints without a file (with --subprocesses/--threads)
        "process 123;thread 0x7f 0",
    ]
)


def test_parse_raw_reads_stacks_root_first_and_counts() -> None:
    samples = parse_raw(RAW)
    assert len(samples) == 7
    stack, n = samples[0]
    assert n == 30
    assert stack[0] == Frame("<module>", "cli/__main__.py")
    assert stack[-1].label == "model_validate (pydantic/main.py)"
    assert samples[-1] == ((Frame("process 123", ""), Frame("thread 0x7f", "")), 0)


def test_parse_raw_rejects_a_line_without_a_count() -> None:
    with pytest.raises(ValueError):
        parse_raw("main (x.py:1);other (y.py:2)")


def test_packages_are_omnirelay_modules_and_other_top_level_packages() -> None:
    assert package_of("services/gateway/routes.py") == "services/gateway/routes.py"
    assert package_of("libs/common/envelopes.py") == "libs/common/envelopes.py"
    assert package_of("asyncio/queues.py") == "asyncio"
    assert package_of("uvicorn/protocols/http/h11_impl.py") == "uvicorn"
    assert package_of("selectors.py") == "selectors.py"


def test_the_innermost_omnirelay_frame_under_the_event_loop_takes_the_sample() -> None:
    names = [innermost_ours(stack) for stack, _ in parse_raw(RAW)]
    assert names[0] == "decode (libs/common/envelopes.py)"  # with pydantic under it
    assert names[1] == "_on_event (services/gateway/pipeline_client.py)"
    assert names[2] == "_chat_render (services/gateway/routes.py)"  # with the log line it wrote
    assert names[3] == "_chat_chunk (services/gateway/routes.py)"
    # serve (services/gateway/app.py) is above the loop's entry: not the framework's work's owner
    assert names[4] == names[5] == names[6] == NOT_OURS


def test_a_thread_without_an_event_loop_is_read_whole() -> None:
    stack = parse_raw(
        "run (threading.py:1);step (services/stage_worker/mock_engine.py:9);x (json/encoder.py:3) 1"
    )
    assert innermost_ours(stack[0][0]) == "step (services/stage_worker/mock_engine.py)"


def test_fold_shares_and_microseconds_per_token() -> None:
    p = fold(parse_raw(RAW), interval_s=0.005, tokens=500)
    assert p.samples == 100
    assert p.us_per_token == pytest.approx(100 * 5000 / 500)
    packages = {s.name: s for s in p.packages}
    assert packages["pydantic"].samples == 30
    assert packages["pydantic"].pct == pytest.approx(30.0)
    assert packages["pydantic"].us_per_token == pytest.approx(30 * 5000 / 500)  # 300 µs
    assert packages["asyncio"].samples == 20 and packages["h11"].samples == 15
    assert packages["services/gateway/routes.py"].samples == 20
    functions = {s.name: s.samples for s in p.functions}
    assert functions["decode (libs/common/envelopes.py)"] == 30
    assert functions[NOT_OURS] == 35
    for shares in (p.packages, p.functions):
        assert sum(s.samples for s in shares) == p.samples
        assert [s.samples for s in shares] == sorted((s.samples for s in shares), reverse=True)


def test_fold_with_no_tokens_or_no_samples_is_zero_not_an_error() -> None:
    assert fold(parse_raw(RAW), 0.005, tokens=0).us_per_token == 0.0
    empty = fold([], 0.005, tokens=10)
    assert empty.samples == 0 and empty.packages == [] and empty.functions == []


def test_render_profile_has_the_cpu_column_only_with_a_cpu_reading_and_sums_the_rest() -> None:
    p = fold(parse_raw(RAW), 0.005, tokens=500)
    with_cpu = render_profile("gateway, c = 1", p, cpu_us_per_token=200.0, top=2)
    assert "share × CPU" in with_cpu
    assert "decode (libs/common/envelopes.py)" in with_cpu
    row = next(line for line in with_cpu.splitlines() if line.startswith("pydantic"))
    assert row.split() == ["pydantic", "30", "30.0", "300.0", "60.0"]
    assert "(5 more)" in with_cpu and "(3 more)" in with_cpu  # 7 packages and 5 functions, 2 of each shown
    assert "share × CPU" not in render_profile("gateway, c = 1", p, None)
