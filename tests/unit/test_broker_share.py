"""The broker's session gets a higher CPU weight than the others (libs/stack/local_nats.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from libs.stack.local_nats import BROKER_AUTOGROUP_NICE, raise_broker_share


def test_a_process_in_a_session_of_its_own_gets_the_brokers_autogroup_nice() -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        before = Path(f"/proc/{proc.pid}/autogroup").read_text()
        took = raise_broker_share(proc.pid)
        after = Path(f"/proc/{proc.pid}/autogroup").read_text()
    finally:
        proc.kill()
        proc.wait()
    assert before.split()[-1] == "0"
    if took:
        assert after.split()[-1] == str(BROKER_AUTOGROUP_NICE), after
    else:  # no autogroups, or no right to lower the value: nothing changed
        assert after == before


def test_a_process_that_is_gone_is_no_error() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert raise_broker_share(proc.pid) is False
