"""`hostagent lint` against the configuration, word for word: each finding of
`_against_config`, `_not_owners` and `_split` whole (domain, check, severity, what, why,
fix) for domains that make it, the cases that make none, and that each check goes on past
a domain or a group that has nothing to say; then `format_findings`, `errors`, and what
`_bus_of` and `_resets` read of a host whose devices come and go."""

from __future__ import annotations

import textwrap


from hostagent.core.config import Config, parse
from hostagent.host import lint
from hostagent.host.lint import Check, Finding, Severity
from tests.configs import gpus_toml, three_gpus_two_owners
from tests.sysfs import FakeSysfs
from tests.unit.domain_scaffold import domain, gpu, hostdev

GPUS = gpus_toml(("gpu-a", "gpu-b", "gpu-c"), uuids=False, functions=True)

# gpu-node borrowing all three; gaming1 owns gpu-a, gaming2 gpu-b.
CONFIG = three_gpus_two_owners(uuids=False, functions=True)

TWO_LENDEES = """
[lendees.node-a]
gpus = ["gpu-a", "gpu-c"]

[lendees.node-b]
gpus = ["gpu-b"]
""" + GPUS


def cfg(text: str) -> Config:
    return parse(textwrap.dedent(text))


def against(config: Config, xmls: list[str]) -> list[Finding]:
    return lint._against_config([lint.parse_domain(x) for x in xmls], config)


def config_xml(config: Config, xmls: list[str]) -> list[Finding]:
    """The configuration-and-XML findings alone (several lendees also hear of hot-plug)."""
    return [f for f in against(config, xmls) if f.check is Check.CONFIG_XML]


# --- a GPU the configuration gives a VM that its XML lacks ----------------------------------

LENDEE_LACKS_WHY = ("the agent starts the lendee from its persistent definition minus the GPUs "
                    "in use, so a GPU missing there is never lent, and the in-guest check "
                    "fails after every lend.")
OWNER_LACKS_WHY = ("hostagent moves GPUs by what the config says, so it would lend or reclaim "
                   "a card this VM does not use and leave the one it uses alone.")


def lacks(name: str, verb: str, label: str, address: str, key: str) -> Finding:
    lendee = verb == "borrows"
    return Finding(
        domain=name, check=Check.CONFIG_XML, severity=Severity.ERROR,
        what=f"the config says {name} {verb} {label} but its "
             f"{'persistent definition' if lendee else 'XML'} has no <hostdev> for {address}",
        why=LENDEE_LACKS_WHY if lendee else OWNER_LACKS_WHY,
        fix=f"add the hostdev (virsh edit {name}) or fix {key} / gpus.{label}")


def test_the_lendee_and_an_owner_lacking_a_configured_gpu_are_errors_whole() -> None:
    # gaming1 is not among the domains: nothing to say of it, and gaming2, after it in
    # the configuration, is still checked.
    found = against(cfg(CONFIG), [
        domain("gpu-node", gpu("01") + [hostdev("0000:02:00.0")] + gpu("03")),
        domain("gaming2", [hostdev("0000:02:00.1")])])
    assert found == [
        lacks("gpu-node", "borrows", "gpu-b", "0000:02:00.1", "lendee.gpus"),
        lacks("gaming2", "owns", "gpu-b", "0000:02:00.0", "owners.gaming2.gpus")]


def test_with_several_lendees_the_key_names_the_lendee() -> None:
    found = config_xml(cfg(TWO_LENDEES), [domain("node-a", gpu("01") + [hostdev("0000:03:00.1")]),
                                           domain("node-b", gpu("02"))])
    assert found == [lacks("node-a", "borrows", "gpu-c", "0000:03:00.0", "lendees.node-a.gpus")]


def test_domains_with_the_gpus_the_configuration_gives_them_make_no_finding() -> None:
    assert against(cfg(CONFIG), [domain("gpu-node", gpu("01") + gpu("02") + gpu("03")),
                                 domain("gaming1", gpu("01")), domain("gaming2", gpu("02")),
                                 domain("other", [])]) == []


# --- a GPU in a VM's XML that the configuration does not give it -----------------------------

NOT_GIVEN_WHY = ("hostagent does not free that GPU for this VM, so its start fails whenever "
                 "another VM holds it.")


