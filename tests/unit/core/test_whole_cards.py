"""A GPU is its whole slot, and an IOMMU group moves as one (DESIGN.md, invariant 11):
the configuration placed on a host (fake sysfs), the lendee's live definition without a
card, the machine with GPUs that share a group, and what lint says about both."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from hostagent.core import devices
from hostagent.host import gpus, lint
from hostagent.core.topology import topology
from hostagent.core.config import ConfigError, parse
from hostagent.surfaces.follow import format_status
from hostagent.host.lint import Check, Severity
from hostagent.core.machine import conflict, free_gpus, step, verdict
from hostagent.core.model import (
    Drain,
    IntentSource,
    LendeeStopped,
    Observed,
    OwnerStarted,
    OwnerWants,
    Phase,
    Policy,
    RelendDue,
    StartLendee,
    StartOwner,
    State,
    Topology,
)
from tests.unit.domain_scaffold import CHANNEL, hostdev

CONFIG = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b", "gpu-c"]

[gpus.gpu-a]
pci = "0000:01:00.0"
functions = ["0000:01:00.1"]

[gpus.gpu-b]
pci = "0000:02:00.0"

[gpus.gpu-c]
pci = "0000:03:00.0"

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]
"""


def turing(sysfs: Any, bus: str, group: str) -> None:
    """A Turing card: VGA, HDMI audio, USB and UCSI, four functions of one slot."""
    for function, cls in enumerate((0x030000, 0x040300, 0x0c0330, 0x0c8000)):
        sysfs.add(f"0000:{bus}:00.{function}", cls=cls, group=group)


@pytest.fixture
def host(sysfs: Any) -> Any:
    # gpu-a is a Turing card; gpu-b and gpu-c sit behind one root port without ACS.
    turing(sysfs, "01", "1")
    sysfs.gpu("02", group="2").gpu("03", group="2", audio=False)
    return sysfs


def xml(name: str, addresses: list[str]) -> str:
    body = "\n    ".join([*(hostdev(a) for a in addresses), CHANNEL])
    return (f"<domain type='kvm'>\n  <name>{name}</name>\n  <os firmware='efi'>\n    <type "
            f"arch='x86_64' machine='pc-q35-7.2'>hvm</type>\n  </os>\n  <devices>\n    {body}"
            "\n  </devices>\n</domain>\n")


LENDEE_XML = xml("gpu-node", [f"0000:01:00.{f}" for f in range(4)]
                 + ["0000:02:00.0", "0000:02:00.1", "0000:03:00.0"])


# --- every function of a card's slot moves with it ------------------------------------------


def test_the_lendee_without_a_card_keeps_none_of_its_functions(host: Any) -> None:
    placed = gpus.on_host(parse(CONFIG), host.root)
    assert placed.gpus["gpu-a"].pci_functions == tuple(f"0000:01:00.{f}" for f in range(4))
    assert placed.gpus["gpu-b"].pci_functions == ("0000:02:00.0", "0000:02:00.1")
    live = devices.without(LENDEE_XML, {"gpu-a"}, placed.gpus)
    assert "bus='0x01'" not in live  # the USB and UCSI functions went too
    assert devices.gpus_in(live, placed.gpus) == {"gpu-b", "gpu-c"}
    assert live.count("<hostdev") == 3


