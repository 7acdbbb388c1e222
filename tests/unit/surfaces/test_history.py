"""History read back from journal records: transitions, time per GPU, swaps, the timeline."""

from __future__ import annotations

import json
import os
import stat
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from hostagent import cli
from hostagent.surfaces import history, timeline

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1_700_000_000.0


def rec(at: float, event: str, vm: str, from_: str, to: str, holders: str | None = None,
        **extra: str) -> dict[str, Any]:
    r = {"__REALTIME_TIMESTAMP": str(int((T0 + at) * 1e6)), "SYSLOG_IDENTIFIER": "hostagent",
         "_SYSTEMD_UNIT": "hostagent.service", "_UID": "0", "MESSAGE": f"{vm}: {from_} to {to}", "HOSTAGENT_EVENT": event, "HOSTAGENT_VM": vm,
         "HOSTAGENT_FROM": from_, "HOSTAGENT_TO": to, "HOSTAGENT_RESULT": "ok"}
    if holders is not None:
        r["HOSTAGENT_HOLDERS"] = holders
    r.update({f"HOSTAGENT_{k.upper()}": v for k, v in extra.items()})
    return r


LENT = "gpu-a=gpu-node,gpu-b=gpu-node"
FREE = "gpu-a=-,gpu-b=-"


def phase(at: float, from_: str, to: str, holders: str, took: float) -> dict[str, Any]:
    return rec(at, "phase", "gpu-node", from_, to, holders, duration_ms=str(int(took * 1000)),
               cause="X")


def intent(at: float, owner: str, to: str, iid: str) -> dict[str, Any]:
    r = rec(at, "intent", owner, "", to, intent=iid)
    del r["HOSTAGENT_FROM"]
    return r


# A lab cycle: lent, gaming1 asks (deferred), reclaim, gaming1 plays, lent again. The
# agent records "intent done" just before the owner's own start record.
CYCLE = [
    phase(0, "off", "booting", LENT, 0),
    phase(10, "booting", "joining", LENT, 10),
    phase(12, "joining", "lent", LENT, 2),
    intent(100, "gaming1", "pending", "i1"),
    phase(100, "lent", "draining", LENT, 88),
    phase(102, "draining", "stopping", LENT, 2),
    phase(104, "stopping", "off", FREE, 2),
    intent(105, "gaming1", "done", "i1"),
    rec(105, "owner", "gaming1", "off", "running", "gpu-a=gaming1,gpu-b=-"),
    rec(200, "owner", "gaming1", "running", "off", FREE),
    phase(202, "off", "booting", LENT, 98),
    phase(212, "booting", "joining", LENT, 10),
    phase(214, "joining", "lent", LENT, 2),
]


def test_parse_holders() -> None:
    assert history.parse_holders("gpu-a=gpu-node,gpu-b=-") == {"gpu-a": "gpu-node", "gpu-b": None}
    assert history.parse_holders("0000:0a:00.0=gaming1") == {"0000:0a:00.0": "gaming1"}
    assert history.parse_holders("") == {}


def test_a_cycle_read_back() -> None:
    h = history.build(reversed(CYCLE), until=T0 + 300)  # order is restored by time
    assert h.lendee == "gpu-node"
    assert [(t.vm, t.from_, t.to) for t in h.transitions] == [
        (r["HOSTAGENT_VM"], r["HOSTAGENT_FROM"], r["HOSTAGENT_TO"]) for r in CYCLE
        if r["HOSTAGENT_EVENT"] != "intent"]
    assert h.transitions[3].duration == 88.0
    # The owner's stop record has no duration of its own: the time since it started.
    gaming_off = next(t for t in h.transitions if t.vm == "gaming1" and t.to == "off")
    assert gaming_off.duration == 95.0
    assert h.totals("gpu-a") == {"lent": 104 + 98, "gaming": 95, "idle": 1 + 2}
    assert h.totals("gpu-b") == {"lent": 104 + 98, "gaming": 0, "idle": 98}
    assert [(s.holder, s.start - T0, s.end - T0) for s in h.gpus["gpu-a"]] == [
        ("gpu-node", 0, 104), (None, 104, 105), ("gaming1", 105, 200), (None, 200, 202),
        ("gpu-node", 202, 300)]
    # gaming1 asked at 100 and had its GPU at 105; gpu-b never went to an owner.
    assert [(s.gpu, s.owner, s.duration) for s in h.swaps] == [("gpu-a", "gaming1", 5.0)]


def test_an_owner_starting_on_free_gpus_is_not_a_swap() -> None:
    records = [*CYCLE[:10],  # up to gaming1's stop, the lendee still off
               rec(201, "owner", "gaming2", "off", "running", "gpu-a=-,gpu-b=gaming2")]
    h = history.build(records)
    assert len(h.swaps) == 1
    assert h.end == T0 + 201
    assert h.totals("gpu-b")["gaming"] == 0  # it started at the end of the window


