"""The node's GPU plugins paused through their own switch, and put back as they were.

A live GPU change must have every process that holds the GPU off it, and NVIDIA's
plugins are DaemonSet pods a deletion does not stop (the controller makes a new one at
once). As NVIDIA's mig-manager does before it repartitions a GPU (mig-parted
pkg/mig/reconfigure/reconfigure.go), the node's ``nvidia.com/gpu.deploy.*`` labels
are set to "false" (`hostagent.core.plugins` says why that value), the pods of the
DaemonSets that select nodes by them are waited for until gone, and the labels are
put back later exactly as they were (mig-manager puts "true" back where a label was
absent; here an absent label stays absent). What they were is kept on the node
itself (the ``<prefix>paused-plugins`` annotation, written in the same patch as the
labels), so an agent restarted mid-way restores them at the node's next return.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Collection, Iterable
from typing import Any

from hostagent.core import plugins as rules
from hostagent.core.text import clean
from hostagent.cluster.client import KubeError, NodeNotFound, _pods
from hostagent.cluster.cordon import Cordons

ANNOTATION = "paused-plugins"  # under the annotation prefix


class PluginsNotPaused(KubeError):
    """The node's GPU plugins could not be kept off its GPUs: none found, one whose
    DaemonSet does not honour the labels, or pods still there at the deadline."""


class Plugins(Cordons):
    """The node's GPU plugins: which they are, paused, restored."""

    async def _node_pods(self, node: str, deadline: float, selector: str | None = None
                         ) -> list[Any]:
        what = f"list pods {selector} on node {node}" if selector else f"list the pods of {node}"
        listed = await self._call(what, functools.partial(
            self._core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}",
            label_selector=selector or ""), deadline, readable=_pods)
        return list(listed.items or [])

    async def _daemonset_spec(self, pod: Any, deadline: float,
                              cache: dict[tuple[str, str], dict[str, Any] | None]
                              ) -> dict[str, Any] | None:
        """The pod template spec of the DaemonSet that controls `pod` (as the API serves
        it), or None where no DaemonSet does. The pod's own affinity says nothing: the
        DaemonSet controller replaces its required terms by the node's name
        (kubernetes v1.35 pkg/controller/daemon/util ReplaceDaemonSetPodNodeNameNodeAffinity)."""
        owner = next((r for r in pod.metadata.owner_references or []
                      if r.controller and r.kind == "DaemonSet"), None)
        if owner is None:
            return None
        key = (pod.metadata.namespace, owner.name)
        if key not in cache:
            found = await self._call(
                f"read DaemonSet {key[0]}/{key[1]}", functools.partial(
                    self._apps.read_namespaced_daemon_set, owner.name, key[0]), deadline)
            spec = found.spec.template.spec if found.spec and found.spec.template else None
            cache[key] = self._api_client.sanitize_for_serialization(spec) if spec else None
        return cache[key]

    async def _plugin_pods(self, node: str, selectors: Iterable[str],
                           deadline: float) -> list[Any]:
        seen: dict[str, Any] = {}
        for selector in selectors:
            for pod in await self._node_pods(node, deadline, selector):
                seen.setdefault(pod.metadata.uid, pod)
        return list(seen.values())

    async def plugins_pausable(self, node: str, *, selectors: Collection[str],
                               labels: Collection[str],
                               timeout: float | None = None) -> tuple[bool, str]:
        """Whether the GPU plugin pods on `node` (found by `selectors`) leave it when
        `labels` read "false": each is a DaemonSet's whose pod template selects nodes
        by one of them (nodeSelector, or every required node affinity term). (False,
        why) names the pod that does not, or says none was found. Raises
        KubeUnavailable, KubeAuthError."""
        deadline = self._deadline(timeout)
        found = await self._plugin_pods(node, selectors, deadline)
        if not found:
            return False, (f"no GPU plugin pod on node {node} matches "
                           f"kubernetes.plugin_selectors ({', '.join(selectors)}): set it to "
                           "the labels of the pods that serve the node's GPUs")
        cache: dict[tuple[str, str], dict[str, Any] | None] = {}
        by: list[str] = []
        for pod in found:
            name = f"{clean(pod.metadata.namespace, 253)}/{clean(pod.metadata.name, 253)}"
            spec = await self._daemonset_spec(pod, deadline, cache)
            if spec is None:
                return False, (f"GPU plugin pod {name} on node {node} is no DaemonSet's: "
                               "no node label keeps it off the GPUs")
            label = rules.honoured(spec, labels)
            if label is None:
                return False, (
                    f"the DaemonSet of GPU plugin pod {name} selects nodes by none of "
                    f"kubernetes.plugin_labels, so it cannot be kept off the GPUs: add "
                    f"{rules.AFFINITY_TERM} to each term of its required node affinity "
                    "(README, hot-plug)")
            by.append(f"{name} ({label})")
        return True, f"{', '.join(sorted(by))} leave node {node} while paused"

    async def pause_plugins(self, node: str, *, selectors: Collection[str],
                            labels: Collection[str], prefix: str,
                            timeout: float) -> list[str]:
        """Keep the GPU plugins, and every DaemonSet pod that honours `labels` (a DCGM
        exporter, GPU Feature Discovery), off `node`: the labels set to "false", what
        they were remembered in the node's annotation (an earlier pause's, never
        restored, kept), then wait until those pods are gone. The names of the pods
        that went. Raises PluginsNotPaused (the labels stay paused: the return
        restores them), KubeUnavailable, KubeAuthError."""
        deadline = self._deadline(timeout)
        current = await self._read_node(node, deadline)
        now = dict(current.metadata.labels or {})
        earlier = rules.remembered(
            (current.metadata.annotations or {}).get(f"{prefix}{ANNOTATION}"), labels)
        if earlier is None:  # else paused already: the plugins are gone, or going
            pausable, why = await self.plugins_pausable(
                node, selectors=selectors, labels=labels,
                timeout=max(0.0, deadline - self._now()))
            if not pausable:
                raise PluginsNotPaused(why)
        kept = rules.to_remember(now, labels, earlier)
        await self.annotate(node, {f"{prefix}{ANNOTATION}": json.dumps(kept, sort_keys=True)},
                            labels={key: rules.PAUSED for key in labels},
                            timeout=max(0.0, deadline - self._now()))
        return await self._wait_plugins_gone(node, labels, deadline)

    async def _wait_plugins_gone(self, node: str, labels: Collection[str],
                                 deadline: float) -> list[str]:
        """Until no pod on `node` is a DaemonSet's that honours `labels`; their names."""
        cache: dict[tuple[str, str], dict[str, Any] | None] = {}
        went: dict[str, str] = {}
        while True:
            staying: list[str] = []
            for pod in await self._node_pods(node, deadline):
                spec = await self._daemonset_spec(pod, deadline, cache)
                if spec is None or rules.honoured(spec, labels) is None:
                    continue
                name = f"{clean(pod.metadata.namespace, 253)}/{clean(pod.metadata.name, 253)}"
                went[pod.metadata.uid] = name
                staying.append(name)
            if not staying:
                return sorted(went.values())
            if self._now() >= deadline:
                raise PluginsNotPaused(
                    f"{', '.join(sorted(staying))} still on node {node} at the deadline, "
                    f"with {', '.join(sorted(labels))} set to \"{rules.PAUSED}\"")
            await asyncio.sleep(max(0.0, min(self.timing.delete_poll, deadline - self._now())))

    async def resume_plugins(self, node: str, *, labels: Collection[str], prefix: str,
                             timeout: float | None = None) -> dict[str, str | None] | None:
        """Put back the labels a pause remembered on `node` (an absent one stays absent)
        and forget them, in one write; what was put back, or None where nothing was
        paused (or the node is not there). Raises KubeUnavailable, KubeAuthError."""
        deadline = self._deadline(timeout)
        try:
            current = await self._read_node(node, deadline)
        except NodeNotFound:
            return None  # registered anew, it carries no pause (its kubelet sets its labels)
        annotation = f"{prefix}{ANNOTATION}"
        text = (current.metadata.annotations or {}).get(annotation)
        if text is None:
            return None
        kept = rules.remembered(text, labels) or {}
        await self.annotate(node, {annotation: None}, labels=kept or None,
                            timeout=max(0.0, deadline - self._now()))
        return kept
