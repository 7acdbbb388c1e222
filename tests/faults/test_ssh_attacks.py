"""The SSH endpoint attacked by what it trusts: a listed key opening thousands of
sessions on its connections during a reclaim, and an authorized-keys file reached
through a link that someone else flips.

Each is a row of the table; they need no Kubernetes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.scenario import Scenario, wait_for, wait_lent
from tests.lab.lab import DEFERRED, Lab
from tests.lab.helpers import OpenSsh, free_port, keygen, public
from tests.faults.helpers import (
    known_hosts,
    SESSION_FLOOD,
)

pytestmark = pytest.mark.lab

NOBODY = 65534


# Another user's link flipped as fast as it goes between a file root wrote and one of
# their own, while their key knocks (`n` connections, each trying `status`): a check by stat() and a read by name in between
# once read the second and granted that key every verb.
FLIPPER = r"""
import os, sys
link, good, evil = sys.argv[1:4]
tmp = link + ".new"
while True:
    for target in (good, evil):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(target, tmp)
        os.replace(tmp, link)
"""

KNOCKER = r"""
import asyncio, sys
import asyncssh
port, key, known, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

async def main():
    got_in = 0
    for _ in range(n):
        try:
            async with asyncssh.connect("127.0.0.1", port, username="hostagent",
                                        client_keys=[key], known_hosts=known,
                                        agent_path=None, config=None) as conn:
                got_in += (await conn.run("status")).exit_status == 0
        except (OSError, asyncssh.Error):
            pass
    print(got_in)

asyncio.run(main())
"""


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def ssh_on(lab: Lab, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The agent's SSH endpoint on a free port, with its authorized-keys file at the path
    yielded (written by the test) and the client's known_hosts made once it listens."""
    port = free_port()
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    keys.unlink(missing_ok=True)
    lab.write_config(lab.config_text(relend_delay="1s")
                     + f'\n[ssh]\nlisten = "127.0.0.1:{port}"\nauthorized_keys = "{keys}"\n')
    yield port, keys
    keys.unlink(missing_ok=True)


def test_ssh_session_flood_during_a_reclaim(lab: Lab, fault: Scenario, tmp_path: Path,
                                            ssh_on: tuple[int, Path]) -> None:
    """SSH session flood from a listed key during a reclaim: hooks answered, none spooled"""
    port, keys = ssh_on
    dashboard = keygen(tmp_path / "dashboard", "dashboard")
    keys.write_text(f'verbs="status" {public(dashboard)} dashboard\n')
    keys.chmod(0o600)
    agent = lab.start_agent()
    wait_lent(lab)
    known = known_hosts(lab, port, tmp_path)
    stats = tmp_path / "stats"
    before = descriptors(agent.pid)
    flooder = subprocess.Popen([sys.executable, "-c", SESSION_FLOOD, str(port), str(dashboard),
                                str(known), "4500", str(stats)],
                               stderr=subprocess.DEVNULL)  # its channels refused, by the thousand
    try:
        wait_for(lambda: stats.exists() and int(stats.read_text().split()[0]) >= 3, 60,
                 "the flood's first connections")
        fault.fault()
        out = fault.start_owner("gaming1")
        assert out.returncode != 0 and DEFERRED in out.stderr, out  # the agent answered
        peak = descriptors(agent.pid)
        lab.wait_game("gaming1")
        fault.recovered()
        peak = max(peak, descriptors(agent.pid))
    finally:
        flooder.kill()
        flooder.wait()
    connections, ran = (int(n) for n in stats.read_text().split())
    print(f"session flood: {connections} connections, {ran} commands run, "
          f"{peak - before} descriptors more at the peak")
    assert ran <= connections, "more than one command on a connection"
    assert peak - before < 64, f"{peak - before} descriptors more during the flood"
    assert not list(lab.spool.glob("*.json")), "hook events spooled during the flood"
    assert agent.poll() is None


def test_symlinked_authorized_keys_flipped_by_another_user(
        lab: Lab, fault: Scenario, tmp_path: Path, ssh_on: tuple[int, Path]) -> None:
    """symlinked authorized_keys, flipped by another user: their key never gets in"""
    port, keys = ssh_on
    button = keygen(tmp_path / "button", "button")
    intruder = keygen(tmp_path / "intruder", "intruder")
    good = keys.with_name("authorized_keys.root")
    good.write_text(f'verbs="status" {public(button)} button\n')
    good.chmod(0o644)
    # Their directory and their file, and root's link into it (an administrator who
    # trusted a path someone else can write).
    theirs = lab.root / "agent" / "theirs"
    theirs.mkdir(exist_ok=True)
    evil = theirs / "keys"
    evil.write_text(f'verbs="*",vms="*" {public(intruder)} intruder\n')
    evil.chmod(0o644)
    os.chown(theirs, NOBODY, NOBODY)
    os.chown(evil, NOBODY, NOBODY)
    flipping = theirs / "current"
    flipping.symlink_to(good)
    os.lchown(flipping, NOBODY, NOBODY)
    keys.symlink_to(flipping)
    lab.start_agent()
    wait_lent(lab)
    known = known_hosts(lab, port, tmp_path)
    fault.fault()
    # Run as root here (the lab's root directory is root's alone); the directory, the
    # link and the file it flips to are the other user's all the same.
    flipper = subprocess.Popen([sys.executable, "-I", "-c", FLIPPER, str(flipping), str(good),
                                str(evil)])
    try:
        knocks = subprocess.run([sys.executable, "-c", KNOCKER, str(port), str(intruder),
                                 str(known), "150"],
                                capture_output=True, text=True, timeout=300, check=True)
    finally:
        flipper.kill()
        flipper.wait()
    assert knocks.stdout.strip() == "0", "the intruder's key got in"
    ssh = lab.records(event="ssh")
    assert not [r for r in ssh if r.get("HOSTAGENT_KEY") == "intruder"]
    problems = [r["MESSAGE"] for r in ssh if r["HOSTAGENT_RESULT"] == "error"]
    assert any(f"{theirs}: owned by uid {NOBODY}, not root" in m and f"chown root {theirs}" in m
               for m in problems), problems
    # Fixed as the journal says: a file root owns, in a directory root owns. No restart.
    keys.unlink()
    keys.write_text(good.read_text())
    keys.chmod(0o644)
    out = OpenSsh(port, known)(button, "status")
    assert out.returncode == 0, out.stderr
    fault.recovered()
