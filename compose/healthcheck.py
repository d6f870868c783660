"""Container healthcheck of the omnirelay services (standard library only; baked into the image).

    python /opt/omnirelay/healthcheck.py gateway   # GET http://127.0.0.1:$OMNIRELAY_PORT/health
    python /opt/omnirelay/healthcheck.py metrics   # GET http://127.0.0.1:$OMNIRELAY_METRICS_PORT/metrics

``gateway``: 200 only when the bus is connected, an orchestrator is live and every stage has a live
replica, i.e. the whole pipeline can serve. ``metrics``: workers and the orchestrator open their
metrics port once their engine is loaded and they are subscribed to the bus, so an answer means ready.

Exit status 0 on HTTP 200, 1 otherwise; the reason goes to stdout, which ``docker inspect`` shows.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

CHECKS = {
    "gateway": ("OMNIRELAY_PORT", "8000", "/health"),
    "metrics": ("OMNIRELAY_METRICS_PORT", "9100", "/metrics"),
}


def probe_url(kind: str, env: dict[str, str]) -> str:
    var, default, path = CHECKS[kind]
    return f"http://127.0.0.1:{env.get(var) or default}{path}"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in CHECKS:
        print(f"usage: {argv[0]} {{{'|'.join(CHECKS)}}}")
        return 2
    url = probe_url(argv[1], dict(os.environ))
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:
            resp.read(65536)
            status = resp.status
    except urllib.error.HTTPError as e:
        print(f"{url}: HTTP {e.code} {e.read(300).decode(errors='replace')}")
        return 1
    except OSError as e:
        print(f"{url}: {e}")
        return 1
    if status != 200:
        print(f"{url}: HTTP {status}")
        return 1
    print(f"{url}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
