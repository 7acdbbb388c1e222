"""Lint's IOMMU-group sharing check (`_shared_groups`), and its reset, autostart and
slot-function checks: each finding whole, for a host and domains that make it, and the
sets that make none."""

from __future__ import annotations

import textwrap

from hostagent.core.config import Config, parse
from hostagent.host import lint
from hostagent.host.lint import Check, Severity
from tests.configs import gpus_toml
from tests.sysfs import FakeSysfs
from tests.unit.domain_scaffold import domain, gpu, hostdev

ACS_FIX = (
    "put one of the cards in a slot with an IOMMU group of its own (usually one wired to "
    "the CPU's own root ports rather than the chipset's), or turn on ACS for that root "
    "port in the firmware if it offers it (`hostagent gpus` shows the groups). The "
    "pcie_acs_override kernel patch splits the group without the hardware's isolation: "
    "the cards can then reach each other's memory by peer-to-peer DMA, past the IOMMU, "
    "so a VM can read or corrupt the other's")

LENDEE = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b"]
"""

GPUS = gpus_toml(("gpu-a", "gpu-b"), uuids=False, functions=True)


def cfg(text: str) -> Config:
    return parse(textwrap.dedent(text))


def shared(sysfs: FakeSysfs, xmls: list[str], config: Config | None = None
           ) -> list[lint.Finding]:
    return lint._shared_groups([lint.parse_domain(x) for x in xmls], sysfs.root, config)


def one_group(sysfs: FakeSysfs) -> FakeSysfs:
    """Two cards, both in IOMMU group 7."""
    return sysfs.gpu("01", group="7").gpu("02", group="7")


# --- without the configuration ------------------------------------------------------------


def test_vms_with_disjoint_cards_of_one_group_each_get_an_error(sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    found = shared(sysfs, [domain("gaming2", gpu("02")), domain("gaming1", gpu("01"))])
    what = ("cards of IOMMU group 7 are given to different VMs: 0000:01:00 in gaming1; "
            "0000:02:00 in gaming2")
    why = ("VFIO gives a whole IOMMU group to one VM at a time, so these VMs cannot run "
           "together even though their XML says they share nothing.")
    assert found == [
        lint.Finding(domain=name, check=Check.SHARED_GROUP, severity=Severity.ERROR,
                     what=what, why=why, fix=ACS_FIX)
        for name in ("gaming1", "gaming2")]


def test_a_card_shared_by_vms_names_them_all(sysfs: FakeSysfs) -> None:
    # gpu-node lends the card gaming1 has; gaming2's card is disjoint from both.
    one_group(sysfs)
    found = shared(sysfs, [domain("gaming1", gpu("01")), domain("gpu-node", gpu("01")),
                           domain("gaming2", gpu("02"))])
    assert [f.domain for f in found] == ["gaming1", "gaming2", "gpu-node"]
    assert {f.what for f in found} == {
        "cards of IOMMU group 7 are given to different VMs: 0000:01:00 in gaming1, gpu-node; "
        "0000:02:00 in gaming2"}


def test_no_finding_without_the_configuration(sysfs: FakeSysfs) -> None:
    one_group(sysfs).gpu("03")
    # One VM with both cards of the group: it has the whole group.
    assert shared(sysfs, [domain("gpu-node", gpu("01") + gpu("02"))]) == []
    # Both VMs with both cards: lending, not sharing.
    both = gpu("01") + gpu("02")
    assert shared(sysfs, [domain("gpu-node", both), domain("gaming1", both)]) == []
    # Two VMs that share one card and one of them with the other too: not disjoint.
    assert shared(sysfs, [domain("gpu-node", both), domain("gaming1", gpu("01"))]) == []
    # Cards in groups of their own.
    assert shared(sysfs, [domain("gaming1", gpu("01")), domain("gaming3", gpu("03"))]) == []
    # A hostdev the host does not have has no group.
    assert shared(sysfs, [domain("gaming1", [hostdev("0000:09:00.0")]),
                          domain("gaming2", [hostdev("0000:0a:00.0")])]) == []


# --- with the configuration ---------------------------------------------------------------


def test_a_device_that_is_no_gpu_in_a_gpus_group(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", group="7").gpu("02", group="8")
    sysfs.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="7")
    config = cfg(LENDEE + GPUS + '\n[owners.gaming1]\ngpus = ["gpu-a"]\n')
    found = shared(sysfs, [domain("gpu-node", gpu("01") + gpu("02")),
                           domain("gaming1", gpu("01")),
                           domain("usb-vm", [hostdev("0000:05:00.0")])], config)
    assert found == [lint.Finding(
        domain="gaming1, gpu-node, usb-vm", check=Check.SHARED_GROUP, severity=Severity.ERROR,
        what="IOMMU group 7 holds 0000:05:00, no GPU, with gpu-a: gpu-a in gaming1, gpu-node; "
             "0000:05:00 in usb-vm",
        why="VFIO gives a whole IOMMU group to one VM at a time and hostagent moves GPUs "
            "only: while a VM holds one member of the group no other can start with another, "
            "so hostagent gives the GPU to no VM (a game or the lendee, started or "
            "hot-added) while another holds the rest of its group.",
        fix=ACS_FIX + "; or pass the other device through to no VM")]


def test_a_configured_gpu_in_no_vm_is_listed_as_in_no_vm(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", group="7").gpu("02", group="8")
    sysfs.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="7")
    sysfs.add("0000:06:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="7")
    # A device in no VM is none of the group's users: only the configured GPU is listed
    # without one.
    found = shared(sysfs, [domain("usb-vm2", [hostdev("0000:06:00.0")]),
                           domain("usb-vm", [hostdev("0000:05:00.0")])], cfg(LENDEE + GPUS))
    assert [(f.domain, f.what) for f in found] == [(
        "usb-vm, usb-vm2", "IOMMU group 7 holds 0000:05:00, 0000:06:00, no GPU, with gpu-a: "
                           "gpu-a in no VM; 0000:05:00 in usb-vm; 0000:06:00 in usb-vm2")]


def test_only_devices_that_are_no_gpu_in_a_group_is_no_finding(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", group="7").gpu("02", group="8")
    sysfs.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="9")
    sysfs.add("0000:06:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="9")
    found = shared(sysfs, [domain("usb-vm", [hostdev("0000:05:00.0")]),
                           domain("usb-vm2", [hostdev("0000:06:00.0")])], cfg(LENDEE + GPUS))
    assert found == []


def test_gpus_of_one_group_lent_to_two_lendees(sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    config = cfg('[lendees.node-a]\ngpus = ["gpu-a"]\n[lendees.node-b]\ngpus = ["gpu-b"]\n'
                 + GPUS)
    found = shared(sysfs, [domain("node-a", gpu("01")), domain("node-b", gpu("02"))], config)
    assert found == [lint.Finding(
        domain="node-a, node-b", check=Check.SHARED_GROUP, severity=Severity.ERROR,
        what="gpu-a and gpu-b share IOMMU group 7 but are lent to node-a and node-b",
        why="VFIO gives a group to one VM at a time: while one of those lendees runs with "
            "its GPU, the other cannot start with its own.",
        fix=ACS_FIX + "; or lend those GPUs to one lendee")]


def test_gpus_of_different_owners_in_one_group(sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    config = cfg(LENDEE + GPUS + '\n[owners.gaming2]\ngpus = ["gpu-b"]\n'
                 '\n[owners.gaming1]\ngpus = ["gpu-a"]\n'
                 '\n[owners.gaming3]\ngpus = ["gpu-a"]\n')
    found = shared(sysfs, [], config)
    assert found == [lint.Finding(
        domain="gaming1, gaming2, gaming3", check=Check.SHARED_GROUP, severity=Severity.ERROR,
        what="GPUs of different owners share IOMMU group 7: gpu-a (gaming1 and gaming3), "
             "gpu-b (gaming2)",
        why="VFIO gives a group to one VM at a time: gaming1 and gaming2 and gaming3 cannot "
            "run together, and hostagent lends and reclaims gpu-a and gpu-b together (one "
            "owner's start takes them all from the lendee).",
        fix=ACS_FIX + "; or give those GPUs to the same owners")]


def test_an_owned_gpu_and_an_unowned_one_in_one_group_is_a_warning(sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    config = cfg(LENDEE + GPUS + '\n[owners.gaming2]\ngpus = ["gpu-b"]\n'
                 '\n[owners.gaming1]\ngpus = ["gpu-b"]\n')
    found = shared(sysfs, [domain("gpu-node", gpu("01") + gpu("02"))], config)
    assert found == [lint.Finding(
        domain="gpu-node", check=Check.SHARED_GROUP, severity=Severity.WARNING,
        what="gpu-a and gpu-b share IOMMU group 7: they move together (gpu-a (no owner), "
             "gpu-b (gaming1 and gaming2))",
        why="VFIO gives a group to one VM at a time, so while gaming1 or gaming2 plays, the "
            "lendee has none of gpu-a and gpu-b.",
        fix=ACS_FIX)]


def test_gpus_of_one_group_and_the_same_owners_or_none_is_no_finding(
        sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    assert shared(sysfs, [domain("gpu-node", gpu("01") + gpu("02"))], cfg(LENDEE + GPUS)) == []
    same = cfg(LENDEE + GPUS + '\n[owners.gaming1]\ngpus = ["gpu-a", "gpu-b"]\n')
    assert shared(sysfs, [domain("gaming1", gpu("01") + gpu("02"))], same) == []
    # Groups of their own: nothing is shared whoever owns them.
    sysfs2 = FakeSysfs(sysfs.root.parent / "sys2").gpu("01").gpu("02")
    apart = cfg(LENDEE + GPUS + '\n[owners.gaming1]\ngpus = ["gpu-a"]\n'
                '\n[owners.gaming2]\ngpus = ["gpu-b"]\n')
    assert shared(sysfs2, [domain("gaming1", gpu("01")), domain("gaming2", gpu("02"))],
                  apart) == []


# --- several groups: each is checked, whatever the one before made ------------------------


def test_every_group_is_checked_without_the_configuration(sysfs: FakeSysfs) -> None:
    # Group 3: one VM with both cards, no finding; groups 4 and 5: disjoint cards each.
    sysfs.gpu("01", group="3").gpu("02", group="3").gpu("03", group="4").gpu("04", group="4")
    sysfs.gpu("05", group="5").gpu("06", group="5")
    found = shared(sysfs, [domain("both", gpu("01") + gpu("02")),
                           domain("g3", gpu("03")), domain("g4", gpu("04")),
                           domain("g5", gpu("05")), domain("g6", gpu("06"))])
    assert [(f.domain, f.what) for f in found] == [
        ("g3", "cards of IOMMU group 4 are given to different VMs: 0000:03:00 in g3; "
               "0000:04:00 in g4"),
        ("g4", "cards of IOMMU group 4 are given to different VMs: 0000:03:00 in g3; "
               "0000:04:00 in g4"),
        ("g5", "cards of IOMMU group 5 are given to different VMs: 0000:05:00 in g5; "
               "0000:06:00 in g6"),
        ("g6", "cards of IOMMU group 5 are given to different VMs: 0000:05:00 in g5; "
               "0000:06:00 in g6")]


FOUR = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b", "gpu-c", "gpu-d"]

[gpus.gpu-a]
pci = "0000:01:00.0"
functions = ["0000:07:00.0"]

[gpus.gpu-b]
pci = "0000:02:00.0"

[gpus.gpu-c]
pci = "0000:03:00.0"

[gpus.gpu-d]
pci = "0000:04:00.0"

[owners.gaming3]
gpus = ["gpu-c"]
"""


