"""A GPU's IOMMU group shared with a device of another kind that another VM holds: the
agent neither starts a VM with the GPU nor attaches it live, and says who holds what.
For the lendee the GPU is not free until that VM stops (no failure, no restart): it is
started or lent without it, and the usual regrow takes it once the VM has stopped."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import pytest

from hostagent.service import hotplug
from hostagent.host import journal
from hostagent.service.executor import Executor
from hostagent.host.libvirt import Lifecycle
from hostagent.core.machine import IllegalTransition, free_gpus
from hostagent.core.model import (
    AttachGpus,
    CancelRelend,
    Drained,
    KubeReturn,
    GpuPods,
    GroupsHeld,
    GroupsTaken,
    IntentSource,
    Observed,
    OwnerStopped,
    OwnerWants,
    Phase,
    RelendDue,
    ScheduleRelend,
    StartLendee,
    VmStopped,
)
from tests.sysfs import FakeSysfs
from tests.unit.agents import (  # noqa: F401 (a fixture)
    AGENT_XML,
    FakeLibvirt,
    make_agent,
    no_step_outlives_its_test,
)
from tests.waiting import until
from tests.unit.hotplug_scaffold import AddStep
from tests.unit.partial_world import A
from tests.unit.hotplug_scaffold import ADD as ADD_POLICY
from tests.unit.partial_world import (
    ALL,
    ALL_OR_NOTHING,
    POLICY,
    TOPO,
    B,
    C,
    S,
    go,
    gpus,
    run,
    vms,
)
from tests.unit.machine_scaffold import AT, LENDEE, T

pytestmark = pytest.mark.usefixtures("sink")  # journal records in memory (conftest)

USB = "0000:0c:00.0"  # a USB controller in IOMMU group 10, gpu-a's (0000:0a:00.0)
USB_VM_XML = ("<domain><name>usbvm</name><devices><hostdev mode='subsystem' type='pci' "
              "managed='yes'><source><address domain='0x0000' bus='0x0c' slot='0x00' "
              "function='0x0'/></source></hostdev></devices></domain>")


def shared_group(sysfs: FakeSysfs, gpu_bus: str = "0a") -> FakeSysfs:
    """gpu-a's card and a USB controller in one IOMMU group; gpu-b's alone."""
    sysfs.gpu(gpu_bus, group="10").gpu("0b", group="11")
    return sysfs.add(USB, cls=0x0C0330, vendor="1b21", device="2142", group="10")


class WithUsbVm(FakeLibvirt):
    """usbvm runs with the USB controller passed through."""

    async def xml(self, name: str) -> str:
        return USB_VM_XML if name == "usbvm" else AGENT_XML


def said(sink: journal.ListSink, event: str) -> list[str]:
    return [e.message for e in sink.entries if e.fields.get("HOSTAGENT_EVENT") == event]


async def test_an_owner_is_not_started_while_another_vm_holds_part_of_its_gpus_group(
        tmp_path: Path, sysfs: FakeSysfs, sink: journal.ListSink) -> None:
    agent, _ = make_agent(tmp_path)
    fake = WithUsbVm(agent)
    agent.libvirt = fake
    agent.executor.sysfs = shared_group(sysfs).root
    fake.running.add("usbvm")
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    assert agent.apply(OwnerWants(at=time.time(), owner="gaming1", intent_id="p1",
                                  source=IntentSource.CONTROL))
    await until(lambda: not agent.state.intents)
    assert ("start", "gaming1") not in fake.calls and "gaming1" not in fake.running
    assert agent.state.phase is not Phase.FAILED
    [record] = said(sink, "iommu")
    assert all(word in record for word in ("usbvm", USB, "IOMMU group 10", "gpu-a"))
    answer = [e.message for e in sink.entries if e.fields.get("HOSTAGENT_INTENT") == "p1"]
    assert answer[-1].startswith("could not start gaming1") and "usbvm holds" in answer[-1]


async def test_the_lendee_is_started_without_a_gpu_whose_group_another_vm_holds(
        tmp_path: Path, sysfs: FakeSysfs, sink: journal.ListSink) -> None:
    agent, _ = make_agent(tmp_path, relend="0.05s")
    fake = WithUsbVm(agent)
    agent.libvirt = fake
    agent.executor.sysfs = shared_group(sysfs).root
    fake.running.add("usbvm")
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    await until(lambda: agent.state.phase is Phase.LENT)
    assert fake.live_drop == {"gpu-a"} and agent.state.lent == {"gpu-b"}
    assert said(sink, "iommu") and agent.state.held == {"gpu-a": "usbvm"}
    # usbvm stops: gpu-a is free for the regrow.
    fake.running.discard("usbvm")
    agent.lifecycle("usbvm", Lifecycle.STOPPED)
    await until(lambda: not agent.state.held)
    assert "gpu-a" in free_gpus(agent.state, agent.topo, agent.policy) - agent.state.lent


async def test_a_lendee_that_cannot_do_without_the_gpu_starts_when_the_holder_stops(
        tmp_path: Path, sysfs: FakeSysfs, sink: journal.ListSink) -> None:
    agent, _ = make_agent(tmp_path, relend="0.05s")
    agent.policy = replace(agent.policy, min_gpus=2)
    fake = WithUsbVm(agent)
    agent.libvirt = fake
    agent.executor.sysfs = shared_group(sysfs).root
    fake.running.add("usbvm")
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    await until(lambda: said(sink, "iommu"))
    await until(lambda: not agent.state.lendee_starting)
    assert "gpu-node" not in fake.running and ("start", "gpu-node") not in fake.calls
    assert agent.state.phase is Phase.OFF and "usbvm holds" in (agent.state.reason or "")
    fake.running.discard("usbvm")
    agent.lifecycle("usbvm", Lifecycle.STOPPED)
    await until(lambda: agent.state.phase is Phase.LENT)
    assert fake.live_drop == frozenset() and agent.state.lent == {"gpu-a", "gpu-b"}


async def test_a_vm_that_starts_holding_part_of_a_gpus_group_takes_it_from_the_lendee(
        tmp_path: Path, sysfs: FakeSysfs, sink: journal.ListSink) -> None:
    agent, _ = make_agent(tmp_path)
    fake = WithUsbVm(agent)
    agent.libvirt = fake
    agent.executor.sysfs = shared_group(sysfs).root
    fake.running.add("usbvm")
    agent.lifecycle("usbvm", Lifecycle.STARTED)
    await until(lambda: agent.state.held == {"gpu-a": "usbvm"})
    [record] = said(sink, "iommu")
    assert "gpu-node may not take gpu-a now: usbvm holds 0000:0c:00.0" in record


class HeldStep(AddStep):
    """A hot-add of gpu-a while usbvm, running, holds the USB controller in its group."""

    held_groups = Executor.held_groups
    report_held = Executor.report_held

    def __init__(self, sysfs: FakeSysfs) -> None:
        super().__init__()
        self.sysfs = shared_group(sysfs, gpu_bus="01").root
        self.live_before = set(self.live)
        self.running = {LENDEE, "usbvm"}

    async def running_domains(self) -> set[str]:
        return set(self.running)

    async def xml(self, name: str) -> str:
        return USB_VM_XML if name == "usbvm" else AGENT_XML

    async def attach_live(self, name: str, labels: Collection[str], gpus: object) -> None:
        raise AssertionError("attached a GPU whose group usbvm holds")


async def test_a_gpu_whose_group_another_vm_holds_is_not_attached_live(
        sysfs: FakeSysfs) -> None:
    step = HeldStep(sysfs)
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, GroupsHeld) and dict(event.held) == {A: "usbvm"}
    assert "usbvm holds 0000:0c:00.0" in event.reason and "IOMMU group 10" in event.reason
    assert step.live == step.live_before


async def test_a_hot_add_refused_for_a_held_group_restarts_nothing(sysfs: FakeSysfs) -> None:
    # The restart would drain the node and stop its jobs, only to be refused again.
    step = HeldStep(sysfs)
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    state, actions = go(step.state, event, ADD_POLICY)
    assert (state.phase, state.lent, state.hotadd_failed) == (Phase.LENT, gpus(B, C), False)
    # No regrow is scheduled for gpu-a, not even once the node is idle of GPU pods.
    state, more = go(state, GpuPods(at=AT, count=0), ADD_POLICY)
    assert actions + more == [] and state.relend_at is None


async def test_a_holder_that_stopped_before_the_refusal_landed_holds_nothing(
        sysfs: FakeSysfs, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its stop came before the machine knew of the hold: the GPU must not stay held.
    step = HeldStep(sysfs)
    real = step.running_domains
    calls = 0

    async def stops_after_the_check() -> set[str]:
        nonlocal calls
        calls += 1
        return await real() if calls == 1 else {LENDEE}
    monkeypatch.setattr(step, "running_domains", stops_after_the_check)
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, GroupsHeld) and not event.held
    state, actions = go(step.state, event, ADD_POLICY)
    assert not state.held and actions == [ScheduleRelend(at=event.at)]


# --- the machine: such a GPU is not free until the VM holding its group stops ---------

HELD = {A: "usbvm"}
MIN3 = replace(POLICY, min_gpus=3)


def test_a_lendee_start_refused_for_a_held_group_is_made_again_without_the_gpu() -> None:
    starting = S(Phase.OFF, lendee_starting=True)
    new, actions = go(starting, GroupsHeld(at=AT, gpus=ALL, held=HELD, reason="usbvm holds"))
    assert actions == [ScheduleRelend(at=AT)]
    assert (new.phase, new.lendee_starting, new.lent, new.reason) == (
        Phase.OFF, False, frozenset(), None)
    assert new.held == HELD and free_gpus(new, TOPO, POLICY) == gpus(B, C)
    new, actions = go(new, RelendDue(at=AT))
    assert actions == [StartLendee(gpus=gpus(B, C))]


def test_a_lendee_that_cannot_do_without_waits_off_for_the_vm_to_stop() -> None:
    for policy in (MIN3, ALL_OR_NOTHING):
        new, actions = go(S(Phase.OFF, lendee_starting=True),
                          GroupsHeld(at=AT, gpus=ALL, held=HELD, reason="usbvm holds"), policy)
        assert actions == [] and new.phase is Phase.OFF and new.relend_at is None
        assert new.reason is not None and new.reason.startswith("usbvm holds")
        new, actions = run(new, VmStopped(at=AT, vm="usbvm"), RelendDue(at=AT + 30),
                           policy=policy)
        assert actions == [ScheduleRelend(at=AT + 30), StartLendee(gpus=ALL)]
        assert new.reason is None and not new.held


def test_a_gpu_freed_by_the_holders_stop_is_hot_added() -> None:
    lent = S(Phase.LENT, lent=gpus(B, C), held=HELD, gpu_pods=0)
    assert go(lent, GpuPods(at=AT, count=0), ADD_POLICY)[1] == []  # no regrow for it
    new, actions = run(lent, VmStopped(at=AT, vm="usbvm"), RelendDue(at=AT + 30),
                       policy=ADD_POLICY)
    assert actions == [ScheduleRelend(at=AT + 30), AttachGpus(ticket=T + 1, gpus=gpus(A))]


def test_an_owner_holding_a_group_frees_it_when_it_stops() -> None:
    # gaming2 plays on gpu-b with a USB controller of gpu-a's group passed through.
    lent = S(Phase.LENT, lent=gpus(C), held={A: "gaming2"}, running_owners=vms("gaming2"))
    assert free_gpus(lent, TOPO, ADD_POLICY) == gpus(C)
    new, _ = go(lent, OwnerStopped(at=AT, owner="gaming2"), ADD_POLICY)
    assert not new.held and free_gpus(new, TOPO, ADD_POLICY) == ALL


def test_a_regrow_for_a_gpu_another_vm_took_is_not_begun() -> None:
    due = S(Phase.LENT, lent=gpus(B, C), relend_at=AT + 30, gpu_pods=0)
    new, actions = go(due, GroupsTaken(at=AT, held=HELD))
    assert actions == [CancelRelend()] and new.relend_at is None and new.held == HELD
    # One under way is given up at its drain: the lendee is returned as it is.
    draining = S(Phase.DRAINING, lent=gpus(B, C), regrowing=True, agent_up=True)
    new, actions = run(draining, GroupsTaken(at=AT, held=HELD), Drained(at=AT, ticket=T))
    assert new.phase is Phase.JOINING and actions == [KubeReturn(ticket=T + 1)]


def test_a_gpu_the_lendee_holds_is_not_taken_from_it() -> None:
    new, _ = go(S(Phase.LENT, lent=ALL), GroupsTaken(at=AT, held={A: "gaming-win"}))
    assert not new.held


def test_a_reread_forgets_what_was_held() -> None:
    new, _ = go(S(Phase.LENT, lent=gpus(B, C), held=HELD),
                Observed(at=AT, lendee_running=True, owners_running=frozenset(),
                         lendee_gpus=gpus(B, C)))
    assert not new.held


def test_stale_reports_of_held_groups_are_refused() -> None:
    with pytest.raises(IllegalTransition, match="holds no IOMMU group"):
        go(S(Phase.LENT, held=HELD), VmStopped(at=AT, vm="other"))
    with pytest.raises(IllegalTransition, match="stale report"):
        go(S(Phase.LENT, attaching=gpus(A)),
           GroupsHeld(at=AT, ticket=T - 1, gpus=gpus(A), held=HELD, reason="x"), ADD_POLICY)
    with pytest.raises(IllegalTransition, match="no start"):
        go(S(Phase.OFF), GroupsHeld(at=AT, gpus=ALL, held=HELD, reason="x"))
