"""Every default of the configuration, written out: a default switched (lint before a
start turned off, a timeout shortened) changes what the agent does to hardware without
a word in anyone's file, so each is asserted here, not read back from the dataclass."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.core.config import (
    ConfigError,
    DrainTimeoutAction,
    Gpu,
    Hotplug,
    Kubernetes,
    Lendee,
    LogLevel,
    Metrics,
    Mqtt,
    Owner,
    Policy,
    Regrow,
    Ssh,
    SshEndpoint,
    Timeouts,
    Verify,
    VerifyMethod,
    parse,
)
from hostagent.core.config_read import MQTT_VERBS
from hostagent.core.config import GpuApi

MINIMAL = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"

[owners.gaming1]
gpus = ["gpu-a"]
"""


def test_every_top_level_default() -> None:
    cfg = parse(MINIMAL, "t.toml")
    assert cfg.libvirt_uri == "qemu:///system"
    assert cfg.hook_socket == Path("/run/hostagent/hook.sock")
    assert cfg.control_socket == Path("/run/hostagent/control.sock")
    assert cfg.control_group is None
    assert cfg.control_verbs == {"status", "hold", "resume", "lend"}
    assert cfg.state_dir == Path("/var/lib/hostagent")
    assert cfg.log_level is LogLevel.INFO
    assert (cfg.kubernetes, cfg.ssh, cfg.mqtt) == (None, None, None)
    assert cfg.metrics == Metrics(listen=None)


def test_every_default_of_a_gpu_the_lendee_and_an_owner() -> None:
    cfg = parse(MINIMAL, "t.toml")
    assert cfg.lendee == Lendee(domain="gpu-node", node="gpu-node", gpus=("gpu-a",),
                                min_gpus=1, cdi_refresh="")
    assert cfg.owners["gaming1"] == Owner(domain="gaming1", gpus=("gpu-a",),
                                          start_at_boot=False)
    assert cfg.gpus["gpu-a"] == Gpu(label="gpu-a", pci="0000:01:00.0", functions=(),
                                    uuid=None, name=None, iommu_groups=())


def test_every_policy_default_is_the_careful_one() -> None:
    assert parse(MINIMAL).policy == Policy(
        relend_delay=30.0,
        force_off_after=None,  # never destroy the lendee
        on_drain_timeout=DrainTimeoutAction.PROCEED,
        lint_before_start=True,  # a VM whose XML has errors is not started
        partial=True,
        regrow=Regrow.WHEN_IDLE,  # no running GPU job is killed to add a GPU
        regrow_max_wait=None,
        hotplug=Hotplug.AUTO,
        reserve_lead=900.0,
        reserve_margin=300.0,
        reserve_expiry=1800.0,
        reserve_cooldown=3600.0,
    )


def test_every_timeout_default() -> None:
    assert parse(MINIMAL).timeouts == Timeouts(guest_agent=180.0, shutdown=120.0, start=120.0,
                                               drain=300.0, ready=600.0, release=10.0)


def test_every_verify_default() -> None:
    assert parse(MINIMAL).verify == Verify(method=VerifyMethod.GUEST_AGENT,
                                           command="nvidia-smi", timeout=120.0, ssh=None)
    ssh = parse(MINIMAL + '[verify]\nmethod = "ssh"\n[verify.ssh]\nhost = "n"\nuser = "u"\n'
                'key = "/k"\nknown_hosts = "/kh"\n').verify.ssh
    assert ssh == Ssh(host="n", port=22, user="u", key=Path("/k"), known_hosts=Path("/kh"))


