"""Two lendees end to end: real libvirtd, the real hook, real guests, one agent.

gpu-node borrows gpu-a, gpu-node-b borrows gpu-b and gpu-c, each its own worker VM.
`virsh start gaming1` (gpu-a) reclaims gpu-node only: gpu-node-b is never drained,
never shut down, never restarted (the same guest boot id throughout), and its machine
records no transition; gaming1 plays, and when it stops gpu-node is lent again."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.lab.lab import AGENT_CONFIG, Lab

pytestmark = pytest.mark.lab

OTHER = "gpu-node-b"
ONE_LENDEE = '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]\n'
TWO_LENDEES = ('[lendees.gpu-node]\ngpus = ["gpu-a"]\n\n'
               f'[lendees.{OTHER}]\ngpus = ["gpu-b", "gpu-c"]\n')


@pytest.fixture
def two(lab: Lab) -> Iterator[Lab]:
    """The lab with gpu-node on gpu-a alone and gpu-node-b on gpu-b and gpu-c."""
    config = AGENT_CONFIG.format(relend_delay="2s")
    assert ONE_LENDEE in config
    lab.write_config(config.replace(ONE_LENDEE, TWO_LENDEES))
    lab.define("gpu-node", gpus=("gpu-a",))
    lab.define(OTHER, gpus=("gpu-b", "gpu-c"))
    try:
        yield lab
    finally:
        lab.virsh("destroy", OTHER, check=False)
        lab.virsh("undefine", OTHER, check=False)


def boot_id(lab: Lab, vm: str) -> str:
    out = lab.guest_exec(vm, "/bin/cat", "/proc/sys/kernel/random/boot_id").stdout.strip()
    assert re.fullmatch(r"[0-9a-f-]{36}", out), out
    return out


def test_gaming1_reclaims_its_lendee_only_and_the_other_never_notices(two: Lab) -> None:
    lab = two
    lab.start_agent()
    lab.wait_record(120, event="phase", to="lent", vm="gpu-node")
    lab.wait_record(120, event="phase", to="lent", vm=OTHER)
    before = boot_id(lab, OTHER)
    other_phases = len(lab.records(event="phase", vm=OTHER))

    answer = lab.play("gaming1")
    assert "will start by itself" in answer.stderr, answer.stderr
    assert "gpu-node holds gpu-a" in answer.stderr, answer.stderr
    assert lab.state("gaming1") == "running"
    lab.wait_state("gpu-node", "shut off")
    # gpu-node-b: still running, the same boot, and its machine never moved.
    assert lab.state(OTHER) == "running"
    assert boot_id(lab, OTHER) == before
    assert len(lab.records(event="phase", vm=OTHER)) == other_phases
    assert not [e for e in lab.records(vm=OTHER) if e.get("HOSTAGENT_EVENT") in
                ("shutdown", "drain", "reclaim")]

    # The game ends: gpu-node is lent again; gpu-node-b still never noticed.
    lab.virsh("destroy", "gaming1")
    lab.wait_records(2, 120, event="phase", to="lent", vm="gpu-node")
    assert boot_id(lab, OTHER) == before
    deadline = time.monotonic() + 5  # nothing was pending for it: nothing comes late
    while time.monotonic() < deadline:
        assert len(lab.records(event="phase", vm=OTHER)) == other_phases
        time.sleep(0.5)
