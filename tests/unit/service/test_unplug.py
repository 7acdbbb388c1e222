"""Hot-unplug on reclaim (``policy.hotplug = "both"``), the machine's half: a game's GPU
is detached from the running lendee when it keeps enough without it, the owner starts
once libvirt has removed it, and anything else takes the reclaim's road."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hostagent.service import hotplug
from hostagent.host import journal, lint
from hostagent.cluster.cycle import KubeCluster
from hostagent.core.config import parse
from hostagent.cluster.kube import Kube
from hostagent.host.libvirt import Lifecycle
from hostagent.core.machine import IllegalTransition, still_wanted, verdict
from hostagent.surfaces.metrics import Metrics
from hostagent.core.reserve import Reservation
from hostagent.core.model import (
    AgentUp,
    CancelIntent,
    CompleteIntent,
    DetachFailed,
    DetachGpus,
    Drain,
    GpuPods,
    GpusDetached,
    Hold,
    Hotplug,
    KubeReturn,
    LendeeStopped,
    Observed,
    OwnerStarted,
    Phase,
    Reclaim,
    Reserve,
    ReturnDone,
    ScheduleRelend,
    StartOwner,
    State,
)
from tests.controlplane import ControlPlane
from tests.controlplane.nvidia import Driver
from tests.controlplane.nvidia import gpu as gpu_device
from tests.configs import UUID_A, UUID_B, UUID_C
from tests.unit.kube_scaffold import Api, gpu_node_api
from tests.unit.machine_scaffold import Stepper
from tests.unit.agents import make_agent
from tests.unit.hotplug_scaffold import LINT_CONFIG, gone, hot_add_findings, lendee_xml
from tests.unit.machine_scaffold import AT, LENDEE, T, wants
from tests.unit.partial_world import BOTH, LIVE, POLICY, TOPO, B, C, S, gpus
from tests.unit.hotplug_scaffold import (
    release_within,
    detaching,
    FakeStep,
    lent,
    unplug,
    UNPLUG_CONFIG,
)
from tests.unit.hotplug_scaffold import (
    checkpoint,
)

A = "gpu-a"
go, run = LIVE.go, LIVE.run


def test_a_game_takes_its_gpu_from_the_running_lendee_by_hot_unplug() -> None:
    # The hook's sentence says what will happen, as the policy has it.
    assert "draining it" in verdict(lent(), "gaming1", topo=TOPO, policy=POLICY)[1]
    decision, why = verdict(lent(), "gaming1", topo=TOPO, policy=BOTH)
    assert decision == "defer" and f"taking gpu-a from {LENDEE} while it runs" in why
    new, actions = go(lent(), wants("gaming1"))
    assert actions == [DetachGpus(ticket=T + 1, gpus=gpus(A))]
    assert (new.phase, new.detaching, new.lent) == (Phase.LENT, gpus(A), gpus(A, B, C))
    assert [i.owner for i in new.intents] == ["gaming1"]
    # The owner waits while the lendee holds it: neither the hook nor the executor starts it.
    assert not still_wanted(new, StartOwner(owner="gaming1"), topo=TOPO)
    decision, why = verdict(new, "gaming1", topo=TOPO)
    assert decision == "defer" and f"taking gpu-a from {LENDEE} while it runs" in why


def test_once_detached_the_owner_starts_and_the_node_returns_with_the_rest() -> None:
    new, actions = go(detaching(), GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert (new.phase, new.lent, new.detaching) == (Phase.JOINING, gpus(B, C), frozenset())
    assert actions == [StartOwner(owner="gaming1"),
                       KubeReturn(ticket=T + 2, restart_plugins=True)]
    assert still_wanted(new, StartOwner(owner="gaming1"), topo=TOPO)
    new, actions = run(new, OwnerStarted(at=AT, owner="gaming1"),
                       ReturnDone(at=AT, ticket=T + 2))
    assert actions == [CompleteIntent(intent_id="i-gaming1", owner="gaming1")]
    assert (new.phase, new.lent, new.running_owners) == (Phase.LENT, gpus(B, C),
                                                         frozenset({"gaming1"}))


def test_a_failed_hot_unplug_takes_the_reclaim_road_and_is_not_tried_again() -> None:
    new, actions = go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A),
                                                reason="still in the live XML after 30s"))
    assert actions == [Drain(ticket=T + 2)]
    assert (new.phase, new.lent, new.unplug_failed) == (Phase.DRAINING, gpus(A, B, C), True)
    assert [i.owner for i in new.intents] == ["gaming1"]
    # Until the lendee restarts, a reclaim is a restart; its stop starts the owner.
    assert go(replace(lent(), unplug_failed=True), wants("gaming1"))[1] == [Drain(ticket=T + 1)]
    off, actions = go(new, LendeeStopped(at=AT))
    assert actions == [StartOwner(owner="gaming1")] and not off.unplug_failed


@pytest.mark.parametrize(("state", "policy"), [
    (lent(), POLICY),  # hotplug = "none"
    (lent(), replace(POLICY, hotplug=Hotplug.ADD)),
    (lent(), replace(BOTH, partial=False)),  # all or nothing
    (lent(), replace(BOTH, min_gpus=3)),  # it would keep 2
    (lent(A), BOTH),  # it would keep none
    (replace(lent(), attaching=gpus(A)), BOTH),
    (replace(lent(), unplug_failed=True), BOTH),
    (S(Phase.JOINING), BOTH),
], ids=["none", "add", "all-or-nothing", "min_gpus", "last GPU", "attaching", "failed before",
        "joining"])
def test_otherwise_the_reclaim_restarts_the_lendee(state: State, policy: object) -> None:
    new, actions = go(state, wants("gaming1"), policy)  # type: ignore[arg-type]
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 1)]


def test_an_iommu_group_is_detached_whole() -> None:
    grouped = replace(TOPO, groups=(gpus(B, C),))
    new, actions = Stepper(grouped, BOTH).go(lent(), wants("gaming2"))
    assert actions == [DetachGpus(ticket=T + 1, gpus=gpus(B, C))]
    # Not when the group is all it has left but one GPU under min_gpus = 2.
    new, actions = Stepper(grouped, replace(BOTH, min_gpus=2)).go(lent(), wants("gaming2"))
    assert actions == [Drain(ticket=T + 1)]


def test_a_second_request_for_the_same_owner_joins_the_detach() -> None:
    new, actions = go(detaching(), wants("gaming1", id="i-again"))
    assert actions == [] and new.detaching == gpus(A) and len(new.intents) == 1


def test_hold_leaves_the_detach_alone_and_a_reclaim_by_hand_takes_over() -> None:
    held, actions = go(detaching(), Hold(at=AT))
    assert (held.detaching, actions) == (gpus(A), [])
    new, actions = go(held, Reclaim(at=AT))
    assert new.phase is Phase.DRAINING and actions == [Drain(ticket=T + 2)]


def test_the_lendee_stopping_mid_detach_starts_the_owner() -> None:
    new, actions = go(detaching(), LendeeStopped(at=AT))
    assert new.phase is Phase.OFF and actions == [StartOwner(owner="gaming1")]


def test_a_reread_mid_detach_takes_the_reclaim_road() -> None:
    new, actions = go(detaching(), Observed(at=AT, lendee_running=True,
                                            owners_running=frozenset(),
                                            lendee_gpus=gpus(A, B, C)))
    assert new.phase is Phase.DRAINING and Drain(ticket=T + 2) in actions
    # Detached before the agent restarted: the owner starts at once.
    new, actions = go(detaching(), Observed(at=AT, lendee_running=True,
                                            owners_running=frozenset(),
                                            lendee_gpus=gpus(B, C)))
    assert StartOwner(owner="gaming1") in actions and new.lent == gpus(B, C)


@pytest.mark.parametrize("policy", [POLICY, replace(POLICY, hotplug=Hotplug.ADD), BOTH],
                         ids=lambda p: f"hotplug={p.hotplug}")
def test_after_a_reread_the_return_restarts_the_plugins_if_gpus_can_change_live(
        policy: Any) -> None:
    """An agent that restarts between a live change and the node's return (a detach
    done, the plugins not yet restarted; a hot-add attached, not yet advertised) cannot
    tell: with hotplug on, the return it begins again restarts the GPU plugins first,
    and with the rest of the lend's road, a return done clears it."""
    after = S(Phase.JOINING, lent=gpus(B, C), running_owners=frozenset({"gaming1"}))
    new, actions = run(after, Observed(at=AT, lendee_running=True,
                                       owners_running=frozenset({"gaming1"}),
                                       lendee_gpus=gpus(B, C)), policy=policy)
    new, actions = go(new, AgentUp(at=AT, ticket=new.ticket), policy)
    live = policy.hotplug is not Hotplug.NONE
    assert actions == [KubeReturn(ticket=new.ticket, restart_plugins=live)]
    new, _ = go(new, ReturnDone(at=AT, ticket=new.ticket), policy)
    assert new.phase is Phase.LENT
    # A later return of the same lendee (a reclaim given up) restarts nothing.
    new, actions = run(new, GpuPods(at=AT, count=0), policy=policy)
    assert not any(isinstance(a, KubeReturn) and a.restart_plugins for a in actions)
    assert not new.replug


