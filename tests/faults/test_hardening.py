"""Hostile input and hostile neighbours: a poison spool file, a flooded SSH port, a
member of control_group trying every verb.

Each is a row of the table; they need no Kubernetes. What the agent itself must change
for the other hardening rows (disk full mid-reclaim, the clock stepped back, a second
agent, host shutdown and boot) is wired in `Agent.run`, and those rows follow it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.scenario import Scenario, wait_lent
from tests.lab.lab import REPO, Lab
from tests.lab.helpers import free_port, keygen, public

pytestmark = pytest.mark.lab

CONTROL_GROUP = ("hostagent-ctl", 47913)

# A client of the control socket in the lab, as a member of control_group would run
# `hostagent VERB`: one request per verb, the result line of each.
CLIENT = r"""
import json, socket, sys
path, out = sys.argv[1], {}
for word in sys.argv[2:]:
    verb, _, vm = word.partition(":")
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(json.dumps({"v": 1, "verb": verb, "args": {"vm": vm} if vm else {}}).encode()
              + b"\n")
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        if b'"type":"result"' in data:
            break
    s.close()
    result = json.loads([l for l in data.splitlines() if b'"result"' in l][-1])
    out[word] = "ok" if result["ok"] else result["error"]
print(json.dumps(out))
"""

FLOODER = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    held.append(s)
print("flooding", flush=True)
time.sleep(600)
"""


def test_poison_spool_file(lab: Lab, fault: Scenario) -> None:
    """poison spool file (a time past a float): set aside, the agent starts and lends"""
    lab.spool.mkdir(parents=True, exist_ok=True)
    poison = lab.spool / f"{1:020d}-{'ab' * 16}.json"
    poison.write_text(json.dumps({"v": 1, "kind": "hook", "id": "ab" * 16, "time": 10**400,
                                  "domain": "gaming1", "op": "prepare", "sub": "begin",
                                  "extra": "-", "xml": ""}) + "\n")
    garbage = lab.spool / f"{2:020d}-{'cd' * 16}.json"
    garbage.write_bytes(b"\xff\xfe not an event")
    lab.write_config(relend_delay="1s")
    fault.fault()
    agent = lab.start_agent()
    assert agent.poll() is None, "the agent stopped on a poison spool file"
    wait_lent(lab)
    fault.recovered()
    bad = lab.spool / "bad"
    assert sorted(p.name for p in bad.iterdir()) == sorted([poison.name, garbage.name])
    assert not list(lab.spool.glob("*.json"))


def test_ssh_flood_during_a_reclaim(lab: Lab, fault: Scenario, tmp_path: Path) -> None:
    """SSH port flooded during a reclaim: hooks and control answer, descriptors bounded"""
    port = free_port()
    button = keygen(tmp_path / "button", "kitchen-button")
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    keys.write_text(f'verbs="status" {public(button)} button\n')
    keys.chmod(0o600)
    lab.write_config(lab.config_text(relend_delay="1s")
                     + f'\n[ssh]\nlisten = "127.0.0.1:{port}"\nauthorized_keys = "{keys}"\n')
    agent = lab.start_agent()
    wait_lent(lab)
    before = len(os.listdir(f"/proc/{agent.pid}/fd"))
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(port), "2000"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
        time.sleep(2)  # the agent accepts what it will
        fault.fault()
        assert fault.start_owner("gaming1").returncode != 0  # deferred: the hook answered
        peak = len(os.listdir(f"/proc/{agent.pid}/fd"))
        assert lab.status()["lendee"]["phase"] in ("draining", "stopping", "off")
        lab.wait_game("gaming1")
        fault.recovered()
        peak = max(peak, len(os.listdir(f"/proc/{agent.pid}/fd")))
    finally:
        flooder.kill()
        flooder.wait()
        if flooder.stdout is not None:
            flooder.stdout.close()
    assert peak - before < 64, f"{peak - before} descriptors more during the flood"
    ssh = [r for r in lab.records(event="ssh") if r["HOSTAGENT_RESULT"] != "listening"]
    assert len(ssh) < 50, f"{len(ssh)} ssh records for a flood of 2000 connections"


@pytest.fixture
def control_group(lab: Lab) -> Iterator[tuple[str, int]]:
    """A group in the lab's /etc/group (the namespace's own copy), for control_group."""
    group = lab.root / "group"
    before = group.read_text()
    name, gid = CONTROL_GROUP
    group.write_text(before + f"{name}:x:{gid}:\n")  # in place: the bind mount holds it
    try:
        yield CONTROL_GROUP
    finally:
        group.write_text(before)


def test_control_group_member_tries_every_verb(lab: Lab, fault: Scenario,
                                               control_group: tuple[str, int]) -> None:
    """a control_group member tries every verb: status, hold and resume only"""
    name, gid = control_group
    lab.write_config(f'control_group = "{name}"\n' + lab.config_text(relend_delay="1s"))
    lab.start_agent()
    wait_lent(lab)
    words = ["status", "play:gaming1", "release:gpu-node", "reclaim", "hold", "resume",
             "lend"]
    out = subprocess.run(lab.nsenter("setpriv", "--reuid=65534", "--regid=65534",
                                     f"--groups={gid}", sys.executable, "-I", "-c", CLIENT,
                                     "/run/hostagent/control.sock", *words),
                         capture_output=True, text=True, timeout=60, check=True)
    answers = json.loads(out.stdout)
    assert {w for w, a in answers.items() if a == "ok"} == {"status", "hold", "resume", "lend"}
    for word in ("play:gaming1", "release:gpu-node", "reclaim"):
        assert answers[word].startswith("denied: nobody may not use"), answers[word]
    # Nothing a member may not do happened; what it may do was journaled with its name.
    assert "gaming1" not in lab.running() and "gpu-node" in lab.running()
    assert lab.records(event="intent") == []
    asked = lab.records(event="control", result="allowed")
    assert {r["HOSTAGENT_VERB"] for r in asked} == {"hold", "resume", "lend"}
    assert {r["HOSTAGENT_USER"] for r in asked} == {"nobody"}


def test_a_second_agent(lab: Lab, fault: Scenario) -> None:
    """a second agent started: refused, the first keeps both sockets"""
    lab.write_config(relend_delay="1s")
    first = lab.start_agent()
    wait_lent(lab)
    hook, control = (lab.root / "run-hostagent" / f"{n}.sock" for n in ("hook", "control"))
    inodes = (hook.stat().st_ino, control.stat().st_ino)
    second = subprocess.run(lab.nsenter(str(REPO / ".venv" / "bin" / "hostagent"),
                                        "--config", str(lab.config),
                                        "--sysfs", str(lab.sysfs), "run"),
                            capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2, second
    assert "already running" in second.stderr and f"pid {first.pid}" in second.stderr
    assert first.poll() is None
    assert (hook.stat().st_ino, control.stat().st_ino) == inodes  # not stolen
    assert lab.status()["lendee"]["phase"] == "lent"
    fault.fault()
    assert fault.start_owner("gaming1").returncode != 0  # the first still answers hooks
    lab.wait_game("gaming1")
    fault.recovered()