def test_every_group_is_checked_with_the_configuration(sysfs: FakeSysfs) -> None:
    # Group 1: gpu-a alone, though on two slots; group 2: gpu-b and gpu-c with a USB
    # controller; group 3: gpu-c owned, gpu-d not.
    sysfs.gpu("01", group="1", audio=False).gpu("07", group="1", audio=False)
    sysfs.gpu("02", group="2", audio=False)
    sysfs.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="2")
    sysfs.gpu("03", group="3", audio=False).gpu("04", group="3", audio=False)
    found = shared(sysfs, [domain("gpu-node", [hostdev(f"0000:0{b}:00.0") for b in "12347"]),
                           domain("usb-vm", [hostdev("0000:05:00.0")])], cfg(FOUR))
    assert [(f.domain, f.severity, f.what) for f in found] == [
        ("gpu-node, usb-vm", Severity.ERROR,
         "IOMMU group 2 holds 0000:05:00, no GPU, with gpu-b: gpu-b in gpu-node; "
         "0000:05:00 in usb-vm"),
        ("gpu-node", Severity.WARNING,
         "gpu-c and gpu-d share IOMMU group 3: they move together (gpu-c (gaming3), "
         "gpu-d (no owner))")]


def test_a_device_that_is_no_gpu_in_a_group_of_two_gpus_names_both(sysfs: FakeSysfs) -> None:
    one_group(sysfs)
    sysfs.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="7")
    found = shared(sysfs, [domain("usb-vm", [hostdev("0000:05:00.0")])], cfg(LENDEE + GPUS))
    assert [f.what for f in found] == [
        "IOMMU group 7 holds 0000:05:00, no GPU, with gpu-a, gpu-b: gpu-a in no VM; "
        "gpu-b in no VM; 0000:05:00 in usb-vm"]


