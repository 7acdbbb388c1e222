"""Hot-add on regrow (``policy.hotplug = "add"``), the machine's half: GPUs a game freed
are attached to the running lendee instead of a restart, the node stays lent, and a
hot-add that fails leaves them to the regrow by restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from dataclasses import replace
from pathlib import Path

import pytest

from hostagent.service import hotplug
from hostagent.host import lint
from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import Config, ConfigError, parse
from hostagent.cluster.kube import Kube
from hostagent.host.libvirt import ExecResult
from hostagent.surfaces.metrics import Metrics
from hostagent.core.machine import IllegalTransition, still_wanted, verdict
from hostagent.core.model import (
    AttachFailed,
    AttachGpus,
    Drain,
    GpuPods,
    GpusAttached,
    Hotplug,
    LendeeStopped,
    Observed,
    OwnerStopped,
    Phase,
    Policy,
    RelendDue,
    ScheduleRelend,
)
from tests.controlplane import ControlPlane
from tests.fakes import LibvirtStub
from tests.controlplane.nvidia import Driver
from tests.controlplane.nvidia import gpu as gpu_device
from tests.configs import UUID_A, UUID_B, lendee_toml
from tests.unit.kube_scaffold import Api, gpu_node_api
from tests.unit.machine_scaffold import AT, LENDEE, T, wants
from tests.unit.partial_world import POLICY, TOPO, B, C, S, gpus, go, run, vms
from tests.waiting import until
from tests.unit.hotplug_scaffold import (
    ADD,
    AddStep,
    attaching,
    freed,
    gone,
    hot_add_findings,
    lendee_xml,
    LINT_CONFIG,
)

A = "gpu-a"


def test_a_regrow_by_hot_add_attaches_the_freed_gpu_while_gpu_pods_run() -> None:
    new, actions = go(freed(), RelendDue(at=AT), ADD)
    assert actions == [AttachGpus(ticket=T + 1, gpus=gpus(A))]
    assert (new.phase, new.lent, new.attaching) == (Phase.LENT, gpus(A, B, C), gpus(A))
    assert (new.relend_at, new.regrow_waiting, new.ticket) == (None, False, T + 1)


def test_without_hotplug_the_same_regrow_waits_for_the_pods() -> None:
    new, actions = go(freed(), RelendDue(at=AT), POLICY)
    assert new.regrow_waiting and not any(isinstance(a, AttachGpus) for a in actions)


def test_hot_add_never_restarts_even_when_regrow_is_never() -> None:
    state, actions = run(S(Phase.LENT, lent=gpus(B, C), running_owners=vms("gaming1")),
                         OwnerStopped(at=AT, owner="gaming1"), RelendDue(at=AT + 30),
                         policy=replace(ADD, regrow=POLICY.regrow.NEVER))
    assert actions == [ScheduleRelend(at=AT + 30), AttachGpus(ticket=T + 1, gpus=gpus(A))]
    assert not any(isinstance(a, Drain) for a in actions)


def test_the_gpu_is_lent_once_attached() -> None:
    new, actions = go(attaching(), GpusAttached(at=AT, ticket=T + 1, gpus=gpus(A)), ADD)
    assert (new.phase, new.lent, new.attaching, new.ticket) == (
        Phase.LENT, gpus(A, B, C), frozenset(), T + 2)
    assert actions == []


def test_a_failed_hot_add_leaves_the_gpu_to_a_regrow_by_restart() -> None:
    new, actions = go(attaching(), AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                held=frozenset(), reason="no"), ADD)
    assert (new.phase, new.lent, new.attaching, new.hotadd_failed) == (
        Phase.LENT, gpus(B, C), frozenset(), True)
    assert actions == [ScheduleRelend(at=AT + 30)]
    # The regrow that follows is the restart, when the node is idle of GPU pods.
    new, actions = run(new, GpuPods(at=AT, count=0), RelendDue(at=AT + 30), policy=ADD)
    assert actions == [Drain(ticket=T + 3, regrow=True)]


def test_a_failed_hot_add_keeps_what_the_live_definition_holds() -> None:
    new, actions = go(attaching(), AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                held=gpus(A), reason="not seen"), ADD)
    assert (new.lent, new.hotadd_failed, actions) == (gpus(A, B, C), True, [])


def test_the_lendee_stopping_allows_hot_add_again() -> None:
    failed = replace(S(Phase.LENT, lent=gpus(B, C)), hotadd_failed=True)
    new, _ = go(failed, LendeeStopped(at=AT), ADD)
    assert not new.hotadd_failed and new.lent == frozenset()


def test_an_owner_asking_for_the_gpu_being_attached_takes_the_reclaim_road() -> None:
    state = attaching()
    decision, why = verdict(state, "gaming1", topo=TOPO)
    assert decision == "defer" and "gpu-a" in why
    new, actions = go(state, wants("gaming1"), ADD)
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 2)]
    assert new.attaching == frozenset() and A in new.lent
    assert not still_wanted(new, AttachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)
    with pytest.raises(IllegalTransition):
        go(new, GpusAttached(at=AT, ticket=T + 1, gpus=gpus(A)), ADD)


def test_a_report_for_other_gpus_is_stale() -> None:
    with pytest.raises(IllegalTransition, match="not the GPUs being attached"):
        go(attaching(), GpusAttached(at=AT, ticket=T + 1, gpus=gpus(B)), ADD)
    assert still_wanted(attaching(), AttachGpus(ticket=T + 1, gpus=gpus(A)), topo=TOPO)


def test_the_configuration_takes_hotplug() -> None:
    base = (f'[lendee]\ndomain = "{LENDEE}"\ngpus = ["gpu-a"]\n'
            '[gpus.gpu-a]\npci = "0000:01:00.0"\n[policy]\n')
    assert parse(base + 'hotplug = "add"\n').policy.hotplug is Hotplug.ADD
    assert parse(base).policy.hotplug is Hotplug.AUTO
    assert parse(base + 'hotplug = "none"\n').policy.hotplug is Hotplug.NONE
    with pytest.raises(ConfigError, match="hotplug"):
        parse(base + 'hotplug = "sometimes"\n')


# --- lint: can this lendee take a GPU live? ---------------------------------------------


def test_lint_a_lendee_ready_for_hot_add_has_no_finding() -> None:
    assert hot_add_findings(lendee_xml()) == []
    # Nor is one said when hot-add is off.
    assert hot_add_findings(lendee_xml(machine="pc-i440fx-7.2"),
                            LINT_CONFIG.replace('hotplug = "add"', "")) == []


def test_lint_says_what_keeps_a_lendee_from_hot_add() -> None:
    assert hot_add_findings(lendee_xml(machine="pc-i440fx-7.2")) == [
        "error: policy.hotplug: machine pc-i440fx-7.2 has no PCIe root ports"]
    assert hot_add_findings(lendee_xml(buses=(1, 1), multifunction=True)) == [
        "error: policy.hotplug: <hostdev> 0000:01:00.0 of gpu-a shares root port 1 with "
        "another function",
        "error: policy.hotplug: <hostdev> 0000:01:00.1 of gpu-a shares root port 1 with "
        "gpu-a's <hostdev> 0000:01:00.0"]
    assert hot_add_findings(lendee_xml(buses=(1, 7))) == [
        "error: policy.hotplug: <hostdev> 0000:01:00.1 of gpu-a is not in a pcie-root-port "
        "of its own"]
    assert hot_add_findings(lendee_xml(hotplug_off=True)) == [
        f"error: policy.hotplug: root port {bus} of gpu-a's <hostdev> 0000:01:00.{f} has "
        "hotplug='off'" for bus, f in ((1, 0), (2, 1))]
    assert hot_add_findings(lendee_xml(pref64=False)) == [
        "warning: policy.hotplug: no 64-bit prefetchable window is reserved on the root ports"]


def test_the_default_hotplug_is_what_lint_finds_the_lendee_can_do() -> None:
    auto = parse(LINT_CONFIG.replace('hotplug = "add"', ""))

    def capability(xml: str) -> tuple[Hotplug, str]:
        return lint.hotplug_capability(lint.parse_domain(xml), auto)

    # From the definition alone, "auto" is hot-add at most: hot-unplug waits for what the
    # running lendee shows (tests/unit/host/test_lint.py: unplug_at_run_time).
    assert capability(lendee_xml()) == (Hotplug.ADD, (
        "gpu-node has a spare pcie-root-port for each function of its owners' GPUs, a 64-bit "
        "prefetchable window and its guest's hot-plug on: hot-add; hot-unplug only once the "
        "running lendee shows its GPU plugins honour nvidia.com/gpu.deploy.device-plugin and "
        "its nvidia-smi supports drain"))
    assert capability(lendee_xml(machine="pc-i440fx-7.2")) == (Hotplug.NONE, (
        "gpu-node cannot hot-plug its GPUs: machine pc-i440fx-7.2 has no PCIe root ports"))
    booted = lendee_xml().replace(
        "</os>", "<kernel>/vmlinuz</kernel><cmdline>quiet acpiphp.disable=1</cmdline></os>")
    assert capability(booted) == (Hotplug.NONE, (
        "gpu-node's kernel command line has acpiphp.disable=1: it ignores hot-plug"))
    # "auto" never takes hot-unplug from the definition: no caveat for it there.
    assert hot_add_findings(lendee_xml(), LINT_CONFIG.replace('hotplug = "add"', "")) == []
    assert hot_add_findings(booted, LINT_CONFIG.replace('hotplug = "add"', "")) == []
    # A policy set by hand is what applies, whatever the XML.
    assert lint.hotplug_capability(lint.parse_domain(booted), parse(LINT_CONFIG))[0] is Hotplug.ADD
    # `hostagent lint` says which applies and why, in one line.
    assert lint.regrow_note([lint.parse_domain(booted)], auto) == (
        "gpu-node: GPUs change by restart; a regrow by restart waits until no GPU pod runs, "
        "however long (gpu-node's kernel command line has acpiphp.disable=1: it ignores "
        "hot-plug)")
    assert lint.regrow_note([lint.parse_domain(lendee_xml())], auto) == (
        "gpu-node: GPUs change live when added (hot-add), by restart when a game takes one; "
        "a regrow by restart waits until no GPU pod runs, however long (gpu-node has a spare "
        "pcie-root-port for each function of its owners' GPUs, a 64-bit prefetchable window "
        "and its guest's hot-plug on: hot-add; hot-unplug only once the running lendee shows "
        "its GPU plugins honour nvidia.com/gpu.deploy.device-plugin and its nvidia-smi "
        "supports drain)")


@pytest.mark.parametrize("xml,how,changes", [
    (lendee_xml(), Hotplug.ADD, "live when added (hot-add)"),
    (lendee_xml(machine="pc-i440fx-7.2"), Hotplug.NONE, "by restart; a regrow by restart "
     "waits until no GPU pod runs"),
], ids=["q35 with spare root ports", "i440fx"])
async def test_the_agent_takes_the_default_hotplug_from_lint_and_status_says_why(
        tmp_path: Path, xml: str, how: Hotplug, changes: str) -> None:
    from hostagent.service.agent import Agent

    class Definitions(LibvirtStub):
        connected = True

        async def inactive_xml(self, name: str) -> str:
            assert name == "gpu-node"
            return xml

    text = (f'state_dir = "{tmp_path}/state"\ncontrol_socket = "{tmp_path}/c.sock"\n'
            f'hook_socket = "{tmp_path}/h.sock"\n' + LINT_CONFIG.replace('hotplug = "add"', "")
            + "[kubernetes]\n")
    agent = Agent(parse(text, "test.toml"))
    assert agent.policy.hotplug is Hotplug.NONE  # until the lendee's XML is read
    agent.libvirt = Definitions()
    await agent._decide_hotplug()
    assert agent.policy.hotplug is how
    assert agent.verbs.policy.hotplug is how and agent.recorder.policy is agent.policy
    lendee = agent.verbs.status()["lendee"]
    assert lendee["changes"].startswith(changes)
    assert lendee["changes_why"].startswith('policy.hotplug = "auto": gpu-node ')


# --- the node: the GPU plugins restarted, the new GPU advertised ---------------------------

@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node (its kubelet running) and other-node; NVIDIA's DeviceClass."""
    async with gpu_node_api(plane, "other-node") as api:
        yield api