def not_given(name: str, address: str, label: str, given: str, key: str) -> Finding:
    return Finding(
        domain=name, check=Check.CONFIG_XML, severity=Severity.ERROR,
        what=f"{name}'s XML has {address} of GPU {label}, but {given}",
        why=NOT_GIVEN_WHY,
        fix=f"add {label} to {key}, or remove the hostdev from {name}")


def test_a_gpu_the_configuration_gives_to_others_or_to_nobody_is_an_error_whole() -> None:
    # gaming1 has gpu-b, which gaming2 owns, and gpu-c, which no owner has.
    found = against(cfg(CONFIG), [domain("gaming1", gpu("01") + gpu("02") + gpu("03"))])
    assert found == [
        not_given("gaming1", "0000:02:00.0", "gpu-b", "the config gives it to gaming2",
                  "owners.gaming1.gpus"),
        not_given("gaming1", "0000:02:00.1", "gpu-b", "the config gives it to gaming2",
                  "owners.gaming1.gpus"),
        not_given("gaming1", "0000:03:00.0", "gpu-c", "the config does not give it to gaming1",
                  "owners.gaming1.gpus"),
        not_given("gaming1", "0000:03:00.1", "gpu-c", "the config does not give it to gaming1",
                  "owners.gaming1.gpus")]


def test_a_lendee_with_another_lendees_gpu_is_told_its_own_key() -> None:
    found = config_xml(cfg(TWO_LENDEES),
                       [domain("node-b", gpu("02") + [hostdev("0000:01:00.0")])])
    assert found == [not_given("node-b", "0000:01:00.0", "gpu-a",
                               "the config does not give it to node-b", "lendees.node-b.gpus")]


# --- a VM that is no owner passing through a lent GPU ---------------------------------------


def not_an_owner(name: str, shown: str, label: str) -> Finding:
    return Finding(
        domain=name, check=Check.NOT_AN_OWNER, severity=Severity.WARNING,
        what=f"{name} passes through {shown}, which gpu-node borrows, but is not an owner",
        why="hostagent frees a GPU only for an owner: while the lendee holds it, virsh start "
            f"{name} fails with libvirt's device-in-use error, and while {name} runs, the "
            "lendee cannot start with it.",
        fix=f'make it an owner ([owners.{name}] gpus = ["{label}"]), or remove the hostdev '
            f"from {name} (virsh edit {name})")


def test_a_vm_that_is_no_owner_with_a_lent_gpu_warns_whole() -> None:
    # old-win has part of gpu-b; stand-in has gpu-c by its user alias only (the lab's
    # disks); nothing has gpu-a, and a VM with no GPU says nothing.
    stand_in = ("<disk type='file' device='disk'><source file='/lab/gpu-c.img'/>"
                "<target dev='vdb' bus='virtio'/><alias name='ua-hostagent-gpu-c'/></disk>")
    found = against(cfg(CONFIG), [domain("empty", []),
                                  domain("old-win", [hostdev("0000:02:00.1")]),
                                  domain("stand-in", [stand_in])])
    assert found == [not_an_owner("old-win", "gpu-b (0000:02:00.1)", "gpu-b"),
                     not_an_owner("stand-in", "gpu-c", "gpu-c")]


# --- a GPU's functions split between VMs (`_split`) -----------------------------------------

SPLIT_FIX = "give each VM that uses this card all of its functions"


def split(sysfs: FakeSysfs, xmls: list[str]) -> list[Finding]:
    return lint._split([lint.parse_domain(x) for x in xmls], sysfs.root)


def test_disjoint_functions_of_one_gpu_are_an_error_whole(sysfs: FakeSysfs) -> None:
    sysfs.gpu("01")
    found = split(sysfs, [domain("gpu-node", [hostdev("0000:01:00.1")]),
                          domain("gaming1", [hostdev("0000:01:00.0")])])
    assert found == [Finding(
        domain=name, check=Check.SPLIT_GPU, severity=Severity.ERROR,
        what="the functions of IOMMU group 1 are split between VMs: gaming1 has "
             "0000:01:00.0; gpu-node has 0000:01:00.1",
        why="VFIO gives a whole IOMMU group to one VM at a time, so these VMs cannot run "
            "together even though their XML says they share nothing.",
        fix=SPLIT_FIX) for name in ("gaming1", "gpu-node")]


