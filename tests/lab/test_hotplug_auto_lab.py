"""``policy.hotplug = "auto"`` against real libvirt: the lab lendee's persistent
definition as libvirtd completes it (q35, every disk that stands for a GPU given a
pcie-root-port of its own). From the definition alone "auto" is hot-add at most, and
only with a 64-bit prefetchable window reserved on the root ports: the lab's definition
has none, so "none"; defined with one, "add" (hot-unplug waits for what the running
lendee shows); booted with the guest's hot-plug turned off on its kernel command line,
"none" again. `hostagent lint` says which and why. No guest boots."""

from __future__ import annotations

import pytest

from hostagent.core import config
from hostagent.host import lint
from hostagent.core.model import Hotplug
from tests.lab.lab import LENDEE, Lab
from tests.lab.helpers import NEVER_LETS_GO, define_lendee

pytestmark = pytest.mark.lab

QEMU_NS = "xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'"
PREF64 = ("<qemu:commandline><qemu:arg value='-global'/>"
          "<qemu:arg value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline>")


def define_with_window(lab: Lab) -> None:
    """gpu-node's definition as libvirt has it, with the README's 64-bit window."""
    xml = lab.virsh("dumpxml", "--inactive", LENDEE).stdout
    xml = xml.replace("<domain type='qemu'>", f"<domain type='qemu' {QEMU_NS}>", 1)
    xml = xml.replace("</domain>", f"{PREF64}</domain>", 1)
    path = lab.root / f"{LENDEE}-pref64.xml"
    path.write_text(xml)
    lab.virsh("define", str(path))


def test_the_default_hotplug_follows_what_libvirt_gives_the_lendee(lab: Lab) -> None:
    text = lab.config_text().replace("[policy]\n", '[policy]\nhotplug = "auto"\n')
    cfg = config.parse(text, "lab.toml")
    lab.write_config(text)

    def capability() -> tuple[Hotplug, str]:
        xml = lab.virsh("dumpxml", "--inactive", LENDEE).stdout
        return lint.hotplug_capability(lint.parse_domain(xml), cfg)

    try:
        assert capability() == (Hotplug.NONE, (
            f"{LENDEE} cannot hot-add its GPUs: no 64-bit prefetchable window is reserved on "
            "the root ports (pcie-root-port.pref64-reserve)"))
        out = lab.hostagent("lint", LENDEE).stdout
        assert (f"{LENDEE}: warning: policy.hotplug: no 64-bit prefetchable window is reserved "
                "on the root ports") in out
        define_with_window(lab)
        how, why = capability()
        assert (how, why) == (Hotplug.ADD, (
            f"{LENDEE} has a spare pcie-root-port for each function of its owners' GPUs, a "
            "64-bit prefetchable window and its guest's hot-plug on: hot-add; hot-unplug only "
            "once the running lendee shows its GPU plugins honour "
            "nvidia.com/gpu.deploy.device-plugin and its nvidia-smi supports drain"))
        out = lab.hostagent("lint", LENDEE).stdout
        assert (f"{LENDEE}: GPUs change live when added (hot-add), by restart when a game "
                f"takes one; a regrow by restart waits until no GPU pod runs, however long "
                f"({why})") in out
        define_lendee(lab, NEVER_LETS_GO)
        define_with_window(lab)
        how, why = capability()
        assert (how, why) == (Hotplug.NONE, (
            f"{LENDEE}'s kernel command line has acpiphp.disable=1: it ignores hot-plug"))
        out = lab.hostagent("lint", LENDEE).stdout
        assert (f"{LENDEE}: GPUs change by restart; a regrow by restart waits until no GPU "
                f"pod runs, however long ({why})") in out
    finally:
        define_lendee(lab)
