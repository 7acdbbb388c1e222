"""What the hot-plug tests share (test_hotplug.py, test_unplug.py, test_release.py,
test_iommu.py): the state of a regrow by hot-add, a lendee's definition and its lint,
and the executor's hot-add step with libvirt, the guest and the node stood in for
(`AddStep`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from hostagent.cluster.cycle import PodsReader

from hostagent.core.config import Config, parse
from hostagent.core.model import Event, GroupsHeld, Hotplug, Phase, RelendDue, State, Topology
from hostagent.host import lint
from hostagent.host.libvirt import Domains, ExecResult, HostError
from hostagent.service import hotplug
from hostagent.service.parts import Apply, Cluster, NoCluster, View
from tests.configs import UUID_A, UUID_B, UUID_C, lendee_toml
from tests.fakes import LibvirtStub
from tests.unit.kube_scaffold import Api
from tests.unit.machine_scaffold import AT, LENDEE, T, Stepper, wants
from tests.unit.partial_world import BOTH, POLICY, TOPO, A, B, C, S, gpus, go


ADD = replace(POLICY, hotplug=Hotplug.ADD)


def freed() -> State:
    """gaming1 played on gpu-a and stopped: the lendee runs with gpu-b and gpu-c, two GPU
    pods on its node, and the regrow's timer is due."""
    return S(Phase.LENT, lent=gpus(B, C), gpu_pods=2, relend_at=AT)


def attaching() -> State:
    new, _ = go(freed(), RelendDue(at=AT), ADD)
    return new


