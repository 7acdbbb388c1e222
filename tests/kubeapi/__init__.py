"""A stand-in for the Kubernetes API server, on loopback, for tests and the lab.

The lab has everything real except the Kubernetes API server (it cannot be installed
from the package registries this project reaches). This package stands in for it,
and it is the project's only stand-in, so it tries to be honest: the real
kubernetes-asyncio client talks to it over HTTP, and it answers with the codes, Status
bodies, resourceVersions and watch events kube-apiserver would. Where the adapter makes
a decision on an answer (404, 409, 410, 429, 500, a changed UID), the answer follows
the real server's code paths, cited in the modules.

What it models:

- Nodes: get, list, create, delete, watch; PATCH as merge patch, strategic merge patch
  (merge keys for conditions and addresses; ``$patch``, ``$deleteFromPrimitiveList``)
  and JSON patch; PUT; the ``status`` subresource (status changes go through it only);
  optimistic concurrency on ``metadata.resourceVersion`` and ``metadata.uid``; the
  ``node.kubernetes.io/{unschedulable,not-ready,unreachable}:NoSchedule`` taints the
  node lifecycle controller keeps in step.
- Pods: list across namespaces or in one, field selectors (``spec.nodeName=…``), label
  selectors, get, create (status starts Pending), delete with graceful termination
  (``deletionTimestamp``, gone after terminationGracePeriodSeconds × termination_scale,
  and only while the node is Ready: no kubelet, no confirmation), the ``eviction``
  subresource with PodDisruptionBudgets (429 with the DisruptionBudget cause, 500 for
  more than one budget, terminal/pending/terminating pods skip the budget, unready
  pods and ``unhealthyPodEvictionPolicy``), and controllers that replace evicted pods:
  a ReplicaSet at once under a new name, a StatefulSet once the old pod is gone under
  the same name; both with a new UID, unscheduled or on ``replacement_node``.
- PodDisruptionBudgets (policy/v1): create, get, list, delete; ``minAvailable`` and
  ``maxUnavailable`` as integers or percentages; status computed when read.
- Watches: chunked JSON lines, from a resourceVersion (events kept: ``history``;
  older is ``ERROR`` 410 Expired, as the watch cache answers) or from now with the
  current objects ADDED first; objects entering or leaving a selector are ADDED or
  DELETED; ``timeoutSeconds``; cut when the server goes down.
- What a real ``kubectl`` needs (tests.kubeapi.discovery): legacy discovery (``/api``,
  ``/apis``, one APIResourceList per group version, ``pods/eviction`` included) and
  server-side Tables for nodes, pods, events and budgets (``get -o wide``), core/v1
  Events with their field selectors (``get events``, ``describe node``), DaemonSets
  as stored objects (``drain`` reads a pod's DaemonSet) and node Leases.
- GPUs as the NVIDIA device plugin and GPU Feature Discovery publish them
  (`cluster.gpu_status`): time-slicing (``nvidia.com/gpu.replicas``, allocatable × the
  replicas) and MIG, mixed strategy (``nvidia.com/mig-<profile>`` resources and
  labels); pods that request GPUs.
- Dynamic Resource Allocation (resource.k8s.io/v1): DeviceClasses, ResourceSlices
  (field selectors ``spec.nodeName``, ``spec.driver``) and ResourceClaims (``status``
  subresource), with discovery and the printers' columns; GPUs as NVIDIA's DRA driver
  publishes them (`cluster.gpu_device`, `Cluster.publish_devices`), pods holding them
  through claims allocated and reserved as the scheduler leaves them
  (``add_pod(devices=...)``), claims released with their pod as the resourceclaim
  controller does. No allocation of claims a client creates (no scheduler).
- Faults: refused connections (`StandIn.down`, `down_for`), error answers and delays
  per path regex (`fail`, `slow`; 401 and 403 with the server's Status bodies); a
  bearer token if asked.
- A lab kubelet (`Kubelet`) that posts the node's Ready condition and GPU count (or,
  on a DRA node, its ResourceSlice) from the lendee VM's real state.

What it does not model: TLS, authentication beyond one bearer token, authorization,
admission, aggregated discovery (a client asking for it gets the legacy form and
falls back, as from any server before 1.26), namespaces as objects (any namespace name is accepted), any other resource,
server-side apply, ``$retainKeys``, pagination (``limit`` is ignored: everything comes
in one page), watch bookmarks, a scheduler (replacement pods go to ``replacement_node``
or stay Pending), taint-based eviction (a NoExecute taint evicts nothing), Leases and
heartbeats beyond the Ready condition, DaemonSet and Job controllers, finalizers and
garbage collection, and the disruption controller's asynchrony (budgets are computed
when asked, and "expected pods" is the non-terminating matching pods, not a scale).

Start it:

- in a test's loop: ``async with StandIn(termination_scale=0.01) as api:`` then
  ``write_kubeconfig(path, api.url)``; seed with ``api.cluster.add_node(...)``,
  ``add_pod(...)``, ``add_pdb(...)``;
- for synchronous code: ``with serve_in_thread(...) as api:`` and ``api.call(fn, ...)``;
- as a process: ``python -m tests.kubeapi --port 0 --state FILE --kubeconfig FILE``
  prints its URL on the first line; seed it through the API or the state file.
"""

from tests.kubeapi.cluster import Cluster
from tests.kubeapi.kubelet import Kubelet
from tests.kubeapi.server import StandIn, ThreadedStandIn, serve_in_thread, write_kubeconfig

__all__ = [
    "Cluster",
    "Kubelet",
    "StandIn",
    "ThreadedStandIn",
    "serve_in_thread",
    "write_kubeconfig",
]