def test_part_of_what_another_vm_has_is_a_warning_whole_and_every_group_is_checked(
        sysfs: FakeSysfs) -> None:
    # Group 1: both VMs have the whole GPU, nothing to say; group 2: gaming1 has part.
    sysfs.gpu("01").gpu("02")
    found = split(sysfs, [domain("gpu-node", gpu("01") + gpu("02")),
                          domain("gaming1", gpu("01") + [hostdev("0000:02:00.0")])])
    assert found == [Finding(
        domain=name, check=Check.SPLIT_GPU, severity=Severity.WARNING,
        what="the functions of IOMMU group 2 are split between VMs: gaming1 has "
             "0000:02:00.0; gpu-node has 0000:02:00.0, 0000:02:00.1",
        why="functions left behind stay on the host while the other VM runs, and a GPU's "
            "audio function is expected to move with it.",
        fix=SPLIT_FIX) for name in ("gaming1", "gpu-node")]


def test_functions_the_host_lacks_or_of_a_group_of_several_cards_are_told_by_device(
        sysfs: FakeSysfs) -> None:
    sysfs.gpu("01", group="7").gpu("02", group="7")
    found = split(sysfs, [domain("a", [hostdev("0000:09:00.0"), hostdev("0000:01:00.0")]),
                          domain("b", [hostdev("0000:09:00.1"), hostdev("0000:01:00.1")]),
                          domain("c", gpu("02"))])
    assert [(f.domain, f.severity, f.what) for f in found] == [
        (name, Severity.ERROR, f"the functions of device 0000:{bus}:00 are split between VMs: "
                               f"a has 0000:{bus}:00.0; b has 0000:{bus}:00.1")
        for bus in ("01", "09") for name in ("a", "b")]


# --- what the command prints, and which findings fail it ------------------------------------


def test_format_findings_and_errors() -> None:
    error = Finding(domain="gpu-node", check=Check.NOT_Q35, severity=Severity.ERROR,
                    what="w1", why="y1", fix="f1")
    warning = Finding(domain="gaming1", check=Check.ROM_BAR, severity=Severity.WARNING,
                      what="w2", why="y2", fix="f2")
    assert lint.format_findings([error, warning]) == (
        "gpu-node: error: w1\n  why: y1\n  fix: f1\n"
        "gaming1: warning: w2\n  why: y2\n  fix: f2")
    assert lint.format_findings([]) == ""
    assert lint.errors([warning, error, warning]) == [error]
    assert lint.errors([warning]) == []


# --- the host as it changes under the reads -------------------------------------------------

BRIDGE = "0000:00:01.0"
ONE_GPU = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"
"""


def test_the_bus_of_a_function_the_host_does_not_have_is_unknown(sysfs: FakeSysfs) -> None:
    sysfs.add(BRIDGE, cls=0x060400, device="1901", driver="pcieport", group="1")
    sysfs.gpu("01", behind=BRIDGE, audio=False)
    sysfs.add("0000:01:01.0", cls=0x0c0330, vendor="1912", device="0014", behind=BRIDGE)
    assert lint._bus_of("0000:01:00.0", sysfs.root) == (BRIDGE, ["0000:01:01.0"])
    assert lint._bus_of(BRIDGE, sysfs.root) == (None, [])
    assert lint._bus_of("0000:09:00.0", sysfs.root) == (None, [])


def test_a_device_gone_from_the_bus_between_reads_is_named_by_its_address(
        sysfs: FakeSysfs) -> None:
    # 01:01.0 is still in the bridge's directory but no longer among the PCI devices (it
    # was removed between the two reads): it is named without its ids.
    sysfs.add(BRIDGE, cls=0x060400, device="1901", driver="pcieport", group="1")
    sysfs.gpu("01", reset_method="bus", behind=BRIDGE, audio=False)
    sysfs.add("0000:01:01.0", cls=0x0c0330, vendor="1912", device="0014", behind=BRIDGE)
    (sysfs.root / "bus/pci/devices/0000:01:01.0").unlink()
    found = lint._resets(cfg(ONE_GPU), sysfs.root)
    assert [(f.severity, f.what) for f in found] == [(
        Severity.WARNING, "0000:01:00.0 of GPU gpu-a is reset only by a reset of its bus, "
                          "which 0000:01:01.0 shares")]


def test_a_gpu_given_by_uuid_alone_is_not_checked_for_resets_until_placed(
        sysfs: FakeSysfs) -> None:
    # Its functions have no reset and no bridge, but it has no PCI address yet: the agent
    # places it where NVML sees it when it starts, and checks it then.
    sysfs.gpu("01", reset_method=None)
    config = cfg("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-a"]

        [gpus.gpu-a]
        uuid = "GPU-5f2ab1c4-0000-4000-8000-000000000001"
        functions = ["0000:01:00.1"]
        """)
    assert lint._resets(config, sysfs.root) == []
    # Placed, the same card is an error.
    placed = cfg(ONE_GPU.replace('pci = "0000:01:00.0"',
                                 'pci = "0000:01:00.0"\nfunctions = ["0000:01:00.1"]'))
    assert [f.what for f in lint._resets(placed, sysfs.root)] == [
        f"0000:01:00.{fn} of GPU gpu-a cannot be reset between VMs: it has no reset method "
        "and no bridge above it whose bus could be reset" for fn in "01"]