LINT_CONFIG = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b"]
[gpus.gpu-a]
pci = "0000:01:00.0"
functions = ["0000:01:00.1"]
[gpus.gpu-b]
pci = "0000:02:00.0"
[owners.gaming1]
gpus = ["gpu-a"]
[policy]
hotplug = "add"
"""


def lendee_xml(*, machine: str = "q35", buses: tuple[int, int] = (1, 2),
               multifunction: bool = False, hotplug_off: bool = False,
               pref64: bool = True) -> str:
    def hostdev(host_bus: int, function: int, guest_bus: int) -> str:
        multi = " multifunction='on'" if multifunction and function == 0 else ""
        return (f"<hostdev mode='subsystem' type='pci' managed='yes'><source>"
                f"<address domain='0x0000' bus='{host_bus:#x}' slot='0x00' "
                f"function='{function:#x}'/></source>"
                f"<address type='pci' domain='0x0000' bus='{guest_bus:#04x}' slot='0x00' "
                f"function='{function if multifunction else 0:#x}'{multi}/></hostdev>")
    target = "<target hotplug='off'/>" if hotplug_off else ""
    ports = "".join(f"<controller type='pci' index='{i}' model='pcie-root-port'>{target}"
                    "</controller>" for i in (1, 2, 3))
    qemu = ("<qemu:commandline><qemu:arg value='-global'/>"
            "<qemu:arg value='pcie-root-port.pref64-reserve=64G'/></qemu:commandline>"
            if pref64 else "")
    return (f"<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
            f"<name>gpu-node</name><os><type machine='{machine}'>hvm</type></os><devices>"
            f"<controller type='pci' index='0' model='pcie-root'/>{ports}"
            f"{hostdev(1, 0, buses[0])}{hostdev(1, 1, buses[1])}{hostdev(2, 0, 3)}"
            "<channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/>"
            f"</channel></devices>{qemu}</domain>")


def hot_add_findings(xml: str, config: str = LINT_CONFIG) -> list[str]:
    found = lint.lint([lint.parse_domain(xml)], config=parse(config))
    return [f"{f.severity}: {f.what}" for f in found if f.check is lint.Check.HOTPLUG]


async def gone(api: Api, namespace: str, name: str) -> bool:
    pod = await api.seed.get_pod(namespace, name)
    return pod is None or bool(pod["metadata"].get("deletionTimestamp"))


class AddStep(LibvirtStub, NoCluster):
    """What of the executor `hotplug.hot_add` uses (`hotplug.Step`, all in one): libvirt
    with the lendee's live GPUs, a guest whose driver does not see gpu-a (its nvidia-smi
    lists gpu-b and gpu-c), a node that advertises what it is told."""

    lendee = LENDEE
    topo = TOPO
    phase_since = 0.0
    save_failed: str | None = None

    def __init__(self) -> None:
        self.cfg = parse('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]\n'
                         + "".join(f'[gpus.gpu-{x}]\npci = "0000:0{i}:00.0"\n'
                                   f'uuid = "{UUID_A[:-1]}{x}"\n'
                                   for i, x in enumerate("abc", 1))
                         + '[owners.gaming1]\ngpus = ["gpu-a"]\n[policy]\nhotplug = "add"\n',
                         "t.toml")
        self.view: View = self
        self.libvirt: Domains = self
        self.cluster: Cluster = self
        self.apply: Apply = self._apply
        self.state = attaching()
        self.applied: list[Event] = []
        self.live = {B, C}
        self.attach_after = 0.0  # seconds before libvirt's attach lands (its thread goes on)
        self.detached: list[frozenset[str]] = []
        self.device_removed = asyncio.Event()

    async def attach_live(self, name: str, labels: Collection[str], gpus: object) -> None:
        done = asyncio.get_running_loop().create_future()

        def land() -> None:
            self.live |= set(labels)
            if not done.done():
                done.set_result(None)
        asyncio.get_running_loop().call_later(self.attach_after, land)
        await done

    async def detach_live(self, name: str, labels: Collection[str], gpus: object) -> None:
        self.detached.append(frozenset(labels))
        self.live -= set(labels)
        self.device_removed.set()

    async def live_gpus(self, name: str, gpus: object) -> frozenset[str]:
        return frozenset(self.live)

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None:
        return None if A not in lent else "nvidia-smi in gpu-node lists 2 GPUs of 3"

    async def grow(self, lent: Collection[str]) -> str | None:
        return None

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "nvidia-smi" and args == list(hotplug.QUERY):
            return ExecResult(0, f"{UUID_B}, 00000000:06:00.0, 1\n"
                                 f"{UUID_C}, 00000000:07:00.0, 2\n", "")
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.UNBIND]:
            return ExecResult(0, "", "")
        raise HostError(f"guest agent of {name}: {path}: Failed to execute child process")

    def lendee_gpu_config(self) -> dict[str, object]:
        return dict(self.cfg.gpus)

    async def held_groups(self, vm: str,
                          gpus: frozenset[str]) -> tuple[dict[str, str], str]:
        return {}, ""  # no other VM holds part of a GPU's IOMMU group (test_iommu.py)

    async def report_held(self, event: GroupsHeld) -> None:
        self.apply(event)

    def _apply(self, event: Event) -> bool:
        self.applied.append(event)
        return True




def lent(*labels: str) -> State:
    return S(Phase.LENT, lent=gpus(*labels) if labels else gpus(A, B, C))


def detaching() -> State:
    """gaming1 asked for gpu-a while gpu-node is lent all three: it is being detached."""
    new, _ = Stepper(TOPO, BOTH).go(lent(), wants("gaming1"))
    return new


UNPLUG_CONFIG = lendee_toml(gpus=("gpu-a", "gpu-b", "gpu-c")) + """
[owners.gaming1]
gpus = ["gpu-a"]
[policy]
hotplug = "both"
"""


class Guest(LibvirtStub):
    """The lendee as libvirt and its guest agent show it: its live GPUs, the files and
    commands the step reads and runs in it (nvidia-smi, the holders of a device node
    through /proc/*/fd, the unbind), and whether it lets a device go when asked. gpu-a
    is /dev/nvidia0 at 0000:05:00.0 in the guest; NVIDIA's device plugin (pid 812)
    holds it open until the plugin is stopped."""

    def __init__(self, step: FakeStep) -> None:
        self.step = step
        self.live = {A, B, C}
        self.checkpoint: tuple[int, str] = (0, checkpoint(
            ("pod-a", "nvidia.com/gpu", {"0": [UUID_A]}),
            ("pod-b", "nvidia.com/gpu", {"0": [UUID_B]})))
        self.holders = {"812/fd/7"}  # "PID/fd/N" of /dev/nvidia0
        self.bound = True
        self.lets_go = True
        self.hangs = False  # nvidia-smi never ends: the driver is stuck
        self.timeouts: list[float] = []
        self.detached: list[frozenset[str]] = []

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        order = self.step.cluster.order
        if path == "cat":
            order.append("checkpoint")
            code, text = self.checkpoint
            return ExecResult(code, text if code == 0 else "", "" if code == 0 else "No such file")
        self.timeouts.append(timeout)  # those of the release, under RELEASE_BOUND
        if path == "nvidia-smi" and args == list(hotplug.QUERY):
            order.append("query")
            if self.hangs:  # as host.libvirt.guest_exec answers a command that never ends
                await asyncio.sleep(timeout)
                raise HostError(f"{path} in {name} did not finish within {timeout:g}s")
            return ExecResult(0, f"{UUID_A}, 00000000:05:00.0, 0\n"
                                 f"{UUID_B}, 00000000:06:00.0, 1\n", "")
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.HOLDERS]:
            order.append("holders")
            assert args[3:] == ["/dev/nvidia0"]
            return ExecResult(0, "".join(f"{h}\n" for h in sorted(self.holders)), "")
        if path == "/bin/sh" and args[:2] == ["-c", hotplug.UNBIND]:
            order.append("unbind")
            assert args[3:] == ["0000:05:00.0"] and not self.holders
            self.bound = False
            return ExecResult(0, "", "")
        raise HostError(f"guest agent of {name}: {path}: Failed to execute child process")

    async def detach_live(self, name: str, labels: Collection[str], gpus: object) -> None:
        self.step.cluster.order.append("detach")
        self.detached.append(frozenset(labels))
        if self.lets_go and not self.bound:  # the driver lets go of an unbound device only
            def removed() -> None:
                self.live -= set(labels)
                self.step.device_removed.set()
            asyncio.get_running_loop().call_later(0.05, removed)

    async def live_gpus(self, name: str, gpus: object) -> frozenset[str]:
        return frozenset(self.live)


class Vacating(NoCluster):
    """`Cluster.vacate` as the step calls it: what it was given, and its answer; it
    cordons (``order``) before it reads which pods use the GPUs, as the real one does."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], frozenset[str], frozenset[str] | None]] = []
        self.order: list[str] = []
        self.until: list[float | None] = []
        self.caps: list[float | None] = []
        self.guest: Guest

    async def vacate(self, owners: list[str], gpus: Collection[str], pods: PodsReader,
                     *, until: float | None = None,
                     grace_cap: float | None = None) -> str | None:
        self.until.append(until)
        self.caps.append(grace_cap)
        self.order.append("cordon")
        read, why = await pods()
        self.calls.append((owners, frozenset(gpus), None if read is None else frozenset(read)))
        return f"which pods use gpu-a is unknown ({why})" if read is None else None

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        self.order.append("withdraw")
        self.guest.holders.discard("812/fd/7")  # the plugin's process is gone
        return None


@dataclass
class FakeStep:
    """What of the executor `hotplug.hot_unplug` uses."""

    cfg: Config = field(default_factory=lambda: parse(UNPLUG_CONFIG, "test.toml"))
    lendee: str = LENDEE
    topo: Topology = TOPO
    applied: list[Event] = field(default_factory=list)
    device_removed: asyncio.Event = field(default_factory=asyncio.Event)
    cluster: Vacating = field(default_factory=Vacating)

    phase_since: float = 0.0
    save_failed: str | None = None

    def __post_init__(self) -> None:
        self.libvirt = Guest(self)
        self.cluster.guest = self.libvirt
        self.view = self
        self.state = detaching()

    async def held_groups(self, vm: str,
                          gpus: frozenset[str]) -> tuple[dict[str, str], str]:
        raise AssertionError("a hot-unplug reads no IOMMU group")

    async def report_held(self, event: GroupsHeld) -> None:
        raise AssertionError("a hot-unplug reports no held group")

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None:
        raise AssertionError("a hot-unplug verifies nothing in the guest")

    def apply(self, event: Event) -> bool:
        self.applied.append(event)
        return True

    def lendee_gpu_config(self) -> dict[str, Any]:
        return dict(self.cfg.gpus)


async def unplug(step: FakeStep) -> None:
    await hotplug.hot_unplug(step, T + 1, gpus(A))


def checkpoint(*entries: tuple[str, str, object]) -> str:
    """The kubelet's device checkpoint: (pod UID, resource, device IDs) each."""
    return json.dumps({"Data": {"PodDeviceEntries": [
        {"PodUID": uid, "ContainerName": "main", "ResourceName": resource,
         "DeviceIDs": ids, "AllocResp": "e30="} for uid, resource, ids in entries],
        "RegisteredDevices": {"nvidia.com/gpu": [UUID_A, UUID_B]}}, "Checksum": 1})


def release_within(cfg: Config, seconds: float) -> Config:
    """`cfg` with ``timeouts.release`` at `seconds`: a bound a test runs out of at once."""
    return replace(cfg, timeouts=replace(cfg.timeouts, release=seconds))