# --- autostart (`_autostart`): its warnings whole ------------------------------------------


def test_autostart_warnings_whole() -> None:
    roles: dict[str, tuple[str, str, tuple[str, ...]]] = {
        "gpu-node": ("lendee", "", ()), "gaming1": ("owner", "", ()),
        "gaming2": ("owner", "", ())}
    doms = [lint.parse_domain(domain("other", []), autostart=True),  # no role: nothing
            lint.parse_domain(domain("gaming2", []), autostart=False),
            lint.parse_domain(domain("gpu-node", []), autostart=True),
            lint.parse_domain(domain("gaming1", []), autostart=True)]
    before = ("libvirt starts it when libvirtd starts at host boot, before hostagent answers "
              "its hook, which can then only spool the event: ")
    assert lint._autostart(doms, roles) == [
        lint.Finding(domain="gpu-node", check=Check.AUTOSTART, severity=Severity.WARNING,
                     what="libvirt autostarts it",
                     why=before + "the lendee boots with every GPU, those an owner starting "
                                  "at boot needs included, and one of the two fails to start.",
                     fix="virsh autostart --disable gpu-node; hostagent lends the free GPUs "
                         "at boot by itself"),
        lint.Finding(domain="gaming1", check=Check.AUTOSTART, severity=Severity.WARNING,
                     what="libvirt autostarts it",
                     why=before + "the owner takes its GPU while the lendee may be booting "
                                  "with it, and one of the two fails to start.",
                     fix="virsh autostart --disable gaming1; to start it at boot, set "
                         "start_at_boot = true under [owners.gaming1]: hostagent then starts "
                         "it once its GPUs are free")]


