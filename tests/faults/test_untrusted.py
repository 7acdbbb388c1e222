"""Words from others: records any local user can send to the journal, and a guest whose
GPU names carry terminal escape sequences.

Neither needs Kubernetes. The journal is the lab's real journald, so the forgeries carry
the fields journald itself adds; the guest is a real lab guest whose stand-in
nvidia-smi reads its GPU names off the lab GPUs' disks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.faults.scenario import wait_lent
from tests.lab.lab import GPUS, Lab
from tests.faults.helpers import (
    FORGED,
)

pytestmark = pytest.mark.lab

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
    assert len(lab.wait_records(2, event="owner", vm="gaming1")) == 2  # in the journal, as sent
    out = lab.hostagent("history", "--since", since, "--json")
    assert out.returncode == 0, out.stderr
    h = json.loads(out.stdout)
    assert [t for t in h["transitions"] if t["event"] == "owner"] == []
    phases = [f"{t['from']}>{t['to']}" for t in h["transitions"]]
    assert phases and phases == lab.phases()[:len(phases)]
    assert not {s["holder"] for g in h["gpus"].values() for s in g["segments"]} - {"gpu-node", None}
    table = lab.hostagent("history", "--since", since)
    assert table.returncode == 0 and "gaming1" not in table.stdout, table.stdout


# What a tenant of the lendee can make its GPU's name say: clear root's screen and home
# the cursor, write root's clipboard (OSC 52), a CSI in its 8-bit form, a carriage
# return that would print over the line, a right-to-left override.
HOSTILE = "Evil\x1b[2J\x1b[H\x1b]52;c;cm0gLXJmIC8K\x07\x9b31m\rRTX\u202e3050"


def hostile(text: str) -> list[str]:
    """The characters in `text` a terminal would act on (line ends aside)."""
    return [c for c in text if not c.isprintable() and c != "\n"]


def test_hostile_guest_text(lab: Lab) -> None:
    """hostile guest text: a GPU name with escape sequences reaches no terminal"""
    gpu_uuid, _ = GPUS["gpu-a"]
    lab.write_gpu("gpu-a", f"LABGPU {gpu_uuid} {HOSTILE}")
    lab.start_agent()
    wait_lent(lab, timeout=180)
    out = lab.hostagent("status")
    assert out.returncode == 0, out.stderr
    assert "GPUs checked in the guest" in out.stdout and "ok" in out.stdout, out.stdout
    assert hostile(out.stdout) == [], out.stdout
    assert "\\x1b[2J" in out.stdout and "\\x07" in out.stdout, out.stdout  # shown, escaped
    verified = lab.records(event="verify")[-1]
    assert hostile(verified["MESSAGE"]) == [] and "\\x1b]52" in verified["MESSAGE"]