def test_a_listed_function_the_host_lacks_is_an_error_naming_it(host: Any) -> None:
    text = CONFIG.replace('functions = ["0000:01:00.1"]', 'functions = ["0000:01:00.7"]')
    with pytest.raises(ConfigError) as info:
        gpus.on_host(parse(text, "c.toml"), host.root)
    devices = host.root / "bus/pci/devices"
    assert str(info.value) == (
        f"c.toml: gpus.gpu-a.functions[0]: 0000:01:00.7 is not on this host ({devices} has "
        "no such device); write the address lspci -D shows (`hostagent gpus` lists the "
        "display devices with their functions); a card's own functions need not be listed: "
        "they move with it")
    with pytest.raises(ConfigError) as info:
        gpus.on_host(parse(CONFIG.replace("0000:03:00.0", "0000:09:00.0"), "c.toml"), host.root)
    assert str(info.value) == (
        f"c.toml: gpus.gpu-c.pci: 0000:09:00.0 is not on this host ({devices} has no such "
        "device); write the address lspci -D shows (`hostagent gpus` lists the display "
        "devices with their functions)")
    # Two GPUs on one card's slot: one card is one GPU.
    with pytest.raises(ConfigError) as info:
        gpus.on_host(parse(CONFIG.replace("0000:03:00.0", "0000:01:00.2"), "c.toml"), host.root)
    assert str(info.value) == (
        "c.toml: gpus.gpu-c.pci: 0000:01:00.2 is on the slot of GPU gpu-a; one card is one "
        "GPU: its other functions move with it, so remove one of the two")


def test_status_shows_every_function_and_what_moves_together() -> None:
    data: dict[str, Any] = {
        "lendee": {"domain": "gpu-node", "phase": "off", "reason": None, "since": 0,
                   "hold": False},
        "gpus": [{"gpu": "gpu-a", "name": None, "pci": "0000:01:00.0", "owners": ["gaming1"],
                  "holder": None, "moves_with": [],
                  "functions": ["0000:01:00.1", "0000:01:00.2", "0000:01:00.3"]},
                 {"gpu": "gpu-b", "name": None, "pci": "0000:02:00.0", "owners": [],
                  "holder": None, "functions": [], "moves_with": ["gpu-c"]},
                 {"gpu": "gpu-c", "name": None, "pci": "0000:03:00.0", "owners": [],
                  "holder": None, "functions": [], "moves_with": ["gpu-b"]}],
        "intents": [], "relend_in_s": None}
    text = format_status(data)
    assert "0000:01:00.0+.1+.2+.3" in text
    assert "gpu-b and gpu-c share an IOMMU group: lent and reclaimed together" in text


def test_lint_a_hostdev_on_a_gpus_slot_the_agent_would_not_move(host: Any) -> None:
    # The XML passes a function the card on this host does not have.
    cfg = gpus.on_host(parse(CONFIG), host.root)
    domains = [lint.parse_domain(LENDEE_XML.replace("function='0x3'", "function='0x5'"))]
    found = [f for f in lint.lint(domains, sysfs=host.root, config=cfg)
             if f.check is Check.SLOT_FUNCTION]
    assert [(f.domain, f.severity) for f in found] == [("gpu-node", Severity.ERROR)]
    assert found[0].what.startswith("<hostdev> 0000:01:00.5 is on the slot of GPU gpu-a but "
                                    "hostagent does not move it with gpu-a")
    assert "remove the <hostdev> 0000:01:00.5 from gpu-node" in found[0].fix
    # Every function the host has moves with the card, listed or not: nothing to say.
    domains = [lint.parse_domain(LENDEE_XML)]
    assert not [f for f in lint.lint(domains, sysfs=host.root, config=cfg)
                if f.check is Check.SLOT_FUNCTION]


# --- an IOMMU group moves as one --------------------------------------------------------------

A, B, C = "gpu-a", "gpu-b", "gpu-c"
# gaming2's gpu-b shares a group with gpu-c, which nobody owns.
TOPO = Topology(lendee="gpu-node", lendee_gpus=frozenset({A, B, C}),
                owners={"gaming1": frozenset({A}), "gaming2": frozenset({B})},
                groups=(frozenset({B, C}),))
POLICY = Policy(relend_delay=30.0)


def wants(owner: str) -> OwnerWants:
    return OwnerWants(at=100.0, owner=owner, intent_id=f"i-{owner}", source=IntentSource.HOOK)


