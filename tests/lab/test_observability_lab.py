"""Observability end to end: metrics scraped over HTTP, /healthz, history from the journal.

One agent, one cycle (lend, gaming1 reclaims gpu-a, the game ends, lend again), then
libvirtd stopped under the running agent: every check rides on the same cycle because
an agent start and a cycle cost tens of seconds.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lab.lab import Lab
from tests.waiting import wait_until

pytestmark = pytest.mark.lab

SVG = "{http://www.w3.org/2000/svg}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read()

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        status, body = self.get("/metrics")
        assert status == 200
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(body.decode())
                for s in family.samples}

    def healthz(self) -> tuple[int, dict[str, Any]]:
        status, body = self.get("/healthz")
        return status, json.loads(body)


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """The sample's value; NaN where there is none, which no comparison holds for."""
    return samples.get((name, frozenset(labels.items())), float("nan"))


def lent_count(lab: Lab) -> int:
    return len(lab.records(event="phase", to="lent"))


def test_metrics_health_and_history_follow_a_cycle(lab: Lab, tmp_path: Path) -> None:
    # All or nothing: one reclaim and one lend to count (a GPU lent while another is in
    # a game is drawn by tests/unit/surfaces/test_history.py).
    lab.partial = False
    port = free_port()
    lab.write_config(lab.config_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    since = f"@{lab.mark_us / 1e6:.6f}"
    lab.start_agent()
    scrape = Scraper(port)
    lab.wait_record(event="phase", to="lent")

    # Lent: every GPU is gpu-node's, one lend counted and verified, every check passes.
    m = scrape.metrics()
    assert value(m, "hostagent_lendee_phase", phase="lent") == 1
    assert value(m, "hostagent_lendee_phase", phase="off") == 0
    for gpu, owner in (("gpu-a", "gaming1"), ("gpu-a", "gaming-win"), ("gpu-b", "gaming2")):
        assert value(m, "hostagent_gpu_holder", gpu=gpu, vm="gpu-node") == 1
        assert value(m, "hostagent_gpu_holder", gpu=gpu, vm=owner) == 0
    assert value(m, "hostagent_gpu_holder", gpu="gpu-c", vm="gpu-node") == 1  # owned by nobody
    assert value(m, "hostagent_swaps_total", kind="lend") == 1
    assert value(m, "hostagent_swaps_total", kind="reclaim") == 0
    assert value(m, "hostagent_last_verification_timestamp_seconds") > time.time() - 120
    assert value(m, "hostagent_pending_intents") == 0
    status, health = scrape.healthz()
    assert status == 200, health
    assert [c["check"] for c in health["checks"]] == ["libvirt", "hook socket",
                                                      "last lend verified", "state file",
                                                      "domains"]
    assert value(m, "hostagent_health_check_success", check="libvirt") == 1

    # gaming1 is started through libvirt: deferred, reclaimed, started by the agent.
    assert lab.ask("gaming1").returncode != 0
    lab.wait_game("gaming1")
    lab.wait_record(event="owner", vm="gaming1", to="running")
    m = scrape.metrics()
    assert value(m, "hostagent_lendee_phase", phase="off") == 1
    assert value(m, "hostagent_gpu_holder", gpu="gpu-a", vm="gaming1") == 1
    assert value(m, "hostagent_gpu_holder", gpu="gpu-a", vm="gpu-node") == 0
    assert value(m, "hostagent_gpu_holder", gpu="gpu-b", vm="gpu-node") == 0
    assert value(m, "hostagent_gpu_holder", gpu="gpu-b", vm="gaming2") == 0
    assert value(m, "hostagent_swaps_total", kind="reclaim") == 1
    assert value(m, "hostagent_swap_duration_seconds_count", kind="reclaim") == 1
    assert value(m, "hostagent_phase_duration_seconds_count", phase="draining") == 1
    assert value(m, "hostagent_pending_intents") == 0
    # The deferred start and the agent's own start both ran prepare begin.
    assert value(m, "hostagent_hook_events_total", op="prepare", sub="begin") >= 2
    assert value(m, "hostagent_hook_events_total", op="started", sub="begin") >= 1

    # The game ends: lent again.
    lab.wait_agent("gaming1")
    lab.virsh("shutdown", "--mode", "agent", "gaming1")
    wait_until(lambda: lent_count(lab) == 2, "the second lend", timeout=90, every=0.2)
    m = scrape.metrics()
    assert value(m, "hostagent_swaps_total", kind="lend") == 2
    assert value(m, "hostagent_gpu_holder", gpu="gpu-a", vm="gpu-node") == 1
    assert value(m, "hostagent_hook_events_total", op="release", sub="end") >= 1

    # History: the same transitions, who held each GPU in order, one swap for gpu-a.
    svg = tmp_path / "timeline.svg"
    out = lab.hostagent("history", "--since", since, "--json", "--svg", str(svg))
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)
    assert h["lendee"] == "gpu-node"
    phases = [f"{t['from']}>{t['to']}" for t in h["transitions"] if t["event"] == "phase"]
    assert phases == lab.phases()
    owners = [(t["vm"], t["to"]) for t in h["transitions"] if t["event"] == "owner"]
    assert owners == [("gaming1", "running"), ("gaming1", "off")]
    assert all(t["duration_s"] is not None for t in h["transitions"] if t["event"] == "phase")
    holders = {gpu: [s["holder"] for s in g["segments"]] for gpu, g in h["gpus"].items()}
    assert holders == {"gpu-a": ["gpu-node", None, "gaming1", None, "gpu-node"],
                       "gpu-b": ["gpu-node", None, "gpu-node"],
                       "gpu-c": ["gpu-node", None, "gpu-node"]}
    assert h["gpus"]["gpu-a"]["gaming_s"] > 0 and h["gpus"]["gpu-b"]["gaming_s"] == 0
    [swap] = h["swaps"]
    assert (swap["gpu"], swap["owner"]) == ("gpu-a", "gaming1")
    assert 0 < swap["duration_s"] < 60
    rows = ET.parse(svg).getroot().findall(f".//{SVG}g[@class='row']")
    assert [r.get("data-gpu") for r in rows] == ["gpu-a", "gpu-b", "gpu-c"]
    table = lab.hostagent("history", "--since", since)
    assert table.returncode == 0 and "per GPU" in table.stdout
    text = lab.hostagent("status")
    assert text.returncode == 0 and "health: 5 checks pass" in text.stdout, text.stdout

    # libvirtd goes away under the agent: /healthz says so, naming libvirt.
    lab.stop_libvirtd()
    try:
        wait_until(lambda: scrape.healthz()[0] == 503, "/healthz to fail", timeout=30)
        status, health = scrape.healthz()
        failed = {c["check"]: c["detail"] for c in health["checks"] if not c["ok"]}
        # The domains cannot be read either while libvirtd is gone.
        assert "libvirt" in failed and set(failed) <= {"libvirt", "domains"}, health
        assert "libvirt" in failed["libvirt"]
        assert health["ok"] is False
        assert value(scrape.metrics(), "hostagent_health_check_success", check="libvirt") == 0
        text = lab.hostagent("status")
        assert "failed checks:\n  libvirt: libvirt" in text.stdout, text.stdout
    finally:
        lab.start_libvirtd()
    # And recovers once the agent has reconnected.
    wait_until(lambda: scrape.healthz()[0] == 200, "/healthz to pass again", timeout=60)