# --- which lendee hears that an owned GPU and a free one share a group ----------------------


def test_an_owned_and_an_unowned_gpu_in_one_group_warn_the_first_gpus_lendee(
        sysfs: FakeSysfs) -> None:
    # gpu-a and gpu-b share group 7; gaming1 owns gpu-b, gpu-a has no owner.
    sysfs.gpu("01", group="7").gpu("02", group="7").gpu("03")
    what = ("gpu-a and gpu-b share IOMMU group 7: they move together (gpu-a (no owner), "
            "gpu-b (gaming1))")

    def told(text: str) -> list[tuple[str, Severity, str]]:
        found = lint._shared_groups([], sysfs.root, cfg(text + GPUS))
        return [(f.domain, f.severity, f.what) for f in found]

    # gpu-a is node-b's, not the first lendee's (node-a), and gpu-b no lendee's.
    assert told("""
        [lendees.node-a]
        gpus = ["gpu-c"]
        [lendees.node-b]
        gpus = ["gpu-a"]
        [owners.gaming1]
        gpus = ["gpu-b"]
        """) == [("node-b", Severity.WARNING, what)]
    # gpu-a is no lendee's (gaming2 alone uses it): the lendee hears of it.
    assert told("""
        [lendee]
        domain = "gpu-node"
        gpus = ["gpu-b", "gpu-c"]
        [owners.gaming2]
        gpus = ["gpu-a"]
        """) == [("gpu-node", Severity.WARNING,
                  "gpu-a and gpu-b share IOMMU group 7: they move together (gpu-a (gaming2), "
                  "gpu-b (no owner))")]


def test_a_gpu_labelled_with_another_devices_slot_is_not_that_device(
        sysfs: FakeSysfs) -> None:
    # Two USB controllers share group 9 and no GPU; gpu-a at 01:00.0 is labelled
    # "0000:05:00", the first controller's slot. The group holds no GPU: nothing to say.
    sysfs.gpu("01")
    for slot in ("05", "06"):
        sysfs.add(f"0000:{slot}:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="9")
    config = cfg("""
        [lendee]
        domain = "gpu-node"
        gpus = ["0000:05:00"]

        [gpus."0000:05:00"]
        pci = "0000:01:00.0"

        [owners.gaming1]
        gpus = ["0000:05:00"]
        """)
    doms = [lint.parse_domain(domain("usb-vm", [hostdev("0000:05:00.0")])),
            lint.parse_domain(domain("usb-vm2", [hostdev("0000:06:00.0")]))]
    assert lint._shared_groups(doms, sysfs.root, config) == []


def test_a_group_without_a_gpu_does_not_end_the_check_of_the_groups_after_it(
        sysfs: FakeSysfs) -> None:
    # Group 1: two USB controllers in two VMs, no GPU; group 7, read after it: gpu-a and
    # gpu-b of different owners.
    for slot in ("05", "06"):
        sysfs.add(f"0000:{slot}:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="1")
    sysfs.gpu("01", group="7").gpu("02", group="7")
    doms = [lint.parse_domain(domain("usb-vm", [hostdev("0000:05:00.0")])),
            lint.parse_domain(domain("usb-vm2", [hostdev("0000:06:00.0")]))]
    assert [f.what for f in lint._shared_groups(doms, sysfs.root, cfg(CONFIG))] == [
        "GPUs of different owners share IOMMU group 7: gpu-a (gaming1), gpu-b (gaming2)"]