# --- resets (`_resets`): its findings whole ------------------------------------------------

RESET_WHY = ("the next VM gets the GPU as the last one left it: its memory, the previous "
             "VM's data included, and a state its driver may not start from.")
BRIDGE = "0000:00:01.0"


def resets(sysfs: FakeSysfs) -> list[lint.Finding]:
    return lint._resets(cfg(LENDEE + GPUS), sysfs.root)


def test_no_reset_and_no_bridge_is_an_error_whole(sysfs: FakeSysfs) -> None:
    # gpu-a's main function has FLR (nothing to say, and the check goes on), its audio
    # function has no reset on the root bus.
    sysfs.add("0000:01:00.0", group="1")
    sysfs.add("0000:01:00.1", cls=0x040300, device="228e", group="1", reset_method=None)
    sysfs.gpu("02")
    path = "/sys/bus/pci/devices/0000:01:00.1/reset_method"
    assert resets(sysfs) == [lint.Finding(
        domain="gpu-node", check=Check.RESET, severity=Severity.ERROR,
        what="0000:01:00.1 of GPU gpu-a cannot be reset between VMs: it has no reset method "
             "and no bridge above it whose bus could be reset",
        why=RESET_WHY,
        fix=f"put the card in a slot behind a PCIe root port (`cat {path}` lists the methods "
            "the kernel found; `lspci -vv` shows FLReset+ where the card has FLR)")]


