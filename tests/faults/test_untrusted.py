"""Words from others: records any local user can send to the journal.

No Kubernetes needed. The journal is the lab's real journald, so the forgeries carry
the fields journald itself adds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.lab.lab import Lab

pytestmark = pytest.mark.lab

# An owner's start, as the agent records it: what `hostagent history` draws as gaming.
FORGED = {"MESSAGE": "gaming1: off to running", "SYSLOG_IDENTIFIER": "hostagent",
          "HOSTAGENT_EVENT": "owner", "HOSTAGENT_VM": "gaming1", "HOSTAGENT_FROM": "off",
          "HOSTAGENT_TO": "running", "HOSTAGENT_RESULT": "ok",
          "HOSTAGENT_HOLDERS": "gpu-a=gaming1,gpu-b=-,gpu-c=-"}
SEND = "import json, sys, systemd.journal as j; j.send(**json.loads(sys.argv[1]))"


def forge(lab: Lab, *as_user: str) -> None:
    """Send FORGED to the lab's journal, as `as_user` (setpriv's options) or as root
    outside the service's unit."""
    argv = lab.nsenter(*(("setpriv", *as_user) if as_user else ()), sys.executable, "-c",
                       SEND, json.dumps(FORGED))
    subprocess.run(argv, check=True, timeout=30, capture_output=True)


def test_forged_journal_records(lab: Lab) -> None:
    """forged journal records: what a local user sends as hostagent is not its history"""
    since = f"@{lab.mark_us / 1e6:.6f}"
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    forge(lab, "--reuid=65534", "--regid=65534", "--clear-groups")  # any local user
    forge(lab)  # root, but not the service
    assert len(lab.records(event="owner", vm="gaming1")) == 2  # in the journal, as sent
    out = lab.hostagent("history", "--since", since, "--json")
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)
    assert [t for t in h["transitions"] if t["event"] == "owner"] == []
    phases = [f"{t['from']}>{t['to']}" for t in h["transitions"]]
    assert phases and phases == lab.phases()[:len(phases)]
    assert not {s["holder"] for g in h["gpus"].values() for s in g["segments"]} - {"gpu-node", None}
    table = lab.hostagent("history", "--since", since)
    assert table.returncode == 0 and "gaming1" not in table.stdout, table.stdout
