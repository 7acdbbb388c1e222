"""The [kubernetes] keys for real clusters: expected resources, the borrowed label, drain knobs."""

from __future__ import annotations

import pytest

from hostagent.core.config import ConfigError, parse

BASE = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"

[kubernetes]
"""


def kubernetes(text: str) -> object:
    cfg = parse(BASE + text, "test.toml")
    assert cfg.kubernetes is not None
    return cfg.kubernetes


def error(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(BASE + text, "test.toml")
    return str(info.value)


def test_defaults() -> None:
    k = kubernetes("")
    assert k.expected is None  # type: ignore[attr-defined]
    assert k.borrowed_label == "hostagent.io/borrowed"  # type: ignore[attr-defined]
    assert k.grace_period is None  # type: ignore[attr-defined]
    assert k.skip_wait_for_delete_timeout == 10.0  # type: ignore[attr-defined]


def test_every_key() -> None:
    k = kubernetes('expected = { "nvidia.com/gpu" = 4, "nvidia.com/mig-1g.10gb" = 7 }\n'
                   'borrowed_label = ""\ngrace_period = "20s"\n'
                   'skip_wait_for_delete_timeout = "0s"\n')
    assert k.expected == {"nvidia.com/gpu": 4, "nvidia.com/mig-1g.10gb": 7}  # type: ignore[attr-defined]
    assert k.borrowed_label is None  # type: ignore[attr-defined]
    assert k.grace_period == 20.0  # type: ignore[attr-defined]
    assert k.skip_wait_for_delete_timeout == 0.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "says"), [
    ('expected = 4', 'kubernetes.expected: expected a table'),
    ('expected = {}', 'kubernetes.expected: is empty'),
    ('expected = { gpu = 4 }', 'kubernetes.expected.gpu: "gpu" is not an extended resource name'),
    ('expected = { "nvidia.com/gpu" = 0 }', 'kubernetes.expected."nvidia.com/gpu": 0 is not a count'),
    ('expected = { "nvidia.com/gpu" = "4" }', 'kubernetes.expected."nvidia.com/gpu": expected an integer'),
    ('borrowed_label = "not a label"', 'kubernetes.borrowed_label: "not a label" is not a label key'),
    ('grace_period = 30', 'kubernetes.grace_period'),
])
def test_errors_name_the_key_and_the_fix(text: str, says: str) -> None:
    message = error(text)
    assert says in message, message


def test_the_gpu_plugins_are_found_by_the_current_charts_labels_or_the_setting() -> None:
    """NVIDIA's DRA driver chart (v25.12.0 and its main since) labels its kubelet plugin's
    pods nvidia-dra-driver-gpu-component=kubelet-plugin (main names the chart
    dra-driver-nvidia-gpu, so app.kubernetes.io/name no longer finds them)."""
    default = kubernetes("").plugin_selectors  # type: ignore[attr-defined]
    assert "nvidia-dra-driver-gpu-component=kubelet-plugin" in default
    assert "app=nvidia-device-plugin-daemonset" in default
    k = kubernetes('plugin_selectors = ["app=my-plugin,tier!=control", "gpu-plugin"]\n')
    assert k.plugin_selectors == ("app=my-plugin,tier!=control", "gpu-plugin")  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", ['"app in (a, b)"', '"=x"', '"a=b c"', '"a=b,"'])
def test_a_plugin_selector_that_is_not_one_is_refused(bad: str) -> None:
    message = error(f"plugin_selectors = [{bad}]\n")
    assert "kubernetes.plugin_selectors" in message and "label selector" in message, message
