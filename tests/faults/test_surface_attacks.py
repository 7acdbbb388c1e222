"""The agent's network surfaces attacked by anyone on the network during a reclaim: idle
connections from the button's /24 on the SSH port, a key holder and a key offerer in a
loop flooding the journal, a slowloris on the metrics port.

Each is a row of the table, with its figure (printed at the end of the run, see
tests/figures.py); they need no Kubernetes. The attackers run in processes of their own.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.surfaces.ssh import PEER_BURST, PEER_INTERVAL

from tests.faults.scenario import Scenario, wait_for, wait_lent
from tests.faults.helpers import known_hosts
from tests.lab.lab import DEFERRED, Lab
from tests.lab.helpers import free_port, keygen, public

pytestmark = pytest.mark.lab

# `n` connections from each of the addresses given that send `first` (an SSH version
# line, or a request line and one header) and nothing more, each back the moment it is
# closed; "holding" once `settle` seconds have let them all in (those past a listen
# queue get in on their SYN's second try).
HOLDING = r"""
import asyncio, sys
port, first, settle, n, sources = (int(sys.argv[1]), sys.argv[2].encode().decode(
    "unicode_escape").encode(), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])

async def hold(source):
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(source, 0))
        except OSError:
            await asyncio.sleep(0.01)
            continue
        try:
            writer.write(first)
            await reader.read()
        except OSError:
            pass
        writer.close()

async def main():
    tasks = [asyncio.create_task(hold(s)) for s in sources for _ in range(n)]
    await asyncio.sleep(settle)
    print("holding", flush=True)
    await asyncio.gather(*tasks)

asyncio.run(main())
"""
SSH_VERSION = r"SSH-2.0-OpenSSH_9.2\r\n"
HALF_REQUEST = r"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # never the blank line

# The button, from 127.0.0.1: `presses` connections each running `status`; prints one
# JSON list of [exit status or error, seconds] per press.
PRESSER = r"""
import asyncio, json, sys, time
import asyncssh
port, key, known, presses = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])

async def main():
    results = []
    for _ in range(presses):
        started = time.monotonic()
        try:
            async with asyncssh.connect("127.0.0.1", port, username="hostagent",
                                        client_keys=[key], known_hosts=known,
                                        agent_path=None, config=None, password_auth=False,
                                        kbdint_auth=False, local_addr=("127.0.0.1", 0)) as c:
                outcome = (await c.run("status")).exit_status
        except (OSError, asyncssh.Error) as e:
            outcome = type(e).__name__
        results.append([outcome, time.monotonic() - started])
        await asyncio.sleep(0.2)
    print(json.dumps(results))

asyncio.run(main())
"""

# For `seconds`, from `source`, connections one after another: "holder" runs `status`
# with the listed key; "offerer" offers the listed public key and signs with another
# (it has the public key alone). Prints how many connections it made.
LOOPER = r"""
import asyncio, sys, time
import asyncssh
port, key, known, who, source, seconds = (int(sys.argv[1]), *sys.argv[2:6],
                                          float(sys.argv[6]))
listed = asyncssh.read_private_key(key)
if who == "offerer":
    pair = asyncssh.load_keypairs([asyncssh.generate_private_key("ssh-ed25519")])[0]
    pair.public_data = listed.public_data
else:
    pair = listed

async def main():
    made = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        made += 1
        try:
            async with asyncssh.connect("127.0.0.1", port, username="hostagent",
                                        client_keys=[pair], known_hosts=known,
                                        agent_path=None, config=None, password_auth=False,
                                        kbdint_auth=False, local_addr=(source, 0)) as c:
                await c.run("status")
        except (OSError, asyncssh.Error):
            pass
    print(made)

asyncio.run(main())
"""

# Scrapes /metrics `n` times, one after another; prints [status line, seconds] each.
SCRAPER = r"""
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
results = []
for _ in range(n):
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        line = data.split(b"\r\n", 1)[0].decode()
    except OSError as e:
        line = type(e).__name__
    results.append([line, time.monotonic() - started])
    time.sleep(0.2)
