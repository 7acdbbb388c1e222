"""Whole cards and IOMMU groups in the lab (DESIGN.md, invariant 11): gpu-a is a card
of four functions (its disk and three more devices that move with it), and gpu-b and
gpu-c share an IOMMU group on the lab's host. Each test lends partially: one owner
runs before the agent starts, and the lendee boots with what is left, whole."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.lab.lab import OWNERS, Lab
from tests.lab.helpers import wait_lent
from tests.sysfs import FakeSysfs

pytestmark = pytest.mark.lab

TURING = ("audio", "usb", "ucsi")  # gpu-a's functions beside its own (0a:00.1-3)
GPU_A = ["gpu-a", *(f"gpu-a-{f}" for f in TURING)]


@pytest.fixture
def whole(lab: Lab) -> Iterator[Lab]:
    root = lab.root / "sysfs-whole"
    if not root.exists():
        host = FakeSysfs(root)
        for function, cls in enumerate((0x030000, 0x040300, 0x0c0330, 0x0c8000)):
            host.add(f"0000:0a:00.{function}", cls=cls, group="10")
        host.gpu("0b", group="11", audio=False).gpu("0c", group="11", audio=False)
    lab.sysfs, lab.extra = root, {"gpu-a": TURING}
    for dom in ("gpu-node", *OWNERS):
        lab.define(dom)
    # No `functions` for gpu-a: every function of its slot moves with it anyway.
    lab.write_config(lab.config_text().replace('functions = ["0000:0a:00.1"]\n', ""))
    yield lab
    lab.reset()


def disks(lab: Lab, domain: str) -> list[str]:
    out = lab.virsh("domblklist", domain, "--details").stdout
    return sorted(line.split()[-1].rsplit("/", 1)[-1].removesuffix(".img")
                  for line in out.splitlines() if "/gpus/" in line)



def test_a_card_leaves_the_lendee_with_every_function(whole: Lab) -> None:
    """gaming1 plays on gpu-a; gpu-node is lent gpu-b and gpu-c, and none of gpu-a's four
    functions: gaming1 holds them all (QEMU's lock on each would refuse a second VM)."""
    lab = whole
    lab.virsh("start", "gaming1")
    lab.start_agent()
    wait_lent(lab)
    assert disks(lab, "gpu-node") == ["gpu-b", "gpu-c"]
    assert disks(lab, "gaming1") == sorted(GPU_A)
    st = lab.status()
    assert st["lendee"]["lent"] == ["gpu-b", "gpu-c"]
    gpu_a = next(g for g in st["gpus"] if g["gpu"] == "gpu-a")
    assert (gpu_a["holder"], gpu_a["functions"]) == (
        "gaming1", ["0000:0a:00.1", "0000:0a:00.2", "0000:0a:00.3"])
    assert "0000:0a:00.0+.1+.2+.3" in lab.hostagent("status").stdout
    shown = json.loads(lab.hostagent("gpus", "--json").stdout)
    assert shown["pci"][0]["functions"] == ["0000:0a:00.1", "0000:0a:00.2", "0000:0a:00.3"]


def test_gpus_sharing_an_iommu_group_are_lent_together(whole: Lab) -> None:
    """gaming2 plays on gpu-b, which shares a group with gpu-c (nobody's): gpu-node is
    lent gpu-a alone, with its four functions, never gpu-c without gpu-b; lint says what
    moves together."""
    lab = whole
    lab.virsh("start", "gaming2")
    lab.start_agent()
    wait_lent(lab)
    assert disks(lab, "gpu-node") == sorted(GPU_A)
    st = lab.status()
    assert st["lendee"]["lent"] == ["gpu-a"] and st["lendee"]["free"] == ["gpu-a"]
    assert {g["gpu"]: g["holder"] for g in st["gpus"]} == {
        "gpu-a": "gpu-node", "gpu-b": "gaming2", "gpu-c": None}
    assert st["verified"]["ok"]
    assert "gpu-b and gpu-c share an IOMMU group" in lab.hostagent("status").stdout
    lint = lab.hostagent("lint")
    assert ("gpu-node: warning: gpu-b and gpu-c share IOMMU group 11: they move together"
            in lint.stdout), lint.stdout