def test_every_kubernetes_default() -> None:
    assert parse(MINIMAL + "[kubernetes]\n").kubernetes == Kubernetes(
        kubeconfig=None,
        annotation_prefix="hostagent.io/",
        gpu_resource="nvidia.com/gpu",
        gpu_api=GpuApi.AUTO,
        dra_driver="gpu.nvidia.com",
        drain_emptydir=True,
        drain_unmanaged=False,  # a pod no controller recreates is not evicted
        lent_taints=(),
        evict_retry=5.0,
        borrowed_label="hostagent.io/borrowed",
        expected=None,
        grace_period=None,
        skip_wait_for_delete_timeout=10.0,
        plugin_selectors=(
            "name=nvidia-device-plugin-ds",
            "app=nvidia-device-plugin-daemonset",
            "app.kubernetes.io/name=nvidia-device-plugin",
            "nvidia-dra-driver-gpu-component=kubelet-plugin",
            "app=nvidia-dra-driver-kubelet-plugin",
        ),
        plugin_labels=Kubernetes().plugin_labels,  # gpu-operator's: test_plugins.py
    )


def test_every_ssh_endpoint_and_mqtt_default() -> None:
    cfg = parse(MINIMAL + '[ssh]\nlisten = 2222\n[mqtt]\nbroker = "mqtt://b"\n')
    assert cfg.ssh == SshEndpoint(listen=":2222", host_key=None,
                                  authorized_keys=Path("/etc/hostagent/authorized_keys"))
    assert cfg.ssh_host_key == Path("/var/lib/hostagent/ssh_host_ed25519_key")
    assert cfg.mqtt == Mqtt(broker="mqtt://b", ca=None, username=None, password_file=None,
                            discovery_prefix="homeassistant", base_topic=None,
                            verbs=frozenset(MQTT_VERBS), vms=None, per_entity=False)
    assert MQTT_VERBS == ("play", "release", "hold", "lend", "reclaim", "reserve")


# --- what the defaults cannot stand in for -------------------------------------------


def test_verify_by_ssh_without_its_section_is_refused_naming_the_key() -> None:
    """Accepted, the agent would verify through the guest agent instead, and the
    administrator who asked for SSH would never know."""
    with pytest.raises(ConfigError) as e:
        parse(MINIMAL + '[verify]\nmethod = "ssh"\n', "t.toml")
    assert e.value.key == "verify.ssh"
    assert str(e.value) == ('t.toml: verify.ssh: missing: verify.method = "ssh" needs it; add '
                            "a [verify.ssh] section with host, user, key and known_hosts")


@pytest.mark.parametrize(("port", "accepted"), [
    (0, False), (1, True), (22, True), (65535, True), (65536, False), (-1, False),
])
def test_a_port_is_from_1_to_65535(port: int, accepted: bool) -> None:
    text = (MINIMAL + '[verify]\nmethod = "ssh"\n[verify.ssh]\nhost = "n"\nuser = "u"\n'
            f'key = "/k"\nknown_hosts = "/kh"\nport = {port}\n')
    if accepted:
        ssh = parse(text).verify.ssh
        assert ssh is not None and ssh.port == port
        assert parse(MINIMAL + f"[ssh]\nlisten = {port}\n").ssh == SshEndpoint(
            listen=f":{port}")
        return
    for bad, key in [(text, "verify.ssh.port"), (MINIMAL + f"[ssh]\nlisten = {port}\n",
                                                 "ssh.listen")]:
        with pytest.raises(ConfigError) as e:
            parse(bad, "t.toml")
        assert e.value.key == key
        assert str(e.value) == (f"t.toml: {key}: {port} is not a TCP port; write a number "
                                "from 1 to 65535")


@pytest.mark.parametrize("listen", ["127.0.0.1:65536", "[::1]:65536", ":0", ":99999"])
def test_an_address_to_listen_on_has_a_port_from_1_to_65535(listen: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(MINIMAL + f'[metrics]\nlisten = "{listen}"\n', "t.toml")
    assert e.value.key == "metrics.listen" and f'"{listen}" is not an address' in str(e.value)
    assert parse(MINIMAL + '[metrics]\nlisten = "[::1]:65535"\n').metrics.address == ("::1", 65535)