print(json.dumps(results))
"""


def spawn(script: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.communicate()


def spread(seconds: list[float]) -> str:
    return (f"median {statistics.median(seconds) * 1000:.0f} ms, "
            f"worst {max(seconds) * 1000:.0f} ms")


@pytest.fixture
def button(lab: Lab, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """SSH and metrics on free ports, a listed key (status only), the agent lent."""
    port, scrape = free_port(), free_port()
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    key = keygen(tmp_path / "button", "button")
    keys.write_text(f'verbs="status" {public(key)} button\n')
    keys.chmod(0o600)
    lab.write_config(lab.config_text(relend_delay="1s")
                     + f'\n[ssh]\nlisten = "127.0.0.1:{port}"\nauthorized_keys = "{keys}"\n'
                     + f'\n[metrics]\nlisten = "127.0.0.1:{scrape}"\n')
    agent = lab.start_agent()
    wait_lent(lab)
    yield {"port": port, "metrics": scrape, "key": key,
           "known": known_hosts(lab, port, tmp_path), "agent": agent}
    keys.unlink(missing_ok=True)


def spooled(lab: Lab) -> list[str]:
    """The hook events spooled (each as 'domain op sub')."""
    return [" ".join(str(json.loads(f.read_text()).get(k)) for k in ("domain", "op", "sub"))
            for f in sorted(lab.spool.glob("*.json"))]


def reclaim(lab: Lab, fault: Scenario) -> None:
    fault.fault()
    out = fault.start_owner("gaming1")
    assert out.returncode != 0 and DEFERRED in out.stderr, out  # the hook was answered


def presses(b: dict[str, Any], n: int) -> list[list[Any]]:
    out = subprocess.run([sys.executable, "-c", PRESSER, str(b["port"]), str(b["key"]),
                          str(b["known"]), str(n)],
                         capture_output=True, text=True, timeout=120, check=True)
    result: list[list[Any]] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("n", [5, 50])
def test_idle_connections_from_the_buttons_network(
        lab: Lab, fault: Scenario, button: dict[str, Any], n: int,
        record_property: Any) -> None:
    """{n} idle SSH connections from the button's /24 during a reclaim: every press served"""
    assert presses(button, 1)[0][0] == 0  # a button that has been pressed before
    strangers = spawn(HOLDING, button["port"], SSH_VERSION, 1, 1,
                      *(f"127.0.0.{10 + i}" for i in range(n)))
    try:
        assert strangers.stdout is not None and strangers.stdout.readline() == "holding\n"
        reclaim(lab, fault)
        pressed = presses(button, 10)
        lab.wait_game("gaming1")
        fault.recovered()
    finally:
        stop(strangers)
    record_property("figure", f"{n} idle connections: the button's status over SSH, "
                    f"{sum(p[0] == 0 for p in pressed)} of {len(pressed)} served, "
                    + spread([p[1] for p in pressed]))
    assert [p[0] for p in pressed] == [0] * 10, pressed
    assert not spooled(lab), f"hook events spooled during the attack: {spooled(lab)}"
    assert button["agent"].poll() is None


def test_a_key_holder_and_a_key_offerer_in_a_loop(
        lab: Lab, fault: Scenario, button: dict[str, Any], record_property: Any) -> None:
    """a key holder and a key offerer in a loop over SSH during a reclaim: records capped, transitions kept"""
    seconds = 20.0
    since = time.time_ns() // 1000
    loopers = {who: spawn(LOOPER, button["port"], button["key"], button["known"], who,
                          source, seconds)
               for who, source in (("holder", "127.0.0.2"), ("offerer", "127.0.0.3"))}
    try:
        wait_for(lambda: any(r.get("HOSTAGENT_RESULT") == "known" for r in lab.records(
            event="ssh")), 30, "the loops' first connections")
        reclaim(lab, fault)
        lab.wait_game("gaming1")
        fault.recovered()
        made = {who: int(p.communicate(timeout=seconds + 60)[0]) for who, p in loopers.items()}
    finally:
        for p in loopers.values():
            if p.poll() is None:
                stop(p)
    records = [r for r in lab.records(event="ssh")
               if int(r["__REALTIME_TIMESTAMP"]) >= since]
    by = {who: [r for r in records if r.get("HOSTAGENT_PEER", "").startswith(source + ":")
                or r.get("HOSTAGENT_PEER") == source]
          for who, source in (("holder", "127.0.0.2"), ("offerer", "127.0.0.3"))}
    figures = ", ".join(f"{who} {made[who] / seconds:.0f} connections/s, "
                        f"{len(by[who]) / seconds:.1f} records/s" for who in made)
    record_property("figure", f"journal under an SSH loop over {seconds:g}s: {figures}, "
                    f"{len(records) / seconds:.1f} SSH records/s in all")
    # One network's records: PEER_BURST per PEER_INTERVAL, a summary
    # for each interval after, and what comes before authentication (20 a minute).
    for who in made:
        assert len(by[who]) <= PEER_BURST * (seconds / PEER_INTERVAL + 1) \
            + seconds / PEER_INTERVAL + 1, (who, len(by[who]))
    assert made["holder"] > PEER_BURST and made["offerer"] > PEER_BURST  # they did flood
    # The reclaim's transitions, every one journaled (none counted with the flood).
    after = [r["HOSTAGENT_TO"] for r in lab.records(event="phase")
             if int(r["__REALTIME_TIMESTAMP"]) >= since]
    assert {"draining", "stopping", "off"} <= set(after), after
    assert button["agent"].poll() is None


def test_a_slowloris_on_the_metrics_port(
        lab: Lab, fault: Scenario, button: dict[str, Any], record_property: Any) -> None:
    """slowloris on the metrics port from four addresses during a reclaim: every scrape answered"""
    attack = spawn(HOLDING, button["metrics"], HALF_REQUEST, 3, 4,
                   *(f"127.0.0.{n}" for n in range(2, 6)))
    try:
        assert attack.stdout is not None and attack.stdout.readline() == "holding\n"
        reclaim(lab, fault)
        out = subprocess.run([sys.executable, "-c", SCRAPER, str(button["metrics"]), "10"],
                             capture_output=True, text=True, timeout=180, check=True)
        lab.wait_game("gaming1")
        fault.recovered()
    finally:
        stop(attack)
    scrapes: list[list[Any]] = json.loads(out.stdout)
    record_property("figure", "slowloris, 16 connections from 4 addresses: scrapes "
                    f"{sum(s[0] == 'HTTP/1.1 200 OK' for s in scrapes)} of {len(scrapes)} "
                    "answered, " + spread([s[1] for s in scrapes]))
    assert [s[0] for s in scrapes] == ["HTTP/1.1 200 OK"] * 10, scrapes
    assert not spooled(lab), f"hook events spooled during the attack: {spooled(lab)}"
    assert button["agent"].poll() is None