def test_the_topology_groups_gpus_whose_functions_share_an_iommu_group(host: Any) -> None:
    topo = topology(gpus.on_host(parse(CONFIG), host.root))
    assert topo.groups == (frozenset({B, C}),)
    assert topo.claims("gaming2") == {B, C} and topo.claims("gaming1") == {A}
    assert topo.shared_gpus("gaming2") == {B, C}
    with pytest.raises(ValueError, match="gpu-b in two IOMMU groups"):
        Topology(lendee="n", lendee_gpus=frozenset({A}), owners={},
                 groups=(frozenset({A, B}), frozenset({B, C})))


def test_the_lendee_never_starts_with_part_of_a_group() -> None:
    state = State(running_owners=frozenset({"gaming2"}))
    assert free_gpus(state, TOPO, POLICY) == {A}
    state, actions = step(State(phase=Phase.OFF, running_owners=frozenset({"gaming2"}),
                                relend_at=100.0),
                          RelendDue(at=100.0), topo=TOPO, policy=POLICY)
    assert actions == [StartLendee(gpus=frozenset({A}))]


def test_an_owners_start_reclaims_the_whole_group() -> None:
    # The lendee runs with gpu-c only (read back after a restart): gaming2 needs it too.
    state, _ = step(State(), Observed(at=99.0, lendee_running=True,
                                      owners_running=frozenset(), lendee_gpus=frozenset({C})),
                    topo=TOPO, policy=POLICY)
    assert state.lent == {C}
    decision, why = verdict(state, "gaming2", topo=TOPO)
    assert decision == "defer" and "gpu-node holds gpu-c" in why
    state, actions = step(state, wants("gaming2"), topo=TOPO, policy=POLICY)
    assert state.phase is Phase.DRAINING and actions == [Drain(ticket=state.ticket)]
    stopped = State(phase=Phase.STOPPING, lent=frozenset({C}), intents=state.intents,
                    ticket=state.ticket)
    state, actions = step(stopped, LendeeStopped(at=101.0), topo=TOPO, policy=POLICY)
    assert StartOwner(owner="gaming2") in actions


def test_owners_of_one_group_exclude_each_other() -> None:
    topo = Topology(lendee="gpu-node", lendee_gpus=frozenset({A, B, C}),
                    owners={"gaming2": frozenset({B}), "gaming3": frozenset({C})},
                    groups=(frozenset({B, C}),))
    state = State(running_owners=frozenset({"gaming2"}))
    assert conflict(state, "gaming3", topo) == "gpu-b, gpu-c are in use by gaming2"
    assert verdict(state, "gaming3", topo=topo)[0] == "refuse"
    state, _ = step(State(), OwnerStarted(at=1.0, owner="gaming2"), topo=topo, policy=POLICY)
    assert free_gpus(state, topo, POLICY) == {A}


def test_lint_different_owners_sharing_a_group_is_an_error(host: Any) -> None:
    text = CONFIG + '\n[owners.gaming3]\ngpus = ["gpu-c"]\n'
    cfg = gpus.on_host(parse(text), host.root)
    domains = [lint.parse_domain(LENDEE_XML),
               lint.parse_domain(xml("gaming2", ["0000:02:00.0", "0000:02:00.1"])),
               lint.parse_domain(xml("gaming3", ["0000:03:00.0"]))]
    found = lint.lint(domains, sysfs=host.root, config=cfg)
    shared = [f for f in found if f.check is Check.SHARED_GROUP]
    assert [(f.domain, f.severity) for f in shared] == [("gaming2, gaming3", Severity.ERROR)]
    assert shared[0].what == ("GPUs of different owners share IOMMU group 2: gpu-b (gaming2), "
                              "gpu-c (gaming3)")
    assert "hostagent lends and reclaims gpu-b and gpu-c together" in shared[0].why
    assert "pcie_acs_override" in shared[0].fix and "peer-to-peer DMA" in shared[0].fix
    # Not the audio function's reason: the cards are whole in every VM.
    assert not [f for f in found if f.check is Check.SPLIT_GPU]
    # gpu-c owned by nobody: it moves with gpu-b, a warning that says so.
    cfg = gpus.on_host(parse(CONFIG), host.root)
    shared = [f for f in lint.lint(domains[:2], sysfs=host.root, config=cfg)
              if f.check is Check.SHARED_GROUP]
    assert [(f.domain, f.severity) for f in shared] == [("gpu-node", Severity.WARNING)]
    assert shared[0].what.startswith("gpu-b and gpu-c share IOMMU group 2: they move together")
    assert "while gaming2 plays, the lendee has none of gpu-b and gpu-c" in shared[0].why