def test_a_start_withdrawn_mid_detach_leaves_the_gpu_free_for_a_hot_add() -> None:
    new, actions = go(detaching(), CancelIntent(at=AT, owner="gaming1", by="alice"))
    assert new.detaching == gpus(A) and new.relend_at is None
    assert not any(isinstance(a, ScheduleRelend) for a in actions)
    new, actions = go(new, GpusDetached(at=AT, ticket=T + 1, gpus=gpus(A)))
    assert actions == [KubeReturn(ticket=T + 2, restart_plugins=True)]
    new, actions = go(new, ReturnDone(at=AT, ticket=T + 2))
    assert actions == [ScheduleRelend(at=AT + 30)]  # a regrow (hot-add) of gpu-a


def test_a_report_for_other_gpus_is_stale() -> None:
    with pytest.raises(IllegalTransition, match="not the GPUs being detached"):
        go(detaching(), GpusDetached(at=AT, ticket=T + 1, gpus=gpus(B)))
    with pytest.raises(IllegalTransition, match="not the GPUs being detached"):
        go(detaching(), DetachFailed(at=AT, ticket=T + 1, gpus=gpus(B), reason="x"))


def test_the_configuration_takes_both() -> None:
    base = (f'[lendee]\ndomain = "{LENDEE}"\ngpus = ["gpu-a"]\n'
            '[gpus.gpu-a]\npci = "0000:01:00.0"\n[policy]\n')
    assert parse(base + 'hotplug = "both"\n').policy.hotplug is Hotplug.BOTH