def test_no_records() -> None:
    h = history.build([], until=T0)
    assert h.start is None and h.transitions == [] and h.gpus == {}
    assert history.format_table(h) == "no transitions in the journal for this period"
    ET.fromstring(timeline.svg(h))


def test_table_and_json() -> None:
    h = history.build(CYCLE, until=T0 + 300)
    table = history.format_table(h)
    lines = table.splitlines()
    assert lines[0].split() == ["TIME", "VM", "CHANGE", "AFTER", "RESULT", "HOLDERS"]
    assert lines[4].split()[2:] == ["gpu-node", "lent", "→", "draining", "1m28s", "ok",
                                    "gpu-a=gpu-node", "gpu-b=gpu-node"]
    assert "gpu-a=gaming1 gpu-b=-" in table
    assert lines[-2].split()[:2] == ["gpu-a", "3m22s"]
    assert lines[-2].endswith("1 (5.0s)")
    data = json.loads(json.dumps(history.to_json(h)))
    assert data["lendee"] == "gpu-node"
    assert len(data["transitions"]) == 11
    assert data["gpus"]["gpu-a"]["gaming_s"] == 95
    assert data["swaps"] == [{"gpu": "gpu-a", "owner": "gaming1", "start": T0 + 100,
                              "end": T0 + 105, "duration_s": 5.0}]


def test_until_time() -> None:
    assert history.until_time("now", now=5.0) == 5.0
    assert history.until_time("@1700000000.5", now=0) == 1_700_000_000.5
    assert history.until_time("2023-11-14 22:13", now=0) == datetime(2023, 11, 14, 22, 13).timestamp()
    assert history.until_time("1h ago", now=0) is None  # journalctl's own: not guessed


def test_span() -> None:
    assert [history.span(s) for s in (0.04, 9.96, 42, 250, 7500)] == [
        "0.0s", "10.0s", "42s", "4m10s", "2h05m"]


def test_svg_is_xml_with_one_row_per_gpu() -> None:
    h = history.build(CYCLE, until=T0 + 300)
    root = ET.fromstring(timeline.svg(h))
    assert root.tag == f"{SVG}svg"
    rows = root.findall(f".//{SVG}g[@class='row']")
    assert [r.get("data-gpu") for r in rows] == ["gpu-a", "gpu-b"]
    holders = [s.get("data-holder") for s in rows[0].findall(f"{SVG}rect[@class='segment']")]
    assert holders == ["gpu-node", "idle", "gaming1", "idle", "gpu-node"]
    swaps = rows[0].findall(f"{SVG}g[@class='swap']")
    assert len(swaps) == 1 and "swap 5.0s" in "".join(swaps[0].itertext())
    assert not rows[1].findall(f"{SVG}g[@class='swap']")
    found = root.find(f".//{SVG}g[@class='legend']")
    assert found is not None
    legend = "".join(found.itertext())
    assert "gpu-node (lent)" in legend and "gaming1 (gaming)" in legend and "idle" in legend
    assert root.findall(f".//{SVG}g[@class='axis']/{SVG}text")


@pytest.fixture
def fake_journalctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A journalctl on PATH that prints CYCLE and writes its arguments to args.json."""
    (tmp_path / "records.json").write_text("\n".join(json.dumps(r) for r in CYCLE) + "\n")
    exe = tmp_path / "journalctl"
    exe.write_text(f"#!/bin/sh\n"
                   f"printf '%s\\n' \"$@\" > {tmp_path}/args\n"
                   f"cat {tmp_path}/records.json\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def test_cli_history(fake_journalctl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = fake_journalctl / "t.svg"
    assert cli.main(["--config", "/nonexistent", "history", "--since", "1h ago", "-D",
                     "/lab/journal", "--json", "--svg", str(svg)]) == 0
    args = (fake_journalctl / "args").read_text().splitlines()
    assert args[args.index("--since") + 1] == "1h ago"
    assert args[args.index("-D") + 1] == "/lab/journal"
    assert {"_SYSTEMD_UNIT=hostagent.service", "_UID=0", "SYSLOG_IDENTIFIER=hostagent",
            "HOSTAGENT_EVENT=phase", "HOSTAGENT_EVENT=owner", "HOSTAGENT_EVENT=intent"} <= set(args)
    assert json.loads(capsys.readouterr().out)["swaps"][0]["owner"] == "gaming1"
    assert len(ET.parse(svg).getroot().findall(f".//{SVG}g[@class='row']")) == 2
    assert cli.main(["history"]) == 0
    assert "per GPU" in capsys.readouterr().out


def forged(r: dict[str, Any], **trusted: str | None) -> dict[str, Any]:
    """`r` as a local user sends it (logger, systemd-cat): journald's own fields differ."""
    out = {**r, "MESSAGE": "forged"}
    for name, value in trusted.items():
        if value is None:
            out.pop(name)
        else:
            out[name] = value
    return out


