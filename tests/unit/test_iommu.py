"""A GPU's IOMMU group shared with a device of another kind that another VM holds: the
agent neither starts a VM with the GPU nor attaches it live, and says who holds what."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hostagent import hotplug, journal
from hostagent.executor import Executor
from hostagent.model import AttachFailed, IntentSource, Observed, OwnerWants, Phase
from tests.sysfs import FakeSysfs
from tests.unit.test_control import (  # noqa: F401 (a fixture)
    AGENT_XML,
    FakeLibvirt,
    make_agent,
    no_step_outlives_its_test,
    until,
)
from tests.unit.test_hotplug import A, AddStep
from tests.unit.test_hotplug import ADD as ADD_POLICY
from tests.unit.test_partial import go, gpus
from tests.unit.machine_scaffold import LENDEE, T

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
    agent.libvirt = fake  # type: ignore[assignment]
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


async def test_the_lendee_is_not_started_with_a_gpu_whose_group_another_vm_holds(
        tmp_path: Path, sysfs: FakeSysfs, sink: journal.ListSink) -> None:
    agent, _ = make_agent(tmp_path, relend="0.05s")
    fake = WithUsbVm(agent)
    agent.libvirt = fake  # type: ignore[assignment]
    agent.executor.sysfs = shared_group(sysfs).root
    fake.running.add("usbvm")
    agent.apply(Observed(at=time.time(), lendee_running=False, owners_running=frozenset()))
    await until(lambda: said(sink, "iommu"))
    await until(lambda: not agent.state.lendee_starting)
    assert "gpu-node" not in fake.running and ("start", "gpu-node") not in fake.calls
    assert agent.state.phase is Phase.OFF and "usbvm holds" in (agent.state.reason or "")


async def test_a_gpu_whose_group_another_vm_holds_is_not_attached_live(
        sysfs: FakeSysfs) -> None:
    class Step(AddStep):
        group_refusal = Executor.group_refusal

        def __init__(self) -> None:
            super().__init__()
            self.sysfs = shared_group(sysfs, gpu_bus="01").root
            self.live_before = set(self.live)

        async def running_domains(self) -> set[str]:
            return {LENDEE, "usbvm"}

        async def xml(self, name: str) -> str:
            return USB_VM_XML if name == "usbvm" else AGENT_XML

        async def attach_live(self, name: str, labels: frozenset[str], gpus: object) -> None:
            raise AssertionError("attached a GPU whose group usbvm holds")

    step = Step()
    await hotplug.hot_add(step, T + 1, gpus(A))  # type: ignore[arg-type]
    [event] = step.applied
    assert isinstance(event, AttachFailed) and event.held == frozenset()
    assert "usbvm holds 0000:0c:00.0" in event.reason and "IOMMU group 10" in event.reason
    assert step.live == step.live_before
    assert go(step.state, event, ADD_POLICY)[0].phase is Phase.LENT