def test_a_failed_hot_unplug_is_counted_as_a_failure() -> None:
    m = Metrics(TOPO)
    state = detaching()
    event = DetachFailed(at=AT, ticket=T + 1, gpus=gpus(A), reason="no")
    m.transition(state, go(state, event)[0], event)
    assert m.registry.get_sample_value("hostagent_failures_total", {"kind": "hotplug"}) == 1


# --- the executor's step, with fakes at its seams ------------------------------------------


def test_the_checkpoint_names_the_pods_on_a_gpu_by_uuid_or_replica() -> None:
    text = checkpoint(("p1", "nvidia.com/gpu", {"0": [UUID_A]}),
                      ("p2", "nvidia.com/gpu", [f"{UUID_B}::1"]),  # an older kubelet's list
                      ("p3", "nvidia.com/gpu", {"0": [f"{UUID_A}::3", UUID_B]}),
                      ("p4", "example.com/nic", {"0": ["eth1"]}))
    assert hotplug.checkpoint_pods(text, {UUID_A}, {UUID_A, UUID_B}) == {"p1", "p3"}
    assert hotplug.checkpoint_pods(checkpoint(), {UUID_A}, {UUID_A}) == frozenset()


@pytest.mark.parametrize("text", [
    "", "{", "[]", '{"Data": {}}', '{"Data": {"PodDeviceEntries": [1]}}',
    checkpoint(("p1", "nvidia.com/gpu", {"0": ["0"]})),  # index IDs: which GPU is "0"?
    checkpoint(("p1", "nvidia.com/mig-1g.10gb", {"0": ["MIG-1234"]})),
], ids=["empty", "not json", "a list", "no entries", "an entry not an object", "index IDs",
        "MIG"])
