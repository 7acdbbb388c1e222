"""`hostagent check-config` warns about paths the hook or the systemd unit cannot follow.

libvirtd runs hooks/qemu with a scrubbed environment, so the hook knows only its
built-in socket and spool paths; the unit's ProtectSystem=strict leaves the agent
writable only /run/hostagent and /var/lib/hostagent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hostagent import cli
from hostagent.core import config

REPO = Path(__file__).resolve().parents[3]
LENDEE = '[lendee]\ndomain = "gpu-node"\ngpus = ["0000:01:00.0"]\n'


@pytest.fixture(autouse=True)
def file_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's checks alone, as in the Nix build sandbox: this host's libvirt, groups
    and kubeconfig are test_check_host.py's."""
    monkeypatch.setenv("NIX_BUILD_TOP", "/build")


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], top: str) -> list[str]:
    path = tmp_path / "config.toml"
    path.write_text(top + LENDEE)
    assert cli.main(["--config", str(path), "check-config"]) == 0  # warnings only
    out, err = capsys.readouterr()
    assert out.startswith(f"{path}: OK")
    return err.splitlines()


def test_the_defaults_say_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check(tmp_path, capsys, "") == []
    # Set to their defaults, or moved where the unit lets the agent write: still nothing.
    assert check(tmp_path, capsys, 'hook_socket = "/run/hostagent/hook.sock"\n'
                                   'control_socket = "/run/hostagent/ctl/control.sock"\n') == []


