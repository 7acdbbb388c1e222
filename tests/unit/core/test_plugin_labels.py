"""The GPU plugins' deploy labels (`hostagent.core.plugins`, no side effects): which
DaemonSet pod templates honour them (a node selector, or every term of the required node
affinity refusing "false"), and what is remembered of the labels before a pause (the
first pause wins; only the paused labels are taken from the cluster's annotation).
The pause and restore against the real control plane: tests/unit/cluster/test_plugins.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hostagent.core import plugins as rules
from hostagent.core.plugins import AFFINITY_TERM, PAUSED, PLUGIN_LABELS, PLUGIN_SELECTORS

DEVICE_PLUGIN, GFD, DCGM_EXPORTER = PLUGIN_LABELS[0], PLUGIN_LABELS[1], PLUGIN_LABELS[2]
PAUSABLE = {"key": DEVICE_PLUGIN, "operator": "NotIn", "values": [PAUSED]}
CHART_TERMS = [  # NVIDIA's chart's values.yaml, v0.17.4
    [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In",
      "values": ["true"]}],
    [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}],
]


def affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}}


def test_gpu_operators_node_selector_is_honoured() -> None:
    assert rules.honoured({"nodeSelector": {DEVICE_PLUGIN: "true"}}, PLUGIN_LABELS) == \
        DEVICE_PLUGIN
    assert rules.honoured({"nodeSelector": {"other": "x"}}, PLUGIN_LABELS) is None


def test_the_static_manifest_honours_nothing_until_readmes_term_is_added() -> None:
    assert rules.honoured({}, PLUGIN_LABELS) is None
    assert rules.honoured(affinity([PAUSABLE]), PLUGIN_LABELS) == DEVICE_PLUGIN
    assert AFFINITY_TERM == ('{key: nvidia.com/gpu.deploy.device-plugin, operator: NotIn, '
                             'values: ["false"]}')


def test_the_charts_terms_each_need_the_label_for_the_node_to_be_left() -> None:
    assert rules.honoured(affinity(*CHART_TERMS), PLUGIN_LABELS) is None
    half = affinity([*CHART_TERMS[0], PAUSABLE], CHART_TERMS[1])
    assert rules.honoured(half, PLUGIN_LABELS) is None  # the second term still matches
    whole = affinity(*([*t, PAUSABLE] for t in CHART_TERMS))
    assert rules.honoured(whole, PLUGIN_LABELS) == DEVICE_PLUGIN


@pytest.mark.parametrize(("expression", "honoured"), [
    ({"key": DEVICE_PLUGIN, "operator": "In", "values": ["true"]}, True),
    ({"key": DEVICE_PLUGIN, "operator": "In", "values": ["true", "false"]}, False),
    ({"key": DEVICE_PLUGIN, "operator": "NotIn", "values": ["paused-for-mig-change"]}, False),
    ({"key": DEVICE_PLUGIN, "operator": "Exists"}, False),
    ({"key": DEVICE_PLUGIN, "operator": "DoesNotExist"}, True),
    ({"key": "nvidia.com/other", "operator": "NotIn", "values": ["false"]}, False),
])
def test_an_affinity_expression_honours_the_label_where_false_fails_it(
        expression: dict[str, Any], honoured: bool) -> None:
    assert (rules.honoured(affinity([expression]), PLUGIN_LABELS) is not None) is honoured


def test_what_is_remembered_is_only_the_labels_paused_and_the_first_pause_wins() -> None:
    assert rules.remembered(None, PLUGIN_LABELS) is None
    assert rules.remembered("{not json", PLUGIN_LABELS) is None
    assert rules.remembered('["a"]', PLUGIN_LABELS) is None
    text = json.dumps({DEVICE_PLUGIN: "true", GFD: None, "kubernetes.io/hostname": "x"})
    assert rules.remembered(text, PLUGIN_LABELS) == {DEVICE_PLUGIN: "true", GFD: None}
    kept = rules.to_remember({DEVICE_PLUGIN: PAUSED, DCGM_EXPORTER: "true"},
                             [DEVICE_PLUGIN, DCGM_EXPORTER, GFD], {DEVICE_PLUGIN: "true"})
    assert kept == {DEVICE_PLUGIN: "true", DCGM_EXPORTER: "true", GFD: None}


def test_the_default_selectors_find_nvidias_static_manifest_chart_and_operator() -> None:
    assert {"name=nvidia-device-plugin-ds", "app=nvidia-device-plugin-daemonset",
            "app.kubernetes.io/name=nvidia-device-plugin"} <= set(PLUGIN_SELECTORS)


def test_a_node_selector_naming_several_labels_is_said_by_the_first_by_name() -> None:
    spec = {"nodeSelector": {GFD: "true", DEVICE_PLUGIN: "true", "zone": "a"}}
    assert rules.honoured(spec, PLUGIN_LABELS) == DEVICE_PLUGIN
    # A selector that already asks for "false" keeps the pods whatever the pause.
    assert rules.honoured({"nodeSelector": {DEVICE_PLUGIN: PAUSED}}, PLUGIN_LABELS) is None
    # Only the labels asked about count.
    assert rules.honoured({"nodeSelector": {GFD: "true"}}, [DEVICE_PLUGIN]) is None


def test_each_term_must_refuse_and_the_first_terms_label_is_said() -> None:
    gfd = {"key": GFD, "operator": "In", "values": ["true"]}
    assert rules.honoured(affinity([PAUSABLE], [gfd]), PLUGIN_LABELS) == DEVICE_PLUGIN
    assert rules.honoured(affinity([gfd], [PAUSABLE]), PLUGIN_LABELS) == GFD
    assert rules.honoured(affinity([gfd, PAUSABLE]), PLUGIN_LABELS) == GFD
    # A term with no expression matches every node: nothing is honoured.
    assert rules.honoured(affinity([PAUSABLE], []), PLUGIN_LABELS) is None
    empty: dict[str, Any] = {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}}
    assert rules.honoured(empty, PLUGIN_LABELS) is None


@pytest.mark.parametrize(("operator", "values", "refused"), [
    ("In", [PAUSED], False),
    ("In", [], True),
    ("NotIn", [], False),
    ("NotIn", ["true", PAUSED], True),
    ("DoesNotExist", None, True),
    ("Gt", ["1"], False),
])
def test_an_expression_with_its_operator_refuses_false_or_not(
        operator: str, values: list[str] | None, refused: bool) -> None:
    expression: dict[str, Any] = {"key": DEVICE_PLUGIN, "operator": operator}
    if values is not None:
        expression["values"] = values
    assert rules.honoured(affinity([expression]), PLUGIN_LABELS) == (
        DEVICE_PLUGIN if refused else None)


def test_an_annotation_that_is_not_an_object_of_labels_is_not_read() -> None:
    assert rules.remembered("", PLUGIN_LABELS) is None
    assert rules.remembered("[" * 100_000, PLUGIN_LABELS) is None  # too deep to read
    text = json.dumps({DEVICE_PLUGIN: 1, GFD: "true"})
    assert rules.remembered(text, PLUGIN_LABELS) == {DEVICE_PLUGIN: None, GFD: "true"}
    assert rules.remembered("{}", PLUGIN_LABELS) == {}


def test_a_first_pause_remembers_each_label_as_it_is() -> None:
    assert rules.to_remember({DEVICE_PLUGIN: "true"}, [DEVICE_PLUGIN, GFD], None) == {
        DEVICE_PLUGIN: "true", GFD: None}