def test_a_checkpoint_that_cannot_tell_for_sure_is_doubt(text: str) -> None:
    with pytest.raises(ValueError):
        hotplug.checkpoint_pods(text, {UUID_A}, {UUID_A, UUID_B})


def hotplug_records(sink: journal.ListSink) -> list[tuple[str, str]]:
    return [(e.fields["HOSTAGENT_RESULT"], e.message) for e in sink.entries
            if e.fields.get("HOSTAGENT_EVENT") == "hotplug"]


async def test_the_pods_on_the_gpu_are_evicted_and_it_is_detached(
        sink: journal.ListSink) -> None:
    step = FakeStep()
    await unplug(step)
    assert step.cluster.calls == [(["gaming1"], gpus(A), frozenset({"pod-a"}))]
    assert step.libvirt.detached == [gpus(A)] and step.libvirt.live == {B, C}
    assert [type(e) for e in step.applied] == [GpusDetached]
    results = [r for r, _ in hotplug_records(sink)]
    assert results == ["started", "ok"]


async def test_a_reservations_unplug_gives_the_pods_until_its_time() -> None:
    # Its pods were told they get their full grace period: timeouts.drain is a player's
    # wait, and nobody waits for a reservation until its time.
    at = time.time() + 600
    reserved = Reservation(vm="gaming1", at=at, by="control", made=AT, evict_at=AT,
                           holding=True)
    step = FakeStep()
    step.state, [action] = go(lent(), Reserve(at=AT, reservations=(reserved,)))
    assert action == DetachGpus(ticket=T + 1, gpus=gpus(A))
    await unplug(step)
    assert step.cluster.calls[0][0] == ["gaming1's reservation"]
    [until] = step.cluster.until
    assert until is not None and 590 < until <= 600
    assert step.cluster.caps == [None]  # and their full grace
    step = FakeStep()  # an owner waiting: the player's wait, timeouts.drain
    await unplug(step)
    assert step.cluster.until == [None]
    assert step.cluster.caps == [10.0]  # drain.unplanned_grace


async def test_the_node_is_cordoned_before_the_checkpoint_is_read() -> None:
    # A pod the scheduler placed between the reading and the cordon would stay unseen.
    step = FakeStep()
    await unplug(step)
    assert step.cluster.order[:2] == ["cordon", "checkpoint"]
    assert [type(e) for e in step.applied] == [GpusDetached]


@pytest.mark.parametrize("broken", ["unreadable", "garbage"])
async def test_a_checkpoint_in_doubt_gives_way_to_the_restart(
        broken: str, sink: journal.ListSink) -> None:
    step = FakeStep()
    step.libvirt.checkpoint = (1, "") if broken == "unreadable" else (0, "{")
    await unplug(step)
    assert step.cluster.calls[0][2] is None and step.libvirt.detached == []
    [event] = step.applied
    assert isinstance(event, DetachFailed) and hotplug.CHECKPOINT in event.reason
    result, message = hotplug_records(sink)[-1]
    assert result == "failed" and "reclaiming it by restart instead" in message


async def test_a_process_on_the_gpu_gives_way_to_the_restart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # nvidia-persistenced, a DCGM exporter, a display server: any holder of the device
    # node counts, not only the compute processes nvidia-smi lists.
    step = FakeStep()
    step.cfg = release_within(step.cfg, 0.2)
    step.libvirt.holders.add("4242/fd/3")
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and "4242" in event.reason and "812" not in event.reason
    assert "unbind" not in step.cluster.order
    assert step.libvirt.detached == []  # never asked while a process holds it