def test_every_reset_method_turned_off_is_an_error_whole(sysfs: FakeSysfs) -> None:
    sysfs.add(BRIDGE, cls=0x060400, device="1901", driver="pcieport", group="1")
    sysfs.gpu("01", reset_method="", behind=BRIDGE, audio=False).gpu("02")
    path = "/sys/bus/pci/devices/0000:01:00.0/reset_method"
    assert resets(sysfs) == [lint.Finding(
        domain="gpu-node", check=Check.RESET, severity=Severity.ERROR,
        what="0000:01:00.0 of GPU gpu-a cannot be reset between VMs: every reset method is "
             "turned off (its reset_method is empty)",
        why=RESET_WHY,
        fix=f"echo default > {path} (and find what wrote it empty: a udev rule, a boot "
            "script)")]


def test_a_bus_shared_with_two_devices_is_a_warning_whole(sysfs: FakeSysfs) -> None:
    sysfs.add(BRIDGE, cls=0x060400, device="1901", driver="pcieport", group="1")
    sysfs.gpu("01", reset_method="bus", behind=BRIDGE, audio=False).gpu("02")
    for slot, device in (("01", "0014"), ("02", "0015")):
        sysfs.add(f"0000:01:{slot}.0", cls=0x0c0330, vendor="1912", device=device,
                  driver="xhci_hcd", group="1", reset_method="bus", behind=BRIDGE)
    assert resets(sysfs) == [lint.Finding(
        domain="gpu-node", check=Check.RESET, severity=Severity.WARNING,
        what="0000:01:00.0 of GPU gpu-a is reset only by a reset of its bus, which "
             "0000:01:01.0 (1912:0014), 0000:01:02.0 (1912:0015) share",
        why=f"a bus reset resets every device behind bridge {BRIDGE}, so it resets "
            "0000:01:01.0, 0000:01:02.0 too, and vfio-pci resets the bus between VMs only "
            "while none of them is in use: otherwise " + RESET_WHY,
        fix="put the card in a slot with a root port of its own, or give the other devices "
            "on that bus to no VM that runs while the GPU changes hands")]


# --- slot functions (`_slot_functions`): its error whole -----------------------------------


def test_a_hostdev_on_a_gpus_slot_that_the_card_does_not_have_is_an_error_whole(
        sysfs: FakeSysfs) -> None:
    # 01:00.2 is not in the configuration but on the host (it moves with the slot: nothing
    # to say, and the check goes on); 01:00.3 is on neither.
    sysfs.gpu("01").gpu("02")
    sysfs.add("0000:01:00.2", cls=0x0c0330, device="1ada", group="1")
    xml = domain("gpu-node", gpu("01") + [hostdev("0000:01:00.2"), hostdev("0000:01:00.3")])
    assert lint._slot_functions([lint.parse_domain(xml)], cfg(LENDEE + GPUS),
                                sysfs.root) == [lint.Finding(
        domain="gpu-node", check=Check.SLOT_FUNCTION, severity=Severity.ERROR,
        what="<hostdev> 0000:01:00.3 is on the slot of GPU gpu-a but hostagent does not move "
             "it with gpu-a: the card there has no such function on this host",
        why="hostagent moves a GPU with every function its slot has on the host; a hostdev "
            "it does not know stays in the lendee's live definition, so the owner's start "
            "fails on a device in use.",
        fix="remove the <hostdev> 0000:01:00.3 from gpu-node (virsh edit gpu-node): "
            "`hostagent gpus` lists the functions the card has")]
