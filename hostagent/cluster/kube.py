"""Kubernetes for the lendee's node: cordon, drain, wait for Ready and GPUs, uncordon.

Taking the GPUs from a worker without draining it kills workloads mid-step; giving them
back without checking leaves a node that says Ready and runs nothing. This package does
both halves the way the cluster expects: it drains like ``kubectl drain``
(k8s.io/kubectl/pkg/drain), remembers on the Node whether *it* cordoned (so an
administrator's cordon is never lifted), and waits with watches, not polling loops.

It is the only package that imports kubernetes-asyncio. Library errors are translated
here, once, into this tree (``raise … from e``)::

    KubeError
    ├── KubeConfigError    the kubeconfig is missing, unreadable or unusable (startup)
    ├── NodeNotFound       no Node of that name in the cluster
    ├── KubeUnavailable    the API server stayed unreachable, or answered 5xx, until
    │                      the step's deadline (retried with backoff and jitter before)
    ├── KubeRequestError   the API server refused a request (4xx); .status, .reason
    ├── KubeAuthError      401 or 403: the credentials are wrong, expired or lack a
    │                      right (a 401 is retried once with credentials read afresh:
    │                      a rotated k3s client certificate, an exec plugin's new token)
    ├── NodeNotReady       the node was not Ready by wait_ready's deadline
    ├── PluginsNotPaused   the GPU plugins could not be kept off the node's GPUs
    └── DrainAborted       the drain did not finish and on_timeout is "abort"; .report

The adapter holds no policy: which pods may be evicted, how long each step may take
and what to do when a drain does not finish are arguments, taken from the
configuration by the caller.

By concern: `client` (the connection, its retries and the errors), `drain` (read side
by side with kubectl's drain.go), `cordon` (our cordon and its marker), `watches` (the
node and its pods while lent), `returns` (Ready and the GPUs before the uncordon),
`events` (what the Node's Events say), `plugins` (the GPU plugins paused for a
live change). `Kube` is all of them.
"""

from __future__ import annotations

from hostagent.cluster.client import (
    KubeAuthError,
    KubeConfigError,
    KubeError,
    KubeRequestError,
    KubeUnavailable,
    NodeCheck,
    NodeNotFound,
    NodeNotReady,
    Timing,
)
from hostagent.cluster.cordon import CordonResult, MARKER_VALUE, Taint, cordon_marker
from hostagent.cluster.drain import (
    DrainAborted,
    DrainPlan,
    DrainReport,
    Drains,
    Ignored,
    LeftPod,
    LeftReason,
    PodInfo,
    PodRef,
    plan_drain,
)
from hostagent.cluster.events import Events
from hostagent.cluster.plugins import ANNOTATION as PAUSED_PLUGINS, Plugins, PluginsNotPaused
from hostagent.cluster.returns import ExpectedGpus, Returns, expected_gpus
from hostagent.cluster.watches import NodeView, requests_gpu

__all__ = [
    "MARKER_VALUE",
    "CordonResult",
    "DrainAborted",
    "DrainPlan",
    "DrainReport",
    "ExpectedGpus",
    "Ignored",
    "Kube",
    "KubeAuthError",
    "KubeConfigError",
    "KubeError",
    "KubeRequestError",
    "KubeUnavailable",
    "LeftPod",
    "LeftReason",
    "NodeNotFound",
    "NodeCheck",
    "NodeView",
    "NodeNotReady",
    "PAUSED_PLUGINS",
    "PluginsNotPaused",
    "PodInfo",
    "PodRef",
    "Taint",
    "Timing",
    "cordon_marker",
    "expected_gpus",
    "plan_drain",
    "requests_gpu",
]


class Kube(Drains, Plugins, Returns, Events):
    """A connection to the cluster. Create it with `connect` (or `from_config`); close it."""