async def test_the_plugin_is_stopped_and_the_gpu_unbound_in_the_guest_before_the_detach(
        sink: journal.ListSink) -> None:
    # NVIDIA's device plugin holds every GPU it serves open while it runs, and the
    # guest's driver lets a device go only once unbound: in this order, or not at all.
    step = FakeStep()
    await unplug(step)
    assert step.cluster.order == ["cordon", "checkpoint", "withdraw", "query", "holders",
                                  "unbind", "detach"]
    assert [type(e) for e in step.applied] == [GpusDetached]


async def test_a_guest_that_never_lets_go_gives_way_to_the_restart(
        monkeypatch: pytest.MonkeyPatch, sink: journal.ListSink) -> None:
    monkeypatch.setattr(hotplug, "DETACH_BOUND", 0.3)
    step = FakeStep()
    step.libvirt.lets_go = False
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed)
    assert "gpu-a still in gpu-node's live definition 0.3s after the detach" in event.reason
    assert "did not let it go" in hotplug_records(sink)[-1][1] and event.stuck


async def test_a_guest_stuck_in_nvidia_smi_gives_way_within_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A driver stuck in an unbind hangs nvidia-smi: the question has the part's deadline,
    # not one of its own past it, and the restart that follows may power the guest off.
    step = FakeStep()
    step.cfg = release_within(step.cfg, 0.3)
    step.libvirt.hangs = True
    await unplug(step)
    [event] = step.applied
    assert isinstance(event, DetachFailed) and event.stuck
    assert step.libvirt.timeouts and max(step.libvirt.timeouts) <= 0.3
    assert step.libvirt.detached == []


async def test_a_step_whose_phase_ended_reports_nothing() -> None:
    step = FakeStep()
    step.state = replace(step.state, ticket=T + 5)
    await unplug(step)
    assert step.applied == []


# --- the cluster: only the pods on the GPU are evicted ---------------------------------------


@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node (its kubelet running, schedulable), NVIDIA's DeviceClass."""
    async with gpu_node_api(plane) as api:
        yield api


@pytest.fixture
async def driver(api: Api) -> AsyncIterator[Driver]:
    """NVIDIA's DRA kubelet plugin on gpu-node, publishing its slices."""
    async with Driver(api.seed.plane.admin, "gpu-node") as publisher:
        yield publisher


async def test_vacate_evicts_only_the_pods_named_and_cordons_as_ours(
        api: Api, kube: Kube) -> None:
    add = api.seed.pod
    on_a = await add("train-a", node="gpu-node", owner="Job/a", gpus={"nvidia.com/gpu": 1})
    await add("train-b", node="gpu-node", owner="Job/b", gpus={"nvidia.com/gpu": 1})
    await add("web", node="gpu-node", owner="ReplicaSet/web")
    cordons: list[bool] = []
    cfg = parse(UNPLUG_CONFIG + "[kubernetes]\ngpu_api = \"device-plugin\"\n", "t.toml")
    cluster = KubeCluster(kube, cfg, remember_cordon=cordons.append)
    cordoned_when_read: list[bool] = []

    def reading(pods: set[str] | None, why: str = "") -> Callable[
            [], Awaitable[tuple[frozenset[str] | None, str]]]:
        async def read() -> tuple[frozenset[str] | None, str]:
            node = await api.seed.get_node("gpu-node")
            cordoned_when_read.append(bool(node["spec"].get("unschedulable")))
            return (None if pods is None else frozenset(pods)), why
        return read
    assert await cluster.vacate(["gaming1"], {A},
                                reading({on_a["metadata"]["uid"], "gone-pod"})) is None
    assert await gone(api, "default", "train-a")
    assert not await gone(api, "default", "train-b") and not await gone(api, "default", "web")
    assert (await api.seed.get_node("gpu-node"))["spec"].get("unschedulable")
    assert cordons == [True]
    problem = await cluster.vacate(["gaming1"], {A}, reading(None, "cat: No such file"))
    assert problem is not None and "checkpoint could not be read" in problem
    assert "No such file" in problem
    assert cordoned_when_read == [True, True]


