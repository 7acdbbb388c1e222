"""`hostagent check-config` on the host (outside the Nix build sandbox) also says what
the agent would wait for rather than stop on: owners' and the lendee's domains libvirt
does not have, a control_group that does not exist, a kubeconfig that is not there, all
in one run, as warnings (the agent runs with them, its health red)."""

from __future__ import annotations

import grp
import sys
from pathlib import Path

import libvirt
import pytest

from hostagent import cli

CONFIG = '''control_group = "players"
[lendee]
domain = "gpu-node"
gpus = ["0000:01:00.0"]
[owners.old-windows]
gpus = ["0000:01:00.0"]
[kubernetes]
kubeconfig = "{kubeconfig}"
'''


class Conn:
    def listAllDomains(self) -> list[object]:
        return [type("Dom", (), {"name": lambda self: "gpu-node"})()]

    def close(self) -> int:
        return 0


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NIX_BUILD_TOP", raising=False)
    monkeypatch.setattr(libvirt, "openReadOnly", lambda uri: Conn())

    def getgrnam(name: str) -> object:
        raise KeyError(name)

    monkeypatch.setattr(grp, "getgrnam", getgrnam)


@pytest.mark.usefixtures("host")
def test_every_stale_entry_is_said_in_one_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(kubeconfig=tmp_path / "k3s.yaml"))
    assert cli.main(["--config", str(path), "check-config"]) == 0
    err = capsys.readouterr().err
    assert "hostagent: warning: owners.old-windows: libvirt at qemu:///system has no " \
           "domain 'old-windows'" in err
    assert "hostagent: warning: control_group: there is no group 'players'" in err
    assert f"hostagent: warning: kubernetes.kubeconfig: {tmp_path / 'k3s.yaml'} does not " \
           "exist" in err


@pytest.mark.usefixtures("host")
def test_the_nix_build_sandbox_is_not_the_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NIX_BUILD_TOP", "/build")
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(kubeconfig=tmp_path / "k3s.yaml"))
    assert cli.main(["--config", str(path), "check-config"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.usefixtures("host")
def test_without_libvirt_python_the_domains_are_said_unchecked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An install without libvirt-python (its binding is a build of its own) still
    checks the configuration: the domains are said to be unchecked and why, the other
    host checks still run."""
    monkeypatch.setitem(sys.modules, "libvirt", None)  # import libvirt: ModuleNotFoundError
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(kubeconfig=tmp_path / "k3s.yaml"))
    assert cli.main(["--config", str(path), "check-config"]) == 0
    err = capsys.readouterr().err
    assert "hostagent: warning: libvirt_uri: the domains are not checked: libvirt-python " \
           "is not installed" in err
    assert "hostagent: warning: control_group: there is no group 'players'" in err


@pytest.mark.usefixtures("host")
def test_every_lendees_domain_and_kubeconfig_are_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[lendees.gpu-node]\ngpus = ["0000:01:00.0"]\n'
                    f'[lendees.gpu-node-b]\ngpus = ["0000:02:00.0"]\n'
                    f'kubeconfig = "{tmp_path / "b.yaml"}"\n[kubernetes]\n')
    assert cli.main(["--config", str(path), "check-config"]) == 0
    err = capsys.readouterr().err
    assert "warning: lendees.gpu-node-b: libvirt at qemu:///system has no domain " \
           "'gpu-node-b'" in err
    assert "lendees.gpu-node:" not in err  # it is defined
    assert f"warning: lendees.gpu-node-b.kubeconfig: {tmp_path / 'b.yaml'} does not exist" in err