def test_records_anyone_could_send_are_not_history() -> None:
    """The HOSTAGENT_* fields and SYSLOG_IDENTIFIER are the sender's to write: only
    journald's own fields say a record is the service's."""
    late = [rec(300, "owner", "gaming1", "off", "running", "gpu-a=gaming1,gpu-b=-"),
            phase(300, "lent", "off", FREE, 1)]
    forgeries = [forged(r, **fields) for r in late for fields in (
        {"_SYSTEMD_UNIT": None, "_UID": None},  # logger, from anywhere
        {"_SYSTEMD_UNIT": "user@1000.service", "_UID": "1000"},  # systemd-cat in a session
        {"_UID": "1000"},  # not root (a unit's User=)
        {"_SYSTEMD_UNIT": "other.service"})]  # root, another service
    h = history.build(CYCLE + forgeries)
    assert [t.message for t in h.transitions] == [t.message for t in history.build(CYCLE).transitions]
    assert history.build(CYCLE + late).transitions[-1].at == T0 + 300
    moved = [{**r, "_SYSTEMD_UNIT": "ha.service"} for r in CYCLE]
    assert history.build(moved, unit="ha.service").transitions


def test_cli_history_says_when_journalctl_fails(
        fake_journalctl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (fake_journalctl / "journalctl").write_text("#!/bin/sh\necho 'No journal files were found.' >&2\n"
                                                "exit 1\n")
    assert cli.main(["history"]) == 1
    assert capsys.readouterr().err == "hostagent: journalctl failed: No journal files were found.\n"


def test_a_gpu_lent_while_another_is_in_a_game() -> None:
    """Partial lending read back: while gaming1 plays with gpu-a, gpu-node is lent gpu-b
    again; the history and its timeline show both at once, and the regrow after."""
    partial = "gpu-a=gaming1,gpu-b=gpu-node"
    records = [
        *CYCLE[:9],  # lent, reclaimed for gaming1, gaming1 plays
        phase(106, "off", "booting", partial, 2),
        phase(116, "booting", "joining", partial, 10),
        phase(118, "joining", "lent", partial, 2),
        rec(200, "owner", "gaming1", "running", "off", "gpu-a=-,gpu-b=gpu-node"),
        phase(232, "lent", "draining", "gpu-a=-,gpu-b=gpu-node", 114),
        phase(234, "draining", "stopping", "gpu-a=-,gpu-b=gpu-node", 2),
        phase(236, "stopping", "off", FREE, 2),
        phase(266, "off", "booting", LENT, 30),
    ]
    h = history.build(records, until=T0 + 300)
    assert [(s.holder, s.start - T0, s.end - T0) for s in h.gpus["gpu-b"]] == [
        ("gpu-node", 0, 104), (None, 104, 106), ("gpu-node", 106, 236), (None, 236, 266),
        ("gpu-node", 266, 300)]
    assert h.totals("gpu-a") == {"lent": 104 + 34, "gaming": 95, "idle": 1 + 66}
    rows = ET.fromstring(timeline.svg(h)).findall(f".//{SVG}g[@class='row']")
    segments = [[s.get("data-holder") for s in r.findall(f"{SVG}rect[@class='segment']")]
              for r in rows]
    assert "gaming1" in segments[0] and segments[1].count("gpu-node") == 3


def test_several_lendees_each_lend_their_own_gpus() -> None:
    """gpu-node lends gpu-a, gpu-node-b lends gpu-b; gaming1 takes gpu-a from gpu-node
    only: gpu-b stays lent throughout, gpu-a's swap is counted."""
    records = [
        rec(0, "phase", "gpu-node", "joining", "lent", "gpu-a=gpu-node"),
        rec(0, "phase", "gpu-node-b", "joining", "lent", "gpu-b=gpu-node-b"),
        intent(10, "gaming1", "pending", "i1"),
        rec(20, "phase", "gpu-node", "stopping", "off", "gpu-a=-"),
        rec(25, "owner", "gaming1", "off", "running", "gpu-a=gaming1"),
        intent(25, "gaming1", "done", "i1"),
        rec(100, "owner", "gaming1", "running", "off", "gpu-a=-"),
    ]
    h = history.build(records, until=T0 + 100)
    assert h.lendee == "gpu-node" and h.lendees == ("gpu-node", "gpu-node-b")
    assert h.totals("gpu-b") == {"lent": 100.0, "gaming": 0.0, "idle": 0.0}
    assert h.totals("gpu-a") == {"lent": 20.0, "gaming": 75.0, "idle": 5.0}
    assert [(s.gpu, s.owner, s.duration) for s in h.swaps] == [("gpu-a", "gaming1", 15.0)]
    out = history.to_json(h)
    assert out["lendees"] == ["gpu-node", "gpu-node-b"]
    assert [t["lendee"] for t in out["transitions"]][:2] == ["gpu-node", "gpu-node-b"]