async def test_a_budget_that_blocks_the_vacate_leaves_its_fallback_drain_only_what_is_left(
        api: Api, kube: Kube) -> None:
    # The hot-unplug's eviction and the restart's drain after it are one drain for the
    # player: one timeouts.drain for both, not one each (twice the wait).
    on_a = await api.seed.pod("train-a", node="gpu-node", owner="Job/a",
                              labels={"app": "train"}, gpus={"nvidia.com/gpu": 1})
    await api.seed.pdb("train", match_labels={"app": "train"}, max_unavailable=0)
    cfg = parse(UNPLUG_CONFIG + "[kubernetes]\ngpu_api = \"device-plugin\"\n"
                "[timeouts]\ndrain = \"2s\"\n", "t.toml")
    cluster = KubeCluster(kube, cfg, remember_cordon=lambda _: None)
    given: list[float] = []
    drain = kube.drain

    async def recorded(node: str, **kw: Any) -> Any:
        given.append(kw["timeout"])
        return await drain(node, **kw)
    kube.drain = recorded  # type: ignore[method-assign]

    async def read() -> tuple[frozenset[str] | None, str]:
        return frozenset({on_a["metadata"]["uid"]}), ""
    problem = await cluster.vacate(["gaming1"], {A}, read)
    assert problem is not None and "PodDisruptionBudget" in problem
    assert await cluster.reclaim(["gaming1"]) is None  # on_drain_timeout = "proceed"
    vacate_drain, reclaim_drain = given
    assert vacate_drain <= 2.0 and reclaim_drain < 0.5
    # Evictions that went through spend little: the time the guest then took to let go
    # (here 1 s) is no drain's, and the restart's drain has the rest of its budget.
    await api.seed.pod("train-b", node="gpu-node", owner="Job/b", gpus={"nvidia.com/gpu": 1})
    given.clear()

    async def none() -> tuple[frozenset[str] | None, str]:
        return frozenset(), ""
    began = time.monotonic()
    assert await cluster.vacate(["gaming1"], {A}, none) is None
    vacated = time.monotonic()
    await asyncio.sleep(1.0)  # the guest letting go: the gap the budget must not lose
    asked = time.monotonic()
    assert await cluster.reclaim(["gaming1"]) is None
    reclaimed = time.monotonic()
    # The drain was given all the budget but what the vacate and the reclaim themselves
    # took, however long a busy machine made them: not the second in between.
    assert given[-1] >= 2.0 - (vacated - began) - (reclaimed - asked)
    assert await gone(api, "default", "train-b")


async def test_a_reservations_vacate_may_take_until_its_time(api: Api, kube: Kube) -> None:
    on_a = await api.seed.pod("train-a", node="gpu-node", owner="Job/a",
                              gpus={"nvidia.com/gpu": 1})
    cfg = parse(UNPLUG_CONFIG + "[kubernetes]\ngpu_api = \"device-plugin\"\n"
                "[timeouts]\ndrain = \"2s\"\n", "t.toml")
    cluster = KubeCluster(kube, cfg, remember_cordon=lambda _: None)
    given: list[float] = []
    drain = kube.drain

    async def recorded(node: str, **kw: Any) -> Any:
        given.append(kw["timeout"])
        return await drain(node, **kw)
    kube.drain = recorded  # type: ignore[method-assign]

    async def read() -> tuple[frozenset[str] | None, str]:
        return frozenset({on_a["metadata"]["uid"]}), ""
    assert await cluster.vacate(["gaming1's reservation"], {A}, read, until=300) is None
    assert 290 < given[0] <= 300 and await gone(api, "default", "train-a")


