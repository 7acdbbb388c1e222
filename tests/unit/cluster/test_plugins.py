"""The node's GPU plugins kept off its GPUs through their deploy labels, as NVIDIA's
mig-manager pauses gpu-operator's operands (what honours the labels, no side effects:
tests/unit/core/test_plugin_labels.py): against the real control plane with its real DaemonSet controller and scheduler,
the pause (pods gone, none made again), the restore as found (an absent label stays
absent), a restore after the agent restarted mid-way, and which installs can be paused.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from hostagent.cluster.cycle import KubeCluster
from hostagent.cluster.kube import Kube
from hostagent.core.config import Config, parse
from hostagent.core.plugins import AFFINITY_TERM, PAUSED, PLUGIN_LABELS, PLUGIN_SELECTORS
from hostagent.host import journal
from tests.configs import lendee_toml
from tests.controlplane import ControlPlane
from tests.controlplane.seed import SEEDED
from tests.unit.kube_scaffold import Api, gpu_node_api
from tests.waiting import until

DEVICE_PLUGIN, DCGM_EXPORTER = PLUGIN_LABELS[0], PLUGIN_LABELS[2]
PREFIX = "hostagent.io/"
NS = "gpu-operator"
PAUSABLE = {"key": DEVICE_PLUGIN, "operator": "NotIn", "values": [PAUSED]}


def affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}}


# --- against the real control plane --------------------------------------------------------

@pytest.fixture
async def api(plane: ControlPlane) -> AsyncIterator[Api]:
    """gpu-node, its kubelet running, and the namespace of the operands."""
    async with gpu_node_api(plane) as api:
        await api.seed.namespace(NS)
        api.seed.namespaces.add(NS)
        yield api


@pytest.fixture
async def kube(api: Api, tmp_path: Any) -> AsyncIterator[Kube]:
    from tests.unit.kube_scaffold import FAST
    async with await Kube.connect(api.write_kubeconfig(tmp_path / "kc"), timing=FAST) as k:
        yield k


@pytest.fixture(autouse=True)
def records() -> Iterator[journal.ListSink]:
    sink = journal.ListSink()
    previous = journal.use_sink(sink)
    yield sink
    journal.use_sink(previous)


def config(ready: str = "20s") -> Config:
    return parse(lendee_toml("gpu-node") + f'[timeouts]\nready = "{ready}"\n[kubernetes]\n',
                 "test.toml")


async def daemonset(api: Api, name: str, labels: dict[str, str], **spec: Any) -> None:
    """A DaemonSet of the real controller, its pods labelled `labels` (and SEEDED, so
    that the seed's reset takes them)."""
    apps: Any = client.AppsV1Api(api.seed.core.api_client)
    pod_labels = {**labels, SEEDED: "true"}
    await apps.create_namespaced_daemon_set(NS, {
        "metadata": {"name": name, "labels": {SEEDED: "true"}},
        "spec": {"selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": pod_labels},
            "spec": {"terminationGracePeriodSeconds": 30,
                     "containers": [{"name": "main", "image": f"registry.lab/{name}:1"}],
                     **spec}}}})


async def on_node(api: Api, label: str) -> list[dict[str, Any]]:
    """The pods of `label` on gpu-node that are not being deleted."""
    pods = await api.seed.pods("gpu-node", NS)
    return [p for p in pods if all(p["metadata"]["labels"].get(k) == v for k, v in
                                   [label.split("=", 1)])
            and not p["metadata"].get("deletionTimestamp")]


async def operator(api: Api) -> None:
    """gpu-operator's device plugin and DCGM exporter, on a node labelled as its node
    labelling does (GFD's label left absent: the install has none here)."""
    await api.seed.patch_node("gpu-node", {"metadata": {"labels": {
        DEVICE_PLUGIN: "true", DCGM_EXPORTER: "true"}}})
    await daemonset(api, "nvidia-device-plugin-daemonset",
                    {"app": "nvidia-device-plugin-daemonset"},
                    nodeSelector={DEVICE_PLUGIN: "true"})
    await daemonset(api, "nvidia-dcgm-exporter", {"app": "nvidia-dcgm-exporter"},
                    nodeSelector={DCGM_EXPORTER: "true"})
    for label in ("app=nvidia-device-plugin-daemonset", "app=nvidia-dcgm-exporter"):
        await until(functools.partial(on_node, api, label), f"a {label} pod on gpu-node")


async def scheduled_nowhere(api: Api) -> bool:
    """Whether the DaemonSet controller's last sync of each DaemonSet found no node for
    it (`desiredNumberScheduled`, written at the end of each sync: kubernetes v1.35.4
    pkg/controller/daemon/daemon_controller.go `updateDaemonSetStatus`)."""
    apps: Any = client.AppsV1Api(api.seed.core.api_client)
    sets = (await apps.list_namespaced_daemon_set(NS)).items
    return bool(sets) and all(d.status.desired_number_scheduled == 0 for d in sets)


def deploy_labels(node: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in node["metadata"]["labels"].items()
            if k.startswith("nvidia.com/gpu.deploy.")}


