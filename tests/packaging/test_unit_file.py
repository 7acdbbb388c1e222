"""systemd/hostagent.service: systemd itself accepts it, and it says what the agent needs.

`systemd-analyze verify` runs against a temporary root that holds the unit where
`make install` puts it, a stub executable at its ExecStart= path and stub targets
for the default dependencies, so nothing of this machine's systemd is consulted.
"""

from __future__ import annotations

from pathlib import Path

from tests.packaging.units import (
    EXPOSURE,
    exposure,
    needs_analyze,
    settings,
    stub_root,
    UNIT,
)
from tests.packaging.units import (
    analyze,
)


@needs_analyze
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    out = analyze(stub_root(tmp_path, UNIT.read_text()), "verify")
    # An unknown or misspelt key is only a warning ("ignoring"): any output fails.
    assert (out.returncode, out.stdout + out.stderr) == (0, "")


@needs_analyze
def test_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    """The check above is not vacuous: a misspelt key does produce output."""
    text = UNIT.read_text().replace("WatchdogSec=", "WatchDogSec=")
    out = analyze(stub_root(tmp_path, text), "verify")
    assert "WatchDogSec" in out.stderr


@needs_analyze
def test_hardening_keeps_exposure_low(tmp_path: Path) -> None:
    assert exposure(stub_root(tmp_path, UNIT.read_text())) <= EXPOSURE


def test_the_unit_says_what_the_issue_asks() -> None:
    s = settings(UNIT.read_text())
    assert s["Type"] == ["notify"]
    assert s["WatchdogSec"] and s["Restart"] == ["on-failure"]
    assert "libvirtd.service" in " ".join(s["After"]).split()
    assert "libvirtd.service" in " ".join(s["Wants"]).split()
    assert "Requires" not in s and "BindsTo" not in s  # a libvirtd restart must not stop us
    assert s["RuntimeDirectory"] == ["hostagent"] and s["StateDirectory"] == ["hostagent"]
    assert s["ExecStart"] == [
        "/opt/hostagent/bin/hostagent --config /etc/hostagent/config.toml run"
    ]
    assert s["ProtectSystem"] == ["strict"]
    assert s["NoNewPrivileges"] == ["yes"] and s["PrivateTmp"] == ["yes"]
    assert s["SystemCallFilter"][0] == "@system-service"
    families = s["RestrictAddressFamilies"][0].split()
    # libvirt, the hook and control sockets, journald; the Kubernetes API over TCP.
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= set(families)
    assert "ProtectHome" in s
    # The connection caps assume a known descriptor budget, not the machine's default.
    assert s["LimitNOFILE"] == ["4096"]


def test_the_hardening_denies_what_the_agent_does_not_need() -> None:
    """Raw disks, other users' files, home directories and exec from anywhere the agent
    can write are out of reach; what it does use stays reachable."""
    s = settings(UNIT.read_text())
    # Devices: the NVIDIA control and GPU nodes for NVML (major 195, "nvidia-frontend"
    # in /proc/devices), nothing else but the pseudo-devices PrivateDevices= makes.
    assert s["PrivateDevices"] == ["yes"] and s["DevicePolicy"] == ["closed"]
    assert s["DeviceAllow"] == ["char-nvidia-frontend rw"]
    bound = " ".join(s["BindPaths"]).split()
    assert "-/dev/nvidiactl" in bound and "-/dev/nvidia0" in bound
    assert all(p.startswith("-/dev/nvidia") for p in bound), bound
    # Capabilities: the control socket's group, a listener's port below 1024.
    assert s["CapabilityBoundingSet"] == ["CAP_CHOWN CAP_NET_BIND_SERVICE"]
    assert "AmbientCapabilities" not in s
    # Homes: an empty tmpfs but root's kubeconfig directory, read-only, if it exists.
    assert s["ProtectHome"] == ["tmpfs"] and s["BindReadOnlyPaths"] == ["-/root/.kube"]
    # Exec: nothing under the writable directories, /tmp or /dev; /usr (python3,
    # systemctl, the libraries) and the venv's compiled modules.
    assert s["NoExecPaths"] == ["/"]
    assert s["ExecPaths"] == ["/usr /opt/hostagent/"]
    # System calls: the service set, less the privileged and resource ones but chown.
    assert s["SystemCallFilter"] == ["@system-service", "~@privileged @resources", "@chown"]