async def test_vacate_finds_the_pods_on_the_gpu_by_their_claims_with_dra(
        api: Api, kube: Kube, driver: Driver) -> None:
    await driver.publish([gpu_device(0, UUID_A), gpu_device(1, UUID_B)])
    await api.seed.schedulable("gpu-node")
    # Each pod's claim allocated by the scheduler: train-a's gpu-a, train-b's gpu-b.
    await api.seed.pod("train-a", node="gpu-node", owner="Job/a", uuids=[UUID_A])
    await api.seed.pod("train-b", node="gpu-node", owner="Job/b", uuids=[UUID_B])
    cfg = parse(UNPLUG_CONFIG + "[kubernetes]\ngpu_api = \"dra\"\n", "t.toml")
    cluster = KubeCluster(kube, cfg, remember_cordon=lambda _: None)
    await cluster.expect([A, B, C])
    async def unread() -> tuple[frozenset[str] | None, str]:
        raise AssertionError("with DRA the claims say which pods hold the GPU")
    assert await cluster.vacate(["gaming1"], {A}, unread) is None
    assert await gone(api, "default", "train-a") and not await gone(api, "default", "train-b")


async def test_the_return_after_a_hot_unplug_restarts_the_gpu_plugins_first(
        api: Api, kube: Kube, driver: Driver) -> None:
    await api.seed.pod("nvidia-dra-driver-gpu-kubelet-plugin-k2", node="gpu-node",
                       namespace="nvidia-dra",
                       owner="DaemonSet/nvidia-dra-driver-gpu-kubelet-plugin",
                       labels={"nvidia-dra-driver-gpu-component": "kubelet-plugin"})
    await driver.publish([gpu_device(1, UUID_B), gpu_device(2, UUID_C)])
    cfg = parse(UNPLUG_CONFIG + "[kubernetes]\ngpu_api = \"dra\"\n[timeouts]\nready = \"3s\"\n",
                "t.toml")
    cluster = KubeCluster(kube, cfg, remember_cordon=lambda _: None)
    await kube.cordon("gpu-node", marker_prefix=cfg.kubernetes.annotation_prefix
                      if cfg.kubernetes else "")
    assert await cluster.give_back({B, C}, restart_plugins=True) is None
    assert await gone(api, "nvidia-dra", "nvidia-dra-driver-gpu-kubelet-plugin-k2")
    assert not (await api.seed.get_node("gpu-node"))["spec"].get("unschedulable")


def test_lint_says_hot_unplug_is_experimental_and_names_the_drivers_that_hang() -> None:
    assert hot_add_findings(lendee_xml()) == []
    both = LINT_CONFIG.replace('hotplug = "add"', 'hotplug = "both"')
    [finding] = [f for f in lint.lint([lint.parse_domain(lendee_xml())], config=parse(both))
                 if f.check is lint.Check.HOTPLUG]
    assert finding.severity is lint.Severity.WARNING
    assert "experimental: NVIDIA does not support hot-unplug" in finding.what
    assert "595.58.03 to at least 610.57.04" in finding.why and "issues/1119" in finding.why
    # What it says hostagent does is what it does: any holder of the device node, found
    # in /proc (nvidia-smi's list of processes misses persistenced), then NVML's drain.
    assert "no process in the guest holds its device node" in finding.why, finding.why
    assert "nvidia-smi lists no process" not in finding.why
    assert "NVML's drain state" in finding.why
    # What keeps a lendee from hot-add keeps it from hot-unplug too.
    assert hot_add_findings(lendee_xml(machine="pc-i440fx-7.2"), both)[0] == (
        "error: policy.hotplug: machine pc-i440fx-7.2 has no PCIe root ports")


async def test_libvirt_saying_the_lendee_let_a_device_go_wakes_the_wait(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path)
    before = agent.state
    agent.lifecycle("gaming1", Lifecycle.DEVICE_REMOVED)
    assert not agent.executor.device_removed.is_set()
    agent.lifecycle("gpu-node", Lifecycle.DEVICE_REMOVED)
    assert agent.executor.device_removed.is_set() and agent.state == before