@pytest.fixture
async def driver(api: Api) -> AsyncIterator[Driver]:
    """NVIDIA's DRA kubelet plugin on gpu-node, publishing its slices."""
    async with Driver(api.seed.plane.admin, "gpu-node") as publisher:
        yield publisher


def dra_config() -> Config:
    return parse(lendee_toml() + """
[timeouts]
ready = "3s"
[policy]
hotplug = "add"
[kubernetes]
gpu_api = "dra"
""", "test.toml")


async def test_only_the_gpu_plugins_pods_on_the_node_are_restarted(
        api: Api, kube: Kube) -> None:
    add = api.seed.pod
    await add("nvidia-device-plugin-daemonset-x1", node="gpu-node", namespace="gpu-operator",
        owner="DaemonSet/nvidia-device-plugin-daemonset",
        labels={"app": "nvidia-device-plugin-daemonset"})
    await add("nvidia-dra-driver-gpu-kubelet-plugin-k2", node="gpu-node", namespace="nvidia-dra",
        owner="DaemonSet/nvidia-dra-driver-gpu-kubelet-plugin",
        labels={"app.kubernetes.io/name": "nvidia-dra-driver-gpu",
                "nvidia-dra-driver-gpu-component": "kubelet-plugin"})  # its chart's, v25.12.0
    await add("nvidia-dra-driver-gpu-controller-c3", node="gpu-node", namespace="nvidia-dra",
        owner="ReplicaSet/nvidia-dra-driver-gpu-controller-5d8f",
        labels={"app.kubernetes.io/name": "nvidia-dra-driver-gpu",
                "nvidia-dra-driver-gpu-component": "controller"})  # no GPU of the node's
    elsewhere = await add("nvidia-device-plugin-daemonset-y7", node="other-node", namespace="gpu-operator",
        owner="DaemonSet/nvidia-device-plugin-daemonset",
        labels={"app": "nvidia-device-plugin-daemonset"})
    await add("train-1", node="gpu-node", owner="Job/train", labels={"app": "train"},
        gpus={"nvidia.com/gpu": 1})
    deleted = await kube.restart_plugins("gpu-node", timeout=5)
    assert deleted == ["gpu-operator/nvidia-device-plugin-daemonset-x1",
                       "nvidia-dra/nvidia-dra-driver-gpu-kubelet-plugin-k2"]
    assert await gone(api, "gpu-operator", "nvidia-device-plugin-daemonset-x1")
    assert not await gone(api, "gpu-operator", elsewhere["metadata"]["name"])
    assert not await gone(api, "default", "train-1")
    assert not await gone(api, "nvidia-dra", "nvidia-dra-driver-gpu-controller-c3")


