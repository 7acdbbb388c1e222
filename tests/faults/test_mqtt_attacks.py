"""The MQTT side attacked by a broker user with write access: a retained discovery
message nested past any parser's depth, a 15 MB message, junk on the command topics
while the gaming1 switch is pressed, and the broker restarted again and again.

A real mosquitto (tests/mosquitto.py) and mosquitto's own clients; each attack is a row
of the table, its figure printed (`pytest -s`). They need no Kubernetes.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.scenario import Scenario, count, wait_for, wait_lent
from tests.lab.lab import DEFERRED, Lab
from tests.mosquitto import MISSING, USERS, Mosquitto

pytestmark = [pytest.mark.lab, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

DEVICE = "homeassistant/device/hostagent/config"


@pytest.fixture
def broker(lab: Lab) -> Iterator[Mosquitto]:
    m = Mosquitto(lab.root / "mosquitto")
    m.start()
    lab.write_config(lab.config_text(relend_delay="1s") + (
        f'\n[mqtt]\nbroker = "mqtt://127.0.0.1:{m.port}"\nusername = "hostagent"\n'
        f'password_file = "{m.root / "agent-password"}"\nbase_topic = "hostagent"\n'))
    yield m
    m.stop()


def publish(broker: Mosquitto, topic: str, payload: Path, *, retain: bool = False,
            lines: bool = False) -> None:
    """Home Assistant's user publishes the file (each line a message with `lines`)."""
    pub = shutil.which("mosquitto_pub")
    assert pub is not None
    argv = [pub, "-p", str(broker.port), "-u", "ha", "-P", USERS["ha"], "-q", "1",
            "-t", topic, *(["-r"] if retain else [])]
    if lines:
        with payload.open("rb") as stdin:
            subprocess.run([*argv, "-l"], stdin=stdin, check=True, timeout=300)
    else:
        subprocess.run([*argv, "-f", str(payload)], check=True, timeout=300)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def connected(lab: Lab) -> int:
    return count(lab, event="mqtt", result="connected")


def test_a_retained_discovery_message_nested_past_any_parser(
        lab: Lab, fault: Scenario, broker: Mosquitto, tmp_path: Path) -> None:
    """MQTT: a retained discovery message nested 100,000 deep, read at every start"""
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000)
    publish(broker, DEVICE, nested, retain=True)
    agent = lab.start_agent()
    fault.fault()
    lab.wait_records(1, event="mqtt", result="dropped")
    wait_lent(lab)
    # It was read at this start, dropped, and the agent's own discovery replaced it; a
    # restart meets it again all the same.
    publish(broker, DEVICE, nested, retain=True)
    lab.stop_agent()
    agent = lab.start_agent()
    lab.wait_records(2, event="mqtt", result="dropped")
    lab.wait_records(2, event="mqtt", result="connected")
    dropped = lab.records(event="mqtt", result="dropped")
    print(f"nested discovery: {len(dropped)} drops journaled over 2 starts, agent up")
    assert agent.poll() is None, "the agent ended"
    assert all(r["MESSAGE"].isprintable() for r in dropped)
    fault.recovered()


def test_a_15_mb_message_during_a_reclaim(lab: Lab, fault: Scenario, broker: Mosquitto,
                                          tmp_path: Path) -> None:
    """MQTT: three 15 MB messages with control characters while gaming1 starts"""
    agent = lab.start_agent()
    wait_lent(lab)
    lab.wait_records(1, event="mqtt", result="connected")
    before = rss_mb(agent.pid)
    big = tmp_path / "big"
    big.write_bytes(b"\x1b[2J\x07\x00" * (15 * 1024 * 1024 // 6))
    fault.fault()
    senders = [subprocess.Popen(
        [shutil.which("mosquitto_pub") or "mosquitto_pub", "-p", str(broker.port), "-u", "ha",
         "-P", USERS["ha"], "-q", "1", "-t", topic, "-f", str(big)])
        for topic in (DEVICE, "hostagent/owner/gaming1/set", "homeassistant/status")]
    out = fault.start_owner("gaming1")
    assert out.returncode != 0 and DEFERRED in out.stderr, out  # the hook was answered
    for sender in senders:
        assert sender.wait(300) == 0
    lab.wait_game("gaming1")
    fault.recovered()
    after = rss_mb(agent.pid)
    spooled = len(list(lab.spool.glob("*.json")))
    print(f"15 MB messages: agent RSS {before:.0f} MB before, {after:.0f} MB after, "
          f"{spooled} hook events spooled")
    assert agent.poll() is None
    assert spooled == 0, "hook events spooled while the messages came"
    assert after - before < 50, f"the agent grew from {before:.0f} to {after:.0f} MB"
    assert count(lab, event="mqtt", result="connected") == 1, "the connection was lost"
    assert not [r for r in lab.records() if not r["MESSAGE"].isprintable()]


def test_junk_on_the_command_topics_while_gaming1_is_switched_on(
        lab: Lab, fault: Scenario, broker: Mosquitto, tmp_path: Path) -> None:
    """MQTT: 40,000 junk commands on two topics while gaming1 is switched on"""
    agent = lab.start_agent()
    wait_lent(lab)
    lab.wait_records(1, event="mqtt", result="connected")
    junk = tmp_path / "junk"
    junk.write_text("please\n" * 20_000)
    fault.fault()
    senders = []
    for topic in ("hostagent/owner/gaming1/set", "hostagent/hold/set"):
        with junk.open("rb") as stdin:
            senders.append(subprocess.Popen(
                [shutil.which("mosquitto_pub") or "mosquitto_pub", "-p", str(broker.port),
                 "-u", "ha", "-P", USERS["ha"], "-q", "0", "-t", topic, "-l"], stdin=stdin))
    try:
        wait_for(lambda: count(lab, event="control", result="refused") > 0, 60,
                 "the junk to be refused")
        on = tmp_path / "on"
        on.write_text("ON")
        publish(broker, "hostagent/owner/gaming1/set", on)
        lab.wait_game("gaming1")
        fault.recovered()
    finally:
        for sender in senders:
            sender.wait(300)
    refused = lab.records(event="control", result="refused")
    served = lab.records(event="control", result="allowed")
    print(f"junk: 40,000 sent, {len(refused)} refusal records journaled (rate-limited); "
          f"valid presses served {len(served)} of 1")
    assert [r["MESSAGE"] for r in served] == ["mqtt asked for play gaming1"]
    assert agent.poll() is None


def test_the_broker_restarted_again_and_again(lab: Lab, fault: Scenario, broker: Mosquitto
                                              ) -> None:
    """MQTT: the broker restarted 6 times: the wait to reconnect does not grow"""
    agent = lab.start_agent()
    wait_lent(lab)
    lab.wait_records(1, event="mqtt", result="connected")
    fault.fault()
    waits = []
    for n in range(2, 8):
        broker.stop()
        broker.start()
        at = time.monotonic()
        lab.wait_records(n, timeout=120, event="mqtt", result="connected")
        waits.append(time.monotonic() - at)
    fault.recovered()
    print("broker restarts: reconnected after " + ", ".join(f"{w:.1f}" for w in waits) + " s")
    assert agent.poll() is None
    # Before a good connection reset the backoff, the delays doubled at each restart
    # (1, 2, 4, 8, 16, 32 s): the sixth waited as long as the first five together.
    assert waits[-1] < sum(waits[:-1]) + 1, waits