def test_a_hook_socket_the_hook_cannot_see(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert check(tmp_path, capsys, 'hook_socket = "/srv/hostagent/hook.sock"\n') == [
        'hostagent: warning: hook_socket = "/srv/hostagent/hook.sock": libvirtd runs the hook '
        "with a scrubbed environment, so the hook cannot follow it: it always asks the agent at "
        "/run/hostagent/hook.sock; finding nobody there, it spools every event and lets libvirt "
        "go on, so a gaming VM whose GPU is lent does not wait for it (its start fails on the "
        "busy GPU); the systemd unit's ProtectSystem=strict makes /srv/hostagent read-only to "
        "the agent (it may write only under /run/hostagent and /var/lib/hostagent). "
        "Fix: remove hook_socket (default /run/hostagent/hook.sock)."
    ]


def test_a_state_dir_the_hook_cannot_see(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # Inside /var/lib/hostagent: writable, but the hook still spools elsewhere.
    assert check(tmp_path, capsys, 'state_dir = "/var/lib/hostagent/b"\n') == [
        'hostagent: warning: state_dir = "/var/lib/hostagent/b": libvirtd runs the hook with a '
        "scrubbed environment, so the hook cannot follow it: it always spools to "
        "/var/lib/hostagent/spool while the agent is down, and the agent replays "
        "/var/lib/hostagent/b/spool: those events are never replayed. "
        "Fix: remove state_dir (default /var/lib/hostagent)."
    ]
    [warning] = check(tmp_path, capsys, 'state_dir = "/srv/hostagent"\n')
    assert "ProtectSystem=strict makes /srv/hostagent read-only to the agent" in warning


def test_a_control_socket_outside_what_the_unit_lets_the_agent_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert check(tmp_path, capsys, 'control_socket = "/srv/control.sock"\n') == [
        'hostagent: warning: control_socket = "/srv/control.sock": the systemd unit\'s '
        "ProtectSystem=strict makes /srv read-only to the agent (it may write only under "
        "/run/hostagent and /var/lib/hostagent). Fix: remove control_socket (default "
        "/run/hostagent/control.sock), or add ReadWritePaths=/srv to the unit "
        "(systemctl edit hostagent)."
    ]
    assert check(tmp_path, capsys, 'control_socket = "/tmp/control.sock"\n') == [
        'hostagent: warning: control_socket = "/tmp/control.sock": the systemd unit\'s '
        "PrivateTmp=yes gives the agent a /tmp of its own, which no other process sees. "
        "Fix: remove control_socket (default /run/hostagent/control.sock)."
    ]


def test_the_warnings_premise_the_hooks_paths_are_the_defaults() -> None:
    """What the warnings say of the hook: it falls back on the configuration's defaults,
    and the unit writes only where the warnings say."""
    hook = (REPO / "hooks" / "qemu").read_text()
    fields = config.Config.__dataclass_fields__
    assert f'os.environ.get("HOSTAGENT_SOCKET", "{fields["hook_socket"].default}")' in hook
    assert f'os.environ.get("HOSTAGENT_SPOOL", "{fields["state_dir"].default}/spool")' in hook
    unit = (REPO / "systemd" / "hostagent.service").read_text()
    for setting in ("ProtectSystem=strict", "PrivateTmp=yes", "RuntimeDirectory=hostagent",
                    "StateDirectory=hostagent"):
        assert re.search(rf"^{setting}$", unit, re.M), setting
    assert not re.search(r"^ReadWritePaths=", unit, re.M)


def test_every_problem_is_reported_each_with_its_key_and_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file with mistakes in four sections: one run names all four, not the first."""
    path = tmp_path / "config.toml"
    path.write_text(LENDEE + '[gpus.gpu-a]\npci = "01:00"\n'
                    '[owners.gaming1]\ngpus = ["gpu-a"]\nstart_at_boot = "yes"\n'
                    '[policy]\nrelend_dealy = "30s"\n'
                    '[timeouts]\ndrain = 90\n')
    assert cli.main(["--config", str(path), "check-config"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert f'{path}: gpus.gpu-a.pci: "01:00" is not a PCI address; write it as ' \
        'domain:bus:device.function' in err
    assert f"{path}: timeouts.drain: expected a duration string, got an integer; " \
        'write "90s" for seconds' in err
    for key in ("gpus.gpu-a.pci", "owners.gaming1.start_at_boot", "timeouts.drain",
                "policy.relend_dealy"):
        assert sum(f"{path}: {key}: " in line for line in lines) == 1, (key, lines)
    assert lines[-1] == "hostagent: 4 problems in the configuration"


def test_references_across_sections_are_all_reported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-x"]\n'
                    '[gpus.gpu-a]\npci = "0000:01:00.0"\n'
                    '[owners.gaming1]\ngpus = ["gpu-y"]\n'
                    '[owners.gpu-node]\ngpus = ["gpu-a"]\n')
    assert cli.main(["--config", str(path), "check-config"]) == 2
    err = capsys.readouterr().err
    assert f'{path}: lendee.gpus[1]: unknown GPU "gpu-x"; define it' in err
    assert f'{path}: owners.gaming1.gpus[0]: unknown GPU "gpu-y"; define it' in err
    assert f"{path}: owners.gpu-node: gpu-node is the lendee" in err
    assert err.splitlines()[-1] == "hostagent: 3 problems in the configuration"


def test_one_run_names_problems_of_every_kind(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key of the wrong type, a reference to no GPU, and a path the unit cannot write:
    the first run of check-config names all three, not one kind per run."""
    path = tmp_path / "config.toml"
    path.write_text('state_dir = "/srv/hostagent"\n'
                    '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-x"]\n'
                    'min_gpus = "two"\n'
                    '[gpus.gpu-a]\npci = "0000:01:00.0"\n'
                    '[owners.gaming1]\ngpus = ["gpu-y"]\nstart_at_boot = "yes"\n')
    assert cli.main(["--config", str(path), "check-config"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: lendee.min_gpus: expected an integer, got a string" in err
    assert f"{path}: owners.gaming1.start_at_boot: expected true or false" in err
    assert f'{path}: lendee.gpus[1]: unknown GPU "gpu-x"' in err
    assert f'{path}: owners.gaming1.gpus[0]: unknown GPU "gpu-y"' in err
    assert "hostagent: 4 problems in the configuration" in err
    assert 'hostagent: warning: state_dir = "/srv/hostagent": ' in err


def test_a_file_under_a_home_the_unit_hides(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """ProtectHome=tmpfs: the agent sees no home directory but root's .kube."""
    assert check(tmp_path, capsys, '[kubernetes]\nkubeconfig = "/home/ann/.kube/config"\n') == [
        'hostagent: warning: kubernetes.kubeconfig = "/home/ann/.kube/config": the systemd '
        "unit's ProtectHome=tmpfs hides home directories from the agent, all but /root/.kube. "
        "Fix: keep it under /etc/hostagent (or, on NixOS, give it as kubeconfigFile), or add "
        "BindReadOnlyPaths=/home/ann/.kube/config to the unit (systemctl edit hostagent)."
    ]
    [warning] = check(tmp_path, capsys, '[verify.ssh]\nkey = "/root/.ssh/id_ed25519"\n'
                      'host = "gpu-node.lan"\nuser = "hostagent"\n'
                      'known_hosts = "/var/lib/hostagent/known_hosts"\n')
    assert warning.startswith('hostagent: warning: verify.ssh.key = "/root/.ssh/id_ed25519": ')
    assert check(tmp_path, capsys, '[kubernetes]\nkubeconfig = "/root/.kube/config"\n') == []


def test_a_file_root_may_read_only_with_cap_dac_read_search(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The unit keeps no CAP_DAC_READ_SEARCH: root reads another user's file only where
    its mode lets others read it."""
    theirs = tmp_path / "kubeconfig"
    theirs.write_text("apiVersion: v1\n")
    theirs.chmod(0o600)
    if theirs.stat().st_uid == 0:  # run as root: give it to nobody
        os.chown(theirs, 65534, 65534)
    top = f'[kubernetes]\nkubeconfig = "{theirs}"\n'
    assert check(tmp_path, capsys, top) == [
        f'hostagent: warning: kubernetes.kubeconfig = "{theirs}": owned by uid '
        f"{theirs.stat().st_uid}, mode 0600, so root reads it only with CAP_DAC_READ_SEARCH, "
        f"which the systemd unit does not keep. Fix: chown root {theirs}."
    ]
    theirs.chmod(0o644)
    assert check(tmp_path, capsys, top) == []


def test_several_lendees_are_checked_and_named(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[lendees.node-a]\ngpus = ["0000:01:00.0"]\n'
                    '[lendees.node-b]\ngpus = ["0000:02:00.0"]\n')
    assert cli.main(["--config", str(path), "check-config"]) == 0
    assert capsys.readouterr().out == f"{path}: OK (2 GPUs, 0 owners, lendees node-a, node-b)\n"