def test_config_example_needs_no_functions(host: Any) -> None:
    cfg = parse(textwrap.dedent(CONFIG).replace('functions = ["0000:01:00.1"]\n', ""))
    assert gpus.on_host(cfg, host.root).gpus["gpu-a"].functions == tuple(
        f"0000:01:00.{f}" for f in range(1, 4))


def test_lint_a_group_shared_with_a_device_that_is_no_gpu_names_the_vms_as_an_error(
        host: Any) -> None:
    # A USB controller in gpu-a's group, passed through to gaming2: VFIO gives the group to
    # one VM at a time, and hostagent moves GPUs only, so gaming2 and whoever holds gpu-a
    # (gaming1, or the lendee) cannot run together.
    host.add("0000:05:00.0", cls=0x0c0330, vendor="1b21", device="2142", group="1")
    cfg = gpus.on_host(parse(CONFIG), host.root)
    domains = [lint.parse_domain(LENDEE_XML),
               lint.parse_domain(xml("gaming1", [f"0000:01:00.{f}" for f in range(4)])),
               lint.parse_domain(xml("gaming2", ["0000:02:00.0", "0000:02:00.1",
                                                 "0000:05:00.0"]))]
    shared = [f for f in lint.lint(domains, sysfs=host.root, config=cfg)
              if f.check is Check.SHARED_GROUP and "group 1" in f.what]
    assert [(f.domain, f.severity) for f in shared] == [
        ("gaming1, gaming2, gpu-node", Severity.ERROR)]
    assert shared[0].what == ("IOMMU group 1 holds 0000:05:00, no GPU, with gpu-a: gpu-a in "
                              "gaming1, gpu-node; 0000:05:00 in gaming2")
    assert "one VM at a time" in shared[0].why and "moves GPUs only" in shared[0].why


def test_lint_per_lendee_and_a_group_split_between_two_lendees(host: Any) -> None:
    text = CONFIG.replace('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]',
                          '[lendees.node-a]\ngpus = ["gpu-a", "gpu-b"]\n'
                          '[lendees.node-c]\ngpus = ["gpu-c"]')
    cfg = gpus.on_host(parse(text), host.root)
    domains = [lint.parse_domain(xml("node-a", [f"0000:01:00.{f}" for f in range(4)]
                                     + ["0000:02:00.0", "0000:02:00.1"])),
               lint.parse_domain(xml("node-c", ["0000:03:00.0", "0000:01:00.0"]))]
    found = lint.lint(domains, sysfs=host.root, config=cfg)
    shared = [f for f in found if f.check is Check.SHARED_GROUP]
    assert [(f.domain, f.severity) for f in shared][0] == ("node-a, node-c", Severity.ERROR)
    assert shared[0].what == "gpu-b and gpu-c share IOMMU group 2 but are lent to node-a and node-c"
    # Each lendee is checked against its own GPUs, under its own key.
    xml_findings = [f for f in found if f.check is Check.CONFIG_XML]
    assert [(f.domain, f.fix) for f in xml_findings] == [
        ("node-c", "add gpu-a to lendees.node-c.gpus, or remove the hostdev from node-c")]
