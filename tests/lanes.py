"""``make test``: the suite as two pytest sessions at once, so that the tests that mostly wait
(on a broker's redelivery back-off, a cluster forming, a mirror catching up, a registry entry
expiring) do not wait alone on an otherwise idle box.

- **The waiting lane** runs the modules of :data:`WAITING`: each keeps its two cores under half
  busy on its own (measured with ``vmstat`` beside a full run, ``results/testing/``) and times
  only what the broker and its own services do.
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
    for name in (
        "stage_mirror",
        "registry",
        "pull_consumer",
        "migration",
        "redelivery",
        "record_reads",
        "codec_worker",
        "gateway_stream_start",
        "orchestrator",
        "inspect_finds_stack",
        "nats_cluster",
        "error_paths",
        "failure_counts",
        "nats_permissions",
        "lost_messages",
    )
)
"""The waiting lane's modules, the least busy first: the main lane's start (collection, the e2e
stack's engines) keeps both cores busy for its first half minute."""


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
