"""Kubernetes Events on the lendee's Node: what `kubectl describe node` shows of a
lend and a reclaim."""

from __future__ import annotations

import logging
import socket
from datetime import UTC, datetime


from hostagent import k8s_lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import client as k8s

from hostagent.kube.client import Client, KubeRequestError, KubeUnavailable

log = logging.getLogger("hostagent.kube")


_HOSTNAME = socket.gethostname()


class Events(Client):
    """Events on the node."""

    async def post_event(self, node: str, *, reason: str, message: str,
                         warning: bool = False, timeout: float | None = None) -> None:
        """A core/v1 Event on the Node, as the kubelet writes its own (namespace default,
        involvedObject.uid = the node's name), so `kubectl describe node` and `kubectl
        get events` show it. Best effort: the event is also in the journal, and a
        failure to post it is logged, never raised (KubeAuthError aside)."""
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