async def test_the_node_is_told_of_the_gpu_once_its_slices_list_it(
        api: Api, kube: Kube, driver: Driver) -> None:
    await driver.publish([gpu_device(0, UUID_B)])
    cluster = KubeCluster(kube, dra_config(), remember_cordon=lambda _: None)
    assert await cluster.give_back({"gpu-b"}) is None

    async def restarted() -> None:
        # The plugin enumerates gpu-a once restarted: while the grow watches the slices.
        await until(lambda: api.proxy.watching("/resourceslices$"),
                    "the grow watching the ResourceSlices")
        await driver.publish([gpu_device(0, UUID_B), gpu_device(1, UUID_A)])

    plugin = asyncio.create_task(restarted())
    assert await cluster.grow({"gpu-a", "gpu-b"}) is None
    await plugin
    node = await api.seed.get_node("gpu-node")
    assert node["metadata"]["annotations"]["hostagent.io/lent-gpus"] == "gpu-a,gpu-b"
    assert not node["spec"].get("unschedulable")


async def test_a_gpu_the_node_never_lists_leaves_it_as_it_was(
        api: Api, kube: Kube, driver: Driver) -> None:
    await driver.publish([gpu_device(0, UUID_B)])
    cluster = KubeCluster(kube, dra_config(), remember_cordon=lambda _: None)
    assert await cluster.give_back({"gpu-b"}) is None
    before = cluster.expected
    problem = await cluster.grow({"gpu-a", "gpu-b"})
    assert problem is not None and f"gpu-a ({UUID_A})" in problem
    assert cluster.expected == before
    node = await api.seed.get_node("gpu-node")
    assert node["metadata"]["annotations"]["hostagent.io/lent-gpus"] == "gpu-b"
    assert not node["spec"].get("unschedulable")


