"""``policy.hotplug = "auto"`` against real libvirt: the lab lendee's persistent
definition as libvirtd completes it (q35, every disk that stands for a GPU given a
pcie-root-port of its own) can hot-plug, so the default is "both"; booted with the
guest's hot-plug turned off on its kernel command line, it is "none", and `hostagent
lint` says which and why. No guest boots."""

from __future__ import annotations

import pytest

from hostagent.core import config
from hostagent.host import lint
from hostagent.core.model import Hotplug
from tests.lab.lab import LENDEE, Lab
from tests.lab.test_unplug_lab import NEVER_LETS_GO, define_lendee

pytestmark = pytest.mark.lab


def test_the_default_hotplug_follows_what_libvirt_gives_the_lendee(lab: Lab) -> None:
    text = lab.config_text().replace("[policy]\n", '[policy]\nhotplug = "auto"\n')
    cfg = config.parse(text, "lab.toml")
    lab.write_config(text)

    def capability() -> tuple[Hotplug, str]:
        xml = lab.virsh("dumpxml", "--inactive", LENDEE).stdout
        return lint.hotplug_capability(lint.parse_domain(xml), cfg)

    try:
        how, why = capability()
        assert (how, why) == (Hotplug.BOTH, (
            f"{LENDEE} has a spare pcie-root-port for each function of its owners' GPUs "
            "and its guest's hot-plug is not turned off"))
        define_lendee(lab, NEVER_LETS_GO)
        how, why = capability()
        assert (how, why) == (Hotplug.NONE, (
            f"{LENDEE}'s kernel command line has acpiphp.disable=1: it ignores hot-plug"))
        out = lab.hostagent("lint", LENDEE).stdout
        assert (f"{LENDEE}: GPUs change by restart; a regrow by restart waits until no GPU "
                f"pod runs, however long ({why})") in out
    finally:
        define_lendee(lab)