async def test_a_withdraw_leaves_no_plugin_pod_where_a_deletion_leaves_a_new_one(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    """The DaemonSet controller makes a new pod for one deleted (the withdraw of old):
    the pause takes the plugin and the exporter off the node, and none comes back while
    paused; the return restores the labels exactly as they were, and the pods return."""
    await operator(api)
    [before] = await on_node(api, "app=nvidia-device-plugin-daemonset")
    cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
    assert await cluster.withdraw({"gpu-a"}) is None
    node = await api.seed.get_node("gpu-node")
    assert deploy_labels(node) == {k: PAUSED for k in PLUGIN_LABELS}
    assert json.loads(node["metadata"]["annotations"][f"{PREFIX}paused-plugins"]) == {
        **{k: None for k in PLUGIN_LABELS}, DEVICE_PLUGIN: "true", DCGM_EXPORTER: "true"}
    assert not await api.seed.pods("gpu-node", NS)  # gone, not merely being deleted
    # The controller has synced both DaemonSets since the labels changed, and made none.
    await until(functools.partial(scheduled_nowhere, api), "the DaemonSets synced")
    assert not await api.seed.pods("gpu-node", NS)
    [paused] = [e.message for e in records.entries
                if e.fields.get("HOSTAGENT_EVENT") == "hotplug"]
    assert paused.startswith(f"paused {NS}/nvidia-dcgm-exporter-"), paused
    assert f", {NS}/{before['metadata']['name']} on node" in paused
    assert " on node gpu-node in " in paused and paused.endswith(": they held gpu-a open")

    await cluster._restart_plugins(["gpu-b"])  # the return after the detach
    node = await api.seed.get_node("gpu-node")
    assert deploy_labels(node) == {DEVICE_PLUGIN: "true", DCGM_EXPORTER: "true"}
    assert f"{PREFIX}paused-plugins" not in node["metadata"]["annotations"]
    [after] = await until(lambda: on_node(api, "app=nvidia-device-plugin-daemonset"),
                          "the plugin back on gpu-node")
    assert after["metadata"]["uid"] != before["metadata"]["uid"]


async def test_a_pause_left_by_an_agent_restarted_mid_way_is_restored_by_the_return(
        api: Api, kube: Kube) -> None:
    await operator(api)
    first = KubeCluster(kube, config(), remember_cordon=lambda _: None)
    assert await first.withdraw({"gpu-a"}) is None
    # A second withdraw (the agent restarted, the unplug tried again) keeps what the
    # first found, not the "false" it left.
    again = KubeCluster(kube, config(), remember_cordon=lambda _: None)
    assert await again.withdraw({"gpu-a"}) is None
    await kube.cordon("gpu-node", marker_prefix=PREFIX)
    # Whatever its verdict (no kubelet here: the node never shows Ready, so a short wait
    # for it, and one for its GPUs), the labels are put back: before either wait.
    fresh = KubeCluster(kube, config(ready="500ms"), remember_cordon=lambda _: None)
    await fresh.give_back({"gpu-a"})
    node = await api.seed.get_node("gpu-node")
    assert deploy_labels(node) == {DEVICE_PLUGIN: "true", DCGM_EXPORTER: "true"}
    assert f"{PREFIX}paused-plugins" not in node["metadata"]["annotations"]


async def test_the_static_manifest_cannot_be_paused_until_readmes_term_is_added(
        api: Api, kube: Kube) -> None:
    selectors, labels = PLUGIN_SELECTORS, PLUGIN_LABELS
    assert await kube.plugins_pausable("gpu-node", selectors=selectors, labels=labels) == (
        False, "no GPU plugin pod on node gpu-node matches kubernetes.plugin_selectors "
        f"({', '.join(selectors)}): set it to the labels of the pods that serve the node's GPUs")
    await daemonset(api, "nvidia-device-plugin-daemonset", {"name": "nvidia-device-plugin-ds"})
    [plugin] = await until(lambda: on_node(api, "name=nvidia-device-plugin-ds"),
                           "the plugin's pod on gpu-node")
    name = f"{NS}/{plugin['metadata']['name']}"
    pausable, why = await kube.plugins_pausable("gpu-node", selectors=selectors, labels=labels)
    assert not pausable and why.startswith(f"the DaemonSet of GPU plugin pod {name} selects ")
    assert AFFINITY_TERM in why
    cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
    problem = await cluster.withdraw({"gpu-a"})
    assert problem is not None and AFFINITY_TERM in problem
    assert not deploy_labels(await api.seed.get_node("gpu-node"))  # nothing changed

    apps: Any = client.AppsV1Api(api.seed.core.api_client)
    await apps.patch_namespaced_daemon_set("nvidia-device-plugin-daemonset", NS, {
        "spec": {"template": {"spec": affinity([PAUSABLE])}}})
    pausable, why = await cluster.plugins_pausable()
    assert pausable and why.endswith(f" ({DEVICE_PLUGIN}) leave node gpu-node while paused")


async def test_a_hot_add_on_a_node_with_no_plugin_pod_is_an_error_naming_the_selectors(
        api: Api, kube: Kube, records: journal.ListSink) -> None:
    """No pod matches `plugin_selectors`: nothing will advertise the added GPU, which a
    configured lendee's plugins should: an error that says which setting to fix, not a
    warning that "deleted no plugin pod"."""
    cluster = KubeCluster(kube, config(), remember_cordon=lambda _: None)
    await cluster._restart_plugins(["gpu-b"])
    [entry] = [e for e in records.entries if e.fields.get("HOSTAGENT_EVENT") == "hotplug"]
    assert entry.priority == journal.Priority.ERR, entry
    assert "kubernetes.plugin_selectors" in entry.message and "gpu-b" in entry.message
    assert entry.fields.get("HOSTAGENT_RESULT") == "error", entry.fields