def test_a_failed_hot_add_is_counted_as_a_failure() -> None:
    m = Metrics(TOPO)
    state = attaching()
    event = AttachFailed(at=AT, ticket=T + 1, gpus=gpus(A), held=frozenset(), reason="no")
    m.transition(state, go(state, event, ADD)[0], event)
    assert m.registry.get_sample_value("hostagent_failures_total", {"kind": "hotplug"}) == 1


# --- the step: a failed hot-add leaves the live definition as the lend has it ----------------


async def test_a_hot_add_that_fails_in_the_guest_detaches_what_it_attached() -> None:
    # Left attached and lent, gpu-a would fail the guest's check at every later return.
    step = AddStep()
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, AttachFailed) and event.held == frozenset()
    assert step.detached == [gpus(A)] and step.live == {B, C}
    assert go(step.state, event, ADD)[0].lent == gpus(B, C)


async def test_an_attach_past_its_bound_counts_its_gpus_as_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # libvirt's call goes on in its thread: the GPU may land in the lendee after the bound.
    monkeypatch.setattr(hotplug, "ATTACH_BOUND", 0.1)
    step = AddStep()
    step.attach_after = 0.3
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, AttachFailed) and event.held == gpus(A)
    await until(lambda: step.live == {A, B, C}, "libvirt's attach to land")
    assert go(step.state, event, ADD)[0].lent == gpus(A, B, C)


