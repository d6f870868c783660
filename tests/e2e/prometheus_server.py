"""A Prometheus process for the e2e tests: compose/prometheus.yml with the local differences, its
HTTP API, and the module-scoped ``prom`` fixture (tests/e2e/test_prometheus.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from libs.stack.local_nats import free_port
from libs.stack.processes import wait_for
from tests import needs
from tests.procs import stop_process

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "compose" / "prometheus.yml"
INTERVAL = "1s"
WAIT_S = 20.0
"""How long a PromQL answer may take to reflect what happened (1 s scrapes; vLLM emits its
scheduler stats at most once a second and a final snapshot when it goes idle)."""


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path, sd_url: str) -> None:
        self.url, self.proc, self.log, self.sd_url = url, proc, log, sd_url
        self.http = httpx.Client(base_url=url, timeout=30)

    def api(self, path: str, **params: Any) -> Any:
        r = self.http.get(f"/api/v1/{path}", params=params)
        body = r.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, q: str, at: float | None = None) -> list[dict[str, Any]]:
        return self.api("query", query=q, **({"time": f"{at:.3f}"} if at is not None else {}))["result"]

    def vector(self, q: str, *labels: str, at: float | None = None) -> dict[tuple[str, ...], float]:
        return {
            tuple(r["metric"].get(n, "") for n in labels): float(r["value"][1]) for r in self.query(q, at)
        }

    def scalar(self, q: str, at: float | None = None) -> float | None:
        res = self.query(q, at)
        assert len(res) <= 1, res
        return float(res[0]["value"][1]) if res else None

    def grown(
        self, selector: str, by: str, t0: float, at: float | None = None
    ) -> dict[tuple[str, ...], float]:
        """Increase of ``sum by (by) (selector)`` since ``t0`` (raw values, no extrapolation; a series
        created after ``t0`` counts from 0)."""
        now = f"sum by ({by}) ({selector})"
        then = f"sum by ({by}) ({selector} @ {t0:.3f})"
        labels = [n.strip() for n in by.split(",") if n.strip()]
        return self.vector(f"({now} - {then}) or {now}", *labels, at=at)

    def wait_scraped_after(self, t: float, scrapes: int = 1, timeout_s: float = WAIT_S) -> None:
        """Wait until every service the stack's service discovery lists now has been scraped
        successfully (``up`` 1) ``scrapes`` times after wall time ``t`` (s): what those services
        exported at ``t`` is then in Prometheus, and ``rate()`` over a window holding those scrapes
        has the two samples it needs. A listed service Prometheus has no sample of yet counts as
        not scraped (it may have just come back: a worker stopped for longer than the registry's
        TTL leaves the listing and its series go stale until it is scraped again)."""
        short: dict[str, int] = {}

        def scraped() -> bool:
            want = {g["labels"]["__meta_omnirelay_instance"] for g in self.sd()}
            window = max(2, int(time.time() - t) + 2)
            got = {
                r["metric"]["instance"]: sum(1 for ts, v in r["values"] if float(ts) > t and float(v) == 1)
                for r in self.query(f'up{{job="omnirelay"}}[{window}s]')
            }
            short.clear()
            short.update({i: got.get(i, 0) for i in want if got.get(i, 0) < scrapes})
            return bool(want) and not short

        try:
            wait_for(scraped, f"scraped {scrapes} time(s) after {t:.3f}", timeout_s, every_s=0.2)
        except RuntimeError as e:
            raise AssertionError(f"{e}; short: {short}") from None

    def sd(self) -> list[dict[str, Any]]:
        """The stack's service-discovery answer (the targets Prometheus is told about)."""
        return httpx.get(self.sd_url, timeout=30).json()

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets", state="active")["activeTargets"]


def eventually(fn, ok, timeout_s: float = WAIT_S, every_s: float = 0.25):
    """``fn()`` until ``ok(value)`` or the timeout; returns the last value (assert on it)."""
    seen = []

    def holds() -> bool:
        seen.append(fn())
        return ok(seen[-1])

    with contextlib.suppress(RuntimeError):
        wait_for(holds, "eventually", timeout_s, every_s)
    return seen[-1]


def sd_groups(stack) -> list[dict[str, Any]]:
    return httpx.get(f"{stack.admin_url}/prometheus/targets", timeout=30).json()


def local_config(sd_url: str, port: int) -> dict[str, Any]:
    """compose/prometheus.yml with the local differences (and nothing else) applied."""
    config = yaml.safe_load(CONFIG.read_text())
    config["global"].update(scrape_interval=INTERVAL, scrape_timeout=INTERVAL, evaluation_interval=INTERVAL)
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"omnirelay", "prometheus", "nats"}, set(jobs)
    (sd,) = jobs["omnirelay"]["http_sd_configs"]
    assert sd["url"] == "http://gateway:8001/prometheus/targets"  # the gateway's admin port
    sd.update(url=sd_url, refresh_interval=INTERVAL)
    jobs["prometheus"]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
    config["scrape_configs"] = [jobs["omnirelay"], jobs["prometheus"]]  # no NATS exporter here
    return config


@pytest.fixture(scope="module")
def prom(stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = needs.program(
        "prometheus", "Debian's prometheus is not installed: run `make prometheus-bin` (`make test` does)"
    )
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(local_config(f"{stack.admin_url}/prometheus/targets", port), sort_keys=False)
    )
    log = tmp / "prometheus.log"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--enable-feature=exemplar-storage",
    ]
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    p = Prometheus(f"http://127.0.0.1:{port}", proc, log, f"{stack.admin_url}/prometheus/targets")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{p.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        want = {g["labels"]["__meta_omnirelay_instance"] for g in sd_groups(stack)}
        up = eventually(
            lambda: p.vector('up{job="omnirelay"} == 1', "instance"), lambda v: want <= {k[0] for k in v}
        )
        assert want <= {k[0] for k in up}, (want, up, p.targets())
        print(
            f"\nprometheus ready {ready_s:.1f} s, all {len(want)} services up {time.monotonic() - t0:.1f} s after start"
        )
        yield p
    finally:
        p.http.close()
        stop_process(proc, signal.SIGTERM, 15)


# --- known traffic and its ground truth ---------------------------------------------------------------
