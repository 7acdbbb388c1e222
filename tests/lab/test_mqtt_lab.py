"""Home Assistant over MQTT, end to end in the lab: a real mosquitto with its password
and ACL files (tests/mosquitto.py), the agent publishing to it, and mosquitto's own
clients playing Home Assistant (`mosquitto_pub` as the switch, `mosquitto_sub` as the
dashboard, recording every message it sees with its time).

One agent start: the device appears, switching gaming1 on over MQTT runs the whole
reclaim and its state follows; the broker is stopped in the middle of that reclaim and
started again empty (no persistence) and loses nothing the agent knows; a client the ACL
forbids and a payload that is not a command change nothing; switching gaming1 off
gives its GPU back, and every phase of that lend shows over MQTT in order.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.lab.lab import Lab
from tests.lab.helpers import wait_lent
from tests.mosquitto import DEVICE, MISSING, USERS, Dashboard, Mosquitto
from tests.unit.homeassistant_scaffold import check_device_message
from tests.lab.helpers import (
    publish,
)

pytestmark = [pytest.mark.lab, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]
@pytest.fixture
def broker(lab: Lab) -> Iterator[Mosquitto]:
    m = Mosquitto(lab.root / "mosquitto")
    m.start()
    yield m
    m.stop()


def test_home_assistant_switches_gaming1_through_a_broker_restart(
        lab: Lab, broker: Mosquitto) -> None:
    lab.partial = False  # one lend and one reclaim: the subject is what MQTT shows of them
    dashboard = Dashboard(broker, lab.root / "dashboard.log")
    dashboard.start()
    try:
        lab.write_config(lab.config_text() + (
            f'\n[mqtt]\nbroker = "mqtt://127.0.0.1:{broker.port}"\nusername = "hostagent"\n'
            f'password_file = "{broker.root / "agent-password"}"\nbase_topic = "hostagent"\n'))
        lab.start_agent()
        wait_lent(lab)
        dashboard.wait("hostagent/phase/state", "lent")
        dashboard.wait("hostagent/availability", "online")
        device = dashboard.last(DEVICE)
        assert device is not None
        cmps = check_device_message(DEVICE, device)["cmps"]
        assert {"owner_gaming1", "owner_gaming2", "owner_gaming-win", "gpu_gpu-a", "lent",
                "phase", "live_gpus", "transition", "hold", "reclaim", "lend"} <= set(cmps)
        dashboard.wait("hostagent/live_gpus/state", "gpu-a, gpu-b, gpu-c")  # after the phase
        assert dashboard.last("hostagent/gpu/gpu-a/state") == "gpu-node"

        # Refused: a client the ACL forbids, a payload that is no command.
        publish(broker, "hostagent/owner/gaming1/set", "ON", user="intruder")
        publish(broker, "hostagent/owner/gaming1/set", "please")
        lab.wait_record(event="control", result="refused", via="mqtt")

        # The switch: gaming1 on. The broker goes away while gpu-node is reclaimed, and
        # comes back empty: the reclaim goes on, and the broker gets everything again.
        publish(broker, "hostagent/owner/gaming1/set", "ON")
        lab.wait_record(event="phase", to="draining")
        broker.stop()
        lab.wait_game("gaming1")
        broker.start()
        dashboard.stop()  # mosquitto_sub does not reconnect: a new one
        dashboard.start()
        dashboard.wait("hostagent/owner/gaming1/state", "ON")
        dashboard.wait("hostagent/availability", "online")
        # Everything is sent again, in its order: the phase comes after the owners.
        dashboard.wait("hostagent/phase/state", "off")
        assert dashboard.last("hostagent/lent/state") == "OFF"
        assert dashboard.last("hostagent/gpu/gpu-a/state") == "gaming1"
        dashboard.wait("hostagent/live_gpus/state", "none")  # sent after the phase
        retained = subprocess.run(
            ["mosquitto_sub", "-p", str(broker.port), "-u", "ha", "-P", USERS["ha"],
             "-t", DEVICE, "-C", "1", "-W", "30"], capture_output=True, text=True, timeout=60)
        check_device_message(DEVICE, retained.stdout.strip())

        # Off: gaming1 shuts down and gpu-node is lent again, every phase shown in order.
        lab.wait_agent("gaming1")
        seen_before = len(dashboard.messages())
        publish(broker, "hostagent/owner/gaming1/set", "OFF")
        lab.wait_state("gaming1", "shut off", timeout=120)
        wait_lent(lab, after=1, timeout=240)
        dashboard.wait("hostagent/phase/state", "lent")
        dashboard.wait("hostagent/owner/gaming1/state", "OFF")
        # A state replaced before it was sent goes once (the newest): joining may be
        # followed by lent within a millisecond here, with no cluster to return to.
        phases = [p for _, t, p in dashboard.messages()[seen_before:]
                  if t == "hostagent/phase/state"]
        assert phases in (["booting", "joining", "lent"], ["booting", "lent"]), phases
        dashboard.wait("hostagent/transition/state",  # sent after the phase
                       lambda sentence: sentence.startswith("gpu-node is lent"))
    finally:
        dashboard.stop()
        latencies(lab, dashboard)

    asked = [r["MESSAGE"] for r in lab.records(event="control", result="allowed")]
    assert asked == ["mqtt asked for play gaming1", "mqtt asked for release gaming1"]
    assert all(r["HOSTAGENT_VIA"] == "mqtt" for r in lab.records(event="control"))
    refused = [r["MESSAGE"] for r in lab.records(event="control", result="refused")]
    assert refused == ['refused from MQTT: "please" on hostagent/owner/gaming1/set: '
                       "expected ON or OFF"]
    assert lab.state("gaming1") == "shut off"


def latencies(lab: Lab, dashboard: Dashboard) -> None:
    """Print how long each phase record took to show over MQTT (measured, not asserted:
    `pytest -s` shows it)."""
    shown = [(at, p) for at, t, p in dashboard.messages() if t == "hostagent/phase/state"]
    for record in lab.records(event="phase"):
        at = int(record["__REALTIME_TIMESTAMP"]) / 1e6
        later = [s for s, p in shown if p == record["HOSTAGENT_TO"] and s >= at - 0.001]
        if later:
            print(f"phase {record['HOSTAGENT_TO']} over MQTT after {later[0] - at:.3f}s")