@pytest.mark.parametrize("live", [gpus(B, C), gpus(A, B, C)], ids=["not yet", "attached"])
def test_an_agent_restarted_mid_attach_lends_what_libvirt_says_is_attached(
        live: frozenset[str]) -> None:
    new, _ = go(attaching(), Observed(at=AT, lendee_running=True, owners_running=frozenset(),
                                      lendee_gpus=live), ADD)
    assert (new.lent, new.attaching) == (live, frozenset())


class NodeFails(AddStep):
    """A hot-add the guest takes but whose node never advertises the GPU: the undo
    pauses the GPU plugins (they were restarted with the GPU present)."""

    def __init__(self) -> None:
        super().__init__()
        self.grown: list[frozenset[str]] = []
        self.withdrawn: list[frozenset[str]] = []

    async def _verify_gpus(self, ticket: int, lent: frozenset[str]) -> str | None:
        return None

    async def grow(self, lent: Collection[str]) -> str | None:
        self.grown.append(frozenset(lent))
        return "node gpu-node advertises 2 nvidia.com/gpu of 3" if len(self.grown) == 1 else None

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        self.withdrawn.append(frozenset(gpus))
        return None


async def test_the_plugins_an_undo_paused_come_back_for_what_stays_lent() -> None:
    # Paused by the undo and left so, they would keep every GPU of the node unadvertised.
    step = NodeFails()
    await hotplug.hot_add(step, T + 1, gpus(A))
    [event] = step.applied
    assert isinstance(event, AttachFailed) and event.held == frozenset()
    assert step.withdrawn == [gpus(A)] and step.detached == [gpus(A)]
    assert step.grown == [gpus(A, B, C), gpus(B, C)]


class Running(AddStep):
    """A lent lendee under ``policy.hotplug = "auto"``, asked whether it can hot-unplug:
    its nvidia-smi has `drain` or not, its node's plugins can be paused or not."""

    def __init__(self, *, drain: bool, pausable: bool) -> None:
        super().__init__()
        self.cfg = replace(self.cfg, policy=replace(self.cfg.policy, hotplug=Hotplug.AUTO))
        self.drain, self.pausable = drain, pausable

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        if path == "nvidia-smi" and args == list(hotplug.DRAIN_HELP):
            return ExecResult(0, "drain -- Display and modify the GPU drain states.\n"
                                 "  -p, --pciid  -m, --modify  -r, --remove\n"
                              if self.drain else "", "" if self.drain else "Invalid option")
        return await super().guest_exec(name, path, args, timeout=timeout)

    async def plugins_pausable(self, *, timeout: float = 10) -> tuple[bool, str]:
        return self.pausable, "nvidia-device-plugin-ds honours it" if self.pausable else \
            "its DaemonSet selects nodes by no deploy label"


@pytest.mark.parametrize(("drain", "pausable", "how"), [
    (True, True, Hotplug.BOTH), (True, False, Hotplug.ADD), (False, True, Hotplug.ADD)])
async def test_auto_hot_unplugs_only_where_the_guest_drains_and_the_plugins_pause(
        drain: bool, pausable: bool, how: Hotplug) -> None:
    step = Running(drain=drain, pausable=pausable)
    added = Policy(hotplug=Hotplug.ADD, hotplug_why='policy.hotplug = "auto": hot-add')
    decided = await hotplug.unplug_policy(step, added)
    assert decided.hotplug is how
    if how is Hotplug.ADD:
        assert "hot-adds only" in decided.hotplug_why
    # Set by hand, or no hot-add at all: never changed.
    none = replace(added, hotplug=Hotplug.NONE)
    assert await hotplug.unplug_policy(step, none) == none
