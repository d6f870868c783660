"""A watch on the test session's nats-server, for the known limit "moments of broker silence
under load" (docs/reliability.md, "Known limits").

Every :data:`PERIOD_S` a thread asks the server's monitoring port for ``/varz``. When an answer
has not come after :data:`SLOW_S`, it records what the machine shows at that moment: the state and
kernel wait channel of each of the server's threads, the kernel's CPU / IO / memory pressure,
dirty and writeback memory, and the server's goroutines (its profiling port, which answers outside
the server's own locks). At the end of the session one line says how many silences there were and
where the records are (``broker-watch/`` in the session's base temp directory). Clocks:
``time.monotonic()`` for the latencies, wall time in the records' names.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_S = 0.5
"""Seconds between two questions."""
SLOW_S = 1.0
"""An answer later than this, seconds, is a silence worth a record."""
GIVE_UP_S = 30.0
"""A question unanswered this long counts as a silence of this length, seconds."""


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"({e})"


def _threads(pid: int) -> list[str]:
    """``<tid> <state> <wchan>`` of every thread of ``pid``."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        stat = _read(f"{task}/stat").rsplit(")", 1)[-1].split()
        out.append(f"{task.name} {stat[0] if stat else '?'} {_read(f'{task}/wchan')}")
    return out


def _schedstat(pid: int) -> dict[str, tuple[int, int]]:
    """Per thread of ``pid``: (ns on a CPU, ns runnable and waiting for one) since it started
    (``/proc/<pid>/task/<tid>/schedstat``)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        fields = _read(f"{task}/schedstat").split()
        if len(fields) >= 2 and fields[0].isdigit():
            out[task.name] = (int(fields[0]), int(fields[1]))
    return out


def _sched_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> str:
    """What the server's threads did from the moment the silence was noticed until the answer:
    seconds on a CPU and seconds runnable but waiting for one, in total and per thread."""
    rows = []
    for tid, (run, wait) in sorted(after.items()):
        run0, wait0 = before.get(tid, (0, 0))
        rows.append((tid, (run - run0) / 1e9, (wait - wait0) / 1e9))
    total_run, total_wait = sum(r for _, r, _ in rows), sum(w for _, _, w in rows)
    lines = [
        f"\nuntil the answer: on a CPU {total_run:.3f} s, waiting for a CPU {total_wait:.3f} s (all threads)"
    ]
    lines += [f"  thread {tid}: on a CPU {r:.3f} s, waiting {w:.3f} s" for tid, r, w in rows if r or w]
    return "\n".join(lines) + "\n"


def _meminfo() -> str:
    keep = ("Dirty:", "Writeback:", "MemAvailable:")
    return " ".join(
        " ".join(line.split()) for line in _read("/proc/meminfo").splitlines() if line.startswith(keep)
    )


@dataclass
class BrokerWatch:
    """Watches one server: its pid, monitoring port and profiling port; records into ``out``."""

    pid: int
    monitor_port: int
    profile_port: int
    out: Path
    silences: list[tuple[str, float]] = field(default_factory=list)
    """(wall-clock time, seconds without an answer) of each silence."""
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, name="broker-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> str:
        if not self.silences:
            return f"broker watch: no /varz answer took over {SLOW_S:g} s"
        when, longest = max(self.silences, key=lambda s: s[1])
        return (
            f"broker watch: {len(self.silences)} silence(s) over {SLOW_S:g} s, the longest {longest:.1f} s "
            f"at {when}; records in {self.out}"
        )

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            answered = threading.Event()
            asked = time.monotonic()
            threading.Thread(target=self._ask, args=(answered,), daemon=True).start()
            if answered.wait(SLOW_S):
                continue
            before = _schedstat(self.pid)
            record = self._record()
            answered.wait(GIVE_UP_S)
            took = time.monotonic() - asked
            self.silences.append((time.strftime("%H:%M:%S"), took))
            with record.open("a") as out:
                out.write(_sched_delta(before, _schedstat(self.pid)))
            record.rename(record.with_name(f"{record.stem}-{took:.1f}s.txt"))

    def _ask(self, answered: threading.Event) -> None:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/varz", timeout=GIVE_UP_S).read()
        answered.set()

    def _record(self) -> Path:
        """What the machine shows now, written to a file of its own."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"silence-{time.strftime('%H%M%S')}-{time.monotonic_ns()}.txt"
        lines = [
            f"threads of nats-server {self.pid} (tid state wchan):",
            *_threads(self.pid),
            "pressure: "
            + " | ".join(
                f"{k} {_read(f'/proc/pressure/{k}').splitlines()[0]}" for k in ("cpu", "io", "memory")
            ),
            f"memory: {_meminfo()}",
            f"load: {_read('/proc/loadavg').strip()}",
            "goroutines:",
        ]
        try:
            url = f"http://127.0.0.1:{self.profile_port}/debug/pprof/goroutine?debug=2"
            lines.append(urllib.request.urlopen(url, timeout=10).read().decode(errors="replace"))
        except OSError as e:
            lines.append(f"(profiling port: {e})")
        path.write_text("\n".join(lines))
        return path
