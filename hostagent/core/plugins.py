"""The GPU plugins of the lendee's node, kept off its GPUs through their own switch.

NVIDIA's device plugin holds every GPU it serves open for as long as it runs (its NVML
health check, k8s-device-plugin v0.17 internal/rm/health.go), and so do a DCGM
exporter and the DCGM host engine; GPU Feature Discovery opens them at each labelling.
Deleting their pods stops nothing: the DaemonSet controller makes a new one at once
(kubernetes v1.35 pkg/controller/daemon), and a cordon does not stop it (DaemonSet pods
tolerate ``node.kubernetes.io/unschedulable``). What does stop them is what NVIDIA's
own mig-manager uses (mig-parted v0.15 pkg/mig/reconfigure/reconfigure.go): a node
label their DaemonSet selects nodes by, ``nvidia.com/gpu.deploy.<operand>``; set to a
value their selector refuses, the DaemonSet controller deletes their pods, and puts
them back once the label is restored.

The value set is ``"false"``. gpu-operator (controllers/state_manager.go,
addGPUStateLabels, v26.7) leaves any non-empty value of these labels alone, so
"false" and mig-manager's "paused-for-mig-change" are the same to it; but mig-manager
and gpu-operator's driver manager, which pause and restore the same labels around
their own work, keep a "false" they find as it is (maybeSetPaused/maybeSetTrue), where
a value of ours in their shape would be turned to "true" by their restore while we
still hold the GPU. What each label was before is remembered on the node (an
annotation), and restored exactly: an absent label stays absent.

For NVIDIA's static manifest and its Helm chart, whose DaemonSets select nodes by
nothing of the kind, README gives the term that makes them honour the same label
(``nvidia.com/gpu.deploy.device-plugin NotIn ["false"]`` in their required node
affinity). `honoured` tells, from a DaemonSet's pod template, whether it does.

No side effects: the specs are plain dicts, as the API serves them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

# The pods that serve the node's GPUs to the kubelet, as the common installs label
# them: NVIDIA's static manifest (k8s-device-plugin v0.17 deployments/static/
# nvidia-device-plugin.yml), the GPU Operator's device plugin (assets/state-device-
# plugin), NVIDIA's Helm chart of it (deployments/helm/nvidia-device-plugin), the
# kubelet plugin of NVIDIA's DRA driver (its chart's label, v25.12.0 to main at
# 22407113) and the GPU Operator's (manifests/state-dra-driver).
PLUGIN_SELECTORS = (
    "name=nvidia-device-plugin-ds",
    "app=nvidia-device-plugin-daemonset",
    "app.kubernetes.io/name=nvidia-device-plugin",
    "nvidia-dra-driver-gpu-component=kubelet-plugin",
    "app=nvidia-dra-driver-kubelet-plugin",
)

# The node labels that keep gpu-operator's operands that open the GPUs off the node
# (controllers/state_manager.go): the device plugin, GPU Feature Discovery, the DCGM
# exporter and host engine (mig-manager pauses the same), and the DRA stack's driver
# and exporter.
PLUGIN_LABELS = (
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.gpu-feature-discovery",
    "nvidia.com/gpu.deploy.dcgm-exporter",
    "nvidia.com/gpu.deploy.dcgm",
    "nvidia.com/gpu.deploy.dra-driver",
    "nvidia.com/gpu.deploy.dcgm-exporter-dra",
    "nvidia.com/gpu.deploy.dcgm-dra",
)

PAUSED = "false"

# What README tells the static manifest and the chart to add to their DaemonSet.
AFFINITY_TERM = (f'{{key: {PLUGIN_LABELS[0]}, operator: NotIn, values: ["{PAUSED}"]}}')


def _refused(expression: Mapping[str, Any], keys: Collection[str]) -> str | None:
    """The key of `expression` (a node selector requirement) if a node whose `keys`
    all read PAUSED fails it."""
    key, operator = expression.get("key"), expression.get("operator")
    values = expression.get("values") or []
    if key not in keys:
        return None
    if operator == "In" and PAUSED not in values:
        return str(key)
    if operator == "NotIn" and PAUSED in values:
        return str(key)
    if operator == "DoesNotExist":
        return str(key)
    return None


def honoured(spec: Mapping[str, Any], keys: Collection[str]) -> str | None:
    """The label of `keys` by which a pod template's `spec` (a DaemonSet's, as the API
    serves it) leaves a node once `keys` read PAUSED, or None if it stays whatever
    they say: its nodeSelector names one with another value, or every term of its
    required node affinity refuses PAUSED for one of them."""
    for key, value in sorted((spec.get("nodeSelector") or {}).items()):
        if key in keys and value != PAUSED:
            return str(key)
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    found: list[str] = []
    for term in terms:
        refused = [k for e in term.get("matchExpressions") or []
                   if (k := _refused(e, keys)) is not None]
        if not refused:
            return None
        found.append(refused[0])
    return found[0] if found else None


def remembered(text: str | None, keys: Collection[str]) -> dict[str, str | None] | None:
    """The labels of `keys` as they were before the pause, from the node's annotation
    (JSON: label -> value, null where absent); None where there is none or it cannot be
    read (the text is the cluster's: only `keys` are taken from it)."""
    if not text:
        return None
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(found, dict):
        return None
    return {k: (v if isinstance(v, str) else None) for k, v in found.items()
            if k in keys}


def to_remember(labels: Mapping[str, str], keys: Iterable[str],
                earlier: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """What the annotation keeps of `keys` before they are paused: their value in
    `labels` (None: absent), except where an earlier pause, never restored, already
    remembered one (the label reads PAUSED now because of it)."""
    kept = dict(earlier or {})
    for key in keys:
        kept.setdefault(key, labels.get(key))
    return kept

