"""``make test``: the suite as two pytest sessions at once, so that the tests that only wait
(on a broker's redelivery back-off, a stream mirror catching up after a kill, a registry entry
expiring) do not wait alone on an otherwise idle box.

- **The waiting lane** runs the modules of :data:`WAITING`.
- **The main lane** runs every other test, in pytest's order, on this terminal.

Each lane is a session of its own (its nats-server, its forker), as a run of those modules by hand
would be. The waiting lane's output is printed once the main lane ends; the run fails if either
lane does. With arguments, they are pytest's, and one session runs them (``PYTEST_ARGS``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

WAITING = tuple(
    f"tests/integration/test_{name}.py"
    for name in ("stage_mirror", "redelivery", "registry", "pull_consumer", "record_reads")
)
"""The waiting lane's modules: each keeps the two cores under a sixth busy on its own while it waits
on the broker (a restart, a redelivery back-off, an entry's TTL). Busier modules in this lane made
timing tests of both lanes fail (``results/testing/2026-12-07-two-lanes.md``)."""


def main(args: list[str]) -> int:
    """Run the suite (no ``args``) in two lanes and return the exit status; with ``args``, this
    process becomes pytest with them."""
    pytest = [sys.executable, "-m", "pytest"]
    if args:
        os.execv(sys.executable, [*pytest, *args])
    with tempfile.TemporaryFile("w+b") as out:
        waiting = subprocess.Popen([*pytest, *WAITING], stdout=out, stderr=subprocess.STDOUT)
        rest = subprocess.Popen([*pytest, *(f"--ignore={m}" for m in WAITING), "tests"])
        # Ctrl-C reaches both lanes from the terminal: each ends its session, and this waits for them.
        signal.signal(signal.SIGINT, lambda *_: None)
        rest_rc, waiting_rc = rest.wait(), waiting.wait()
        out.seek(0)
        print(f"\n=== the waiting lane ({len(WAITING)} modules; exit status {waiting_rc}) ===", flush=True)
        sys.stdout.buffer.write(out.read())
        sys.stdout.flush()
    return rest_rc or waiting_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
