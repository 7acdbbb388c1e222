"""Kubernetes Events on the lendee's Node: what `kubectl describe node` shows of a
lend and a reclaim; and the notice its GPU pods get ahead of a reserved reclaim."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from functools import partial
from typing import Any


from hostagent.cluster import lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import client as k8s

from hostagent.cluster.client import MERGE_PATCH, Client, KubeRequestError, KubeUnavailable
from hostagent.cluster.watches import requests_gpu

log = logging.getLogger("hostagent.cluster.kube")


_HOSTNAME = socket.gethostname()


class Events(Client):
    """Events on the node."""

    async def post_event(self, node: str, *, reason: str, message: str,
                         warning: bool = False, timeout: float | None = None) -> str | None:
        """A core/v1 Event on the Node, as the kubelet writes its own (namespace default,
        involvedObject.uid = the node's name), so `kubectl describe node` and `kubectl
        get events` show it. Best effort: None once posted, else why not (logged, never
        raised, KubeAuthError aside), for the caller to keep it elsewhere."""
        stamp = datetime.now(UTC)
        body = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{node}.", namespace="default"),
            involved_object=k8s.V1ObjectReference(kind="Node", name=node, uid=node,
                                                  api_version="v1"),
            reason=reason, message=message[:1024], type="Warning" if warning else "Normal",
            source=k8s.V1EventSource(component="hostagent", host=_HOSTNAME),
            reporting_component="hostagent.io/hostagent", reporting_instance=_HOSTNAME,
            first_timestamp=stamp, last_timestamp=stamp, count=1,
        )
        try:
            await self._call(f"post an event on node {node}",
                             lambda: self._core.create_namespaced_event("default", body),
                             self._deadline(timeout))
        except (KubeUnavailable, KubeRequestError) as e:
            log.warning("could not tell the cluster (%s: %s): %s", reason, message, e)
            return str(e)
        return None

    async def notice_pods(self, node: str, *, annotation: str, value: Callable[[float], str],
                          reason: str, message: Callable[[str], str],
                          resources: Collection[str] = ("nvidia.com/gpu",),
                          timeout: float | None = None) -> tuple[str, list[str]]:
        """Tell each pod on `node` that uses a GPU (requests one, or names a resource
        claim) when it will be stopped, as a cloud's spot-interruption notice: the time
        is ``value(the longest grace period among them)`` (seconds; the API's default,
        30, for a pod that sets none), set as `annotation` on each pod (a merge patch),
        and a Normal Event on each says ``message(time)``. The time and the pods told
        ("namespace/name"). Raises KubeUnavailable, KubeRequestError, KubeAuthError."""
        deadline = self._deadline(timeout)
        listed = await self._call(f"list the pods on node {node}", partial(
            self._core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}"),
            deadline)
        pods = [p for p in listed.items or [] if p.metadata.deletion_timestamp is None
                and p.spec is not None
                and (requests_gpu(p, resources) or p.spec.resource_claims)]
        graces = [p.spec.termination_grace_period_seconds for p in pods]
        when = value(max((30.0 if g is None else float(g) for g in graces), default=0.0))
        body = {"metadata": {"annotations": {annotation: when}}}
        for pod in pods:
            ns, name = pod.metadata.namespace, pod.metadata.name
            # A merge patch (the stubs omit _content_type, as for the node's).
            patch = partial(self._core.patch_namespaced_pod, name, ns, body,  # type: ignore[call-arg]
                            _content_type=MERGE_PATCH)
            await self._call(f"annotate pod {ns}/{name}", patch, deadline)
            await self._call(f"post an event on pod {ns}/{name}", partial(
                self._core.create_namespaced_event, ns,
                _pod_event(pod, reason, message(when))), deadline)
        return when, [f"{p.metadata.namespace}/{p.metadata.name}" for p in pods]


def _pod_event(pod: Any, reason: str, message: str) -> Any:
    stamp = datetime.now(UTC)
    meta = pod.metadata
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(generate_name=f"{meta.name}.", namespace=meta.namespace),
        involved_object=k8s.V1ObjectReference(kind="Pod", name=meta.name, uid=meta.uid,
                                              namespace=meta.namespace, api_version="v1"),
        reason=reason, message=message[:1024], type="Normal",
        source=k8s.V1EventSource(component="hostagent", host=_HOSTNAME),
        reporting_component="hostagent.io/hostagent", reporting_instance=_HOSTNAME,
        first_timestamp=stamp, last_timestamp=stamp, count=1,
    )
