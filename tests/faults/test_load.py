"""The agent pushed while it works: a disk whose every fsync takes a second, a player's
request repeated in a loop, one user flooding the control socket. Each during a
reclaim; in each, every hook libvirtd runs is answered (none spooled), nothing is lost,
and the agent's own records are all there.

Each is a row of the table; they need no Kubernetes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hostagent.surfaces.control import REQUESTS_BURST, REQUESTS_INTERVAL
from tests.faults.scenario import (
    Scenario,
    count,
    counted,
    wait_for,
    wait_lent,
)
from tests.lab.lab import DEFERRED, REPO, Lab
from tests.faults.helpers import (
    slow_disk,
)

pytestmark = pytest.mark.lab


# One user's client in a loop: malformed lines, and verbs naming VMs that do not exist
# (with a terminal escape for good measure), each on a connection of its own, for
# `seconds`. Prints how many it sent.
FLOOD = r"""
import json, socket, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
lines = [b"{not json \x1b]52;c;AAAA\x07\n",
         json.dumps({"v": 1, "verb": "release", "args": {"vm": "no-such-vm"}}).encode() + b"\n",
         json.dumps({"v": 1, "verb": "play", "args": {"vm": "gaming9\x1b[2J"}}).encode() + b"\n"]
sent, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(lines[sent % len(lines)])
    while s.recv(65536):
        pass
    s.close()
    sent += 1
print(sent, flush=True)
"""


def spooled(lab: Lab) -> list[str]:
    return sorted(p.name for p in lab.spool.glob("*.json"))


def phases_since(lab: Lab, at_us: int) -> list[str]:
    return [e["HOSTAGENT_TO"] for e in lab.records(event="phase")
            if int(e["__REALTIME_TIMESTAMP"]) >= at_us]


def test_slow_fsync(lab: Lab, fault: Scenario) -> None:
    """slow fsync (1 s each): hooks answered; virsh start refused with why, play starts it"""
    lab.write_config(relend_delay="1s")
    with slow_disk(lab, 1.0):
        lab.start_agent()
    wait_lent(lab, timeout=120)  # the lendee's own hooks, answered while its saves crawl
    fault.fault()
    # The request cannot be on disk within the hook's share of its budget: a refusal
    # with the reason, never a "will start by itself" that a crash would forget.
    out = fault.start_owner("gaming1", tries=1)
    assert out.returncode != 0 and "could not record the request" in out.stderr, out.stderr
    played = lab.hostagent("play", "gaming1")  # no budget: waits for the disk
    assert played.returncode == 0, played.stdout + played.stderr
    assert lab.state("gaming1") == "running"
    fault.recovered()
    assert spooled(lab) == []


def test_repeated_requests(lab: Lab, fault: Scenario) -> None:
    """play and hang up, 30 times from a reclaim on: one intent, one start, hooks answered"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    fault.fault()
    play = lab.nsenter(str(REPO / ".venv" / "bin" / "hostagent"), "--config", str(lab.config),
                       "play", "gaming1")
    for _ in range(30):
        proc = subprocess.Popen(play, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        proc.stdout.readline()  # the agent has the request: hang up
        proc.kill()
        proc.wait()
        proc.stdout.close()
    lab.wait_game("gaming1")
    fault.recovered()
    lab.wait_records(1, event="owner", to="running", vm="gaming1")
    assert count(lab, event="intent", to="pending", vm="gaming1") == 1
    assert counted(lab, 1, event="intent", to="done", vm="gaming1") == 1
    assert count(lab, event="owner", to="running", vm="gaming1") == 1
    assert spooled(lab) == []


def test_control_flood(lab: Lab, fault: Scenario) -> None:
    """control flood: one user's requests in a loop during a reclaim: its records capped"""
    lab.write_config(relend_delay="1s")
    lab.start_agent()
    wait_lent(lab)
    control = lab.root / "run-hostagent" / "control.sock"
    flooder = subprocess.Popen([sys.executable, "-I", "-c", FLOOD, str(control), "8"],
                               stdout=subprocess.PIPE, text=True)
    began = time.monotonic()
    at_us = time.time_ns() // 1000
    wait_for(lambda: count(lab, event="control", pid=str(flooder.pid)) > 0, 10, "the flood")
    fault.fault()
    out = fault.start_owner("gaming1")
    assert DEFERRED in out.stderr, out.stderr
    lab.wait_game("gaming1")
    fault.recovered()
    sent = int(flooder.communicate(timeout=60)[0])
    # Its share of records is spent, then counted: one more request once the interval
    # is over writes the summary of what was held back.
    time.sleep(max(0.0, began + REQUESTS_INTERVAL + 0.5 - time.monotonic()))
    lab.hostagent("release", "no-such-vm")
    written = count(lab, event="control", pid=str(flooder.pid))
    summaries = lab.records(event="control", result="summarised")
    assert sent > 100 and written <= REQUESTS_BURST, (sent, written)
    assert summaries and sum(int(e["HOSTAGENT_COUNT"]) for e in summaries) >= sent - REQUESTS_BURST
    assert not any("\x1b" in e.get("MESSAGE", "") or "gaming9" in e.get("MESSAGE", "")
                   for e in lab.records(event="control"))
    # The reclaim's own records are all there.
    assert {"draining", "stopping", "off"} <= set(phases_since(lab, at_us))
    assert counted(lab, 1, event="intent", to="done", vm="gaming1") == 1
    assert spooled(lab) == []
