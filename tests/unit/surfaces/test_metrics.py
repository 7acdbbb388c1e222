"""Metrics fed by the real machine, and the tiny HTTP server that serves them with the health
checks (the checks themselves: tests/unit/core/test_health.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

import pytest

import hostagent
from hostagent.core import config, machine
from hostagent.surfaces import metrics
from hostagent.surfaces.follow import format_status
from hostagent.core.health import CheckFailed, Health
from hostagent.core.model import (
    AgentUp,
    Drained,
    IntentSource,
    LendeeStarted,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerStopped,
    OwnerWants,
    Policy,
    RelendDue,
    ReturnFailed,
    State,
    Topology,
)
from tests.unit.metrics_scaffold import (
    Driver,
    MINIMAL,
)


def test_a_cycle_moves_every_metric() -> None:
    d = Driver()
    d(Observed, 100.0, lendee_running=False, owners_running=frozenset())
    assert d.value("hostagent_lendee_phase", phase="off") == 1
    assert d.value("hostagent_gpu_holder", gpu="gpu-a", vm="gpu-node") == 0
    assert d.value("hostagent_swaps_total", kind="lend") == 0
    assert d.value("hostagent_last_verification_timestamp_seconds") is None
    d.lend(100.0)
    assert d.value("hostagent_lendee_phase", phase="lent") == 1
    assert d.value("hostagent_lendee_phase", phase="off") == 0
    assert d.value("hostagent_gpu_holder", gpu="gpu-a", vm="gpu-node") == 1
    assert d.value("hostagent_gpu_holder", gpu="gpu-a", vm="gaming1") == 0
    assert d.value("hostagent_swaps_total", kind="lend") == 1
    assert d.value("hostagent_last_verification_timestamp_seconds") == 110.0
    # Booting lasted 5 s (101 → 106), joining 4 s; the OFF before it had no known start.
    assert d.value("hostagent_phase_duration_seconds_sum", phase="booting") == 5.0
    assert d.value("hostagent_phase_duration_seconds_count", phase="joining") == 1
    assert d.value("hostagent_phase_duration_seconds_count", phase="off") is None
    assert d.value("hostagent_swap_duration_seconds_sum", kind="lend") == 9.0

    d(OwnerWants, 200.0, owner="gaming1", intent_id="i1", source=IntentSource.HOOK)
    assert d.value("hostagent_pending_intents") == 1
    assert d.value("hostagent_lendee_phase", phase="draining") == 1
    d(Drained, 203.0)
    d(AgentUp, 204.0)
    d(LendeeStopped, 206.0)
    assert d.value("hostagent_swaps_total", kind="reclaim") == 1
    assert d.value("hostagent_swap_duration_seconds_sum", kind="reclaim") == 6.0
    assert d.value("hostagent_gpu_holder", gpu="gpu-a", vm="gpu-node") == 0
    d(OwnerStarted, 207.0, owner="gaming1")
    assert d.value("hostagent_gpu_holder", gpu="gpu-a", vm="gaming1") == 1
    assert d.value("hostagent_gpu_holder", gpu="gpu-b", vm="gaming2") == 0
    assert d.value("hostagent_pending_intents") == 0
    assert d.value("hostagent_lendee_phase", phase="off") == 1
    assert d.value("hostagent_failures_total", kind="return") == 0

    d.metrics.hook_event("prepare", "begin")
    d.metrics.hook_event("prepare", "begin")
    assert d.value("hostagent_hook_events_total", op="prepare", sub="begin") == 2
    assert b"hostagent_lendee_phase{phase=\"off\"} 1.0" in d.metrics.render()


def test_node_gpu_pods_is_absent_until_known() -> None:
    d = Driver()
    assert b"hostagent_node_gpu_pods" not in d.metrics.render().replace(b"# ", b"")
    d.metrics.node_gpu_pods(0)
    assert d.value("hostagent_node_gpu_pods") == 0
    d.metrics.node_gpu_pods(3)
    assert d.value("hostagent_node_gpu_pods") == 3
    d.metrics.node_gpu_pods(None)
    assert d.value("hostagent_node_gpu_pods") is None


def test_lent_gpu_pod_names_each_holder_and_forgets_those_gone() -> None:
    d = Driver()
    d.metrics.lent_gpu_pods({"gpu-a": "ml/train-1,ml/train-2", "gpu-b": "ml/eval"})
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-a", namespace="ml", pod="train-2") == 1
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-b", namespace="ml", pod="eval") == 1
    d.metrics.lent_gpu_pods({"gpu-b": "ml/eval"})
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-a", namespace="ml",
                   pod="train-1") is None
    d.metrics.lent_gpu_pods(None)
    assert d.value("hostagent_lent_gpu_pod", gpu="gpu-b", namespace="ml", pod="eval") is None

async def test_last_lend_verified_follows_the_lends() -> None:
    d = Driver()
    assert await d.metrics.lend_verified() == "no lend since the agent started"
    d(Observed, 0.5, lendee_running=False, owners_running=frozenset())
    d(RelendDue, 1.0)
    d(LendeeStarted, 2.0)
    d(AgentUp, 3.0)
    d(ReturnFailed, 4.0, reason="the node reports 1 of 2 GPUs")
    assert d.value("hostagent_failures_total", kind="return") == 1
    with pytest.raises(CheckFailed, match="was not verified: .*1 of 2 GPUs"):
        await d.metrics.lend_verified()
    # Reclaimed and lent again, this time whole.
    d(OwnerWants, 10.0, owner="gaming1", intent_id="i1", source=IntentSource.HOOK)
    d(Drained, 11.0)
    d(AgentUp, 12.0)
    d(LendeeStopped, 13.0)
    with pytest.raises(CheckFailed):
        await d.metrics.lend_verified()
    d(OwnerStarted, 14.0, owner="gaming1")
    d(OwnerStopped, 15.0, owner="gaming1")  # the game ended: lent again
    d.lend(20.0)
    assert (await d.metrics.lend_verified()).startswith("verified at ")


async def test_http_serves_metrics_and_healthz() -> None:
    d = Driver()
    h = Health(max_age=0)  # each request sees the switch at once
    ok = True

    async def switch() -> str:
        if not ok:
            raise CheckFailed("libvirt: not connected")
        return "fine"

    h.add("libvirt", switch)
    server = await metrics.serve(("127.0.0.1", 0), d.metrics, h, log=logging.getLogger("t"))
    port = server.sockets[0].getsockname()[1]

    def get(path: str, method: str = "GET") -> tuple[int, str, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.headers["Content-Type"], r.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.headers["Content-Type"], e.read()

    async with server:
        status, ctype, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert b'hostagent_health_check_success{check="libvirt"} 1.0' in body
        assert b'hostagent_lendee_phase{phase="off"} 1.0' in body
        status, ctype, body = await asyncio.to_thread(get, "/healthz")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body) == {"ok": True, "version": hostagent.version(), "checks": [
            {"check": "libvirt", "ok": True, "detail": "fine"}]}
        ok = False
        status, _, body = await asyncio.to_thread(get, "/healthz")
        assert status == 503
        assert json.loads(body)["checks"][0] == {"check": "libvirt", "ok": False,
                                                 "detail": "libvirt: not connected"}
        assert d.value("hostagent_health_check_success", check="libvirt") == 0
        assert (await asyncio.to_thread(get, "/healthz", "HEAD"))[::2] == (503, b"")
        assert (await asyncio.to_thread(get, "/nope"))[0] == 404
        assert (await asyncio.to_thread(get, "/metrics", "POST"))[0] == 405
        # Not HTTP at all: answered 400, and the server goes on.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 400 Bad Request\r\n")
        writer.close()
        await writer.wait_closed()
        assert (await asyncio.to_thread(get, "/"))[0] == 200


def test_metrics_listen_is_off_unless_set() -> None:
    assert config.parse(MINIMAL).metrics.address is None
    cfg = config.parse(MINIMAL + '[metrics]\nlisten = "127.0.0.1:9477"\n')
    assert cfg.metrics.listen == "127.0.0.1:9477"
    assert cfg.metrics.address == ("127.0.0.1", 9477)
    assert config.parse(MINIMAL + '[metrics]\nlisten = "[::1]:9477"\n').metrics.address == (
        "::1", 9477)
    assert config.parse(MINIMAL + '[metrics]\nlisten = ":9477"\n').metrics.address == ("", 9477)
    assert config.parse(MINIMAL + '[metrics]\nlisten = ""\n').metrics.address is None


@pytest.mark.parametrize("listen", ['"9477"', '"localhost"', '"host:0"', '"host:70000"', "9477"])
def test_metrics_listen_mistakes_name_the_key(listen: str) -> None:
    with pytest.raises(config.ConfigError, match=r"^t.toml: metrics.listen: "):
        config.parse(MINIMAL + f"[metrics]\nlisten = {listen}\n", "t.toml")


def test_status_shows_failed_checks() -> None:
    data: dict[str, Any] = {"lendee": {"domain": "gpu-node", "phase": "lent", "reason": None, "since": 0,
                       "hold": False},
            "gpus": [], "intents": [], "relend_in_s": None, "libvirt_connected": True,
            "health": [{"check": "libvirt", "ok": True, "detail": "connected"},
                       {"check": "hook socket", "ok": False,
                        "detail": "hook socket /run/hostagent/hook.sock: Connection refused"}]}
    text = format_status(data)
    assert "failed checks:\n  hook socket: hook socket /run/hostagent/hook.sock: " \
           "Connection refused" in text
    assert "libvirt: connected" not in text
    data["health"][1]["ok"] = True
    assert format_status(data).endswith("health: 2 checks pass")


def test_status_says_a_return_waits_for_the_kubelet_of_this_boot() -> None:
    data: dict[str, Any] = {"lendee": {"domain": "gpu-node", "phase": "joining", "reason": None, "since": 0,
                       "hold": False},
            "gpus": [], "intents": [], "relend_in_s": None, "libvirt_connected": True,
            "health": [],
            "cluster": {"waiting": "the kubelet of this boot: node gpu-node still shows "
                                   "bootID old, the guest's is new"}}
    assert "  its return is waiting for the kubelet of this boot: node gpu-node still " \
           "shows bootID old, the guest's is new" in format_status(data)


def test_every_owner_of_a_shared_gpu_has_a_holder_series() -> None:
    topo = Topology(lendee="gpu-node", lendee_gpus=frozenset({"gpu-a"}),
                    owners={"gaming1": frozenset({"gpu-a"}),
                            "gaming-win": frozenset({"gpu-a"})})
    m = metrics.Metrics(topo)
    event = Observed(at=1.0, lendee_running=False, owners_running=frozenset())
    new, _ = machine.step(State(), event, topo=topo, policy=Policy(relend_delay=0))
    m.transition(State(), new, event)
    for vm in ("gaming1", "gaming-win", "gpu-node"):
        assert m.registry.get_sample_value("hostagent_gpu_holder",
                                           {"gpu": "gpu-a", "vm": vm}) == 0
