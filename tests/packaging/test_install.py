"""`make install` and `make uninstall`, staged under DESTDIR: the machine is never touched.

Runtime dependencies are left out (PIP_INSTALL_FLAGS=--no-deps: building libvirt-python
takes minutes); the package itself is built and installed for real, which needs pip's
usual index for setuptools, as `make test` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hostagent.core import config

REPO = Path(__file__).resolve().parents[2]
PREFIX = "/opt/hostagent"
HOOK_PYTHON = "/usr/bin/python3"


@dataclass
class Staged:
    root: Path  # DESTDIR
    env: dict[str, str]
    calls: Path  # what the stub systemctl was asked, if anything

    def path(self, installed: str) -> Path:
        return self.root / installed.lstrip("/")

    def make(self, target: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["make", "--no-print-directory", "-C", str(REPO), target,
             f"DESTDIR={self.root}", "PIP_INSTALL_FLAGS=--no-deps"],
            env=self.env, capture_output=True, text=True, timeout=300, check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return out


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Staged]:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    if not Path(HOOK_PYTHON).exists():
        pytest.skip(f"no {HOOK_PYTHON}: make install builds its venv from it")
    base = tmp_path_factory.mktemp("install")
    # A systemctl that only records: with DESTDIR set, make must never call it.
    stubs = base / "stubs"
    stubs.mkdir()
    calls = base / "systemctl-calls"
    (stubs / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (stubs / "systemctl").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["PATH"] = f"{stubs}:{env.get('PATH', '/usr/bin:/bin')}"
    s = Staged(root=base / "destdir", env=env, calls=calls)
    s.make("install")
    yield s


def test_the_hook_is_executable_with_a_pinned_interpreter(staged: Staged) -> None:
    hook = staged.path("/etc/libvirt/hooks/qemu.d/hostagent")
    assert hook.is_file() and not hook.is_symlink()
    assert os.access(hook, os.X_OK)
    first, _, rest = hook.read_text().partition("\n")
    assert first == f"#!{HOOK_PYTHON} -IS"
    # The repository's hook otherwise, byte for byte.
    assert rest == (REPO / "hooks" / "qemu").read_text().partition("\n")[2]


def test_the_installed_hook_runs_through_its_shebang_with_libvirts_path(
    staged: Staged, tmp_path: Path
) -> None:
    """No agent listening: the hook spools the event and lets libvirt go on."""
    spool = tmp_path / "spool"
    run = subprocess.run(
        [str(staged.path("/etc/libvirt/hooks/qemu.d/hostagent")),
         "gaming1", "prepare", "begin", "-"],
        input=b"<domain><name>gaming1</name></domain>\n",
        env={"PATH": "/usr/bin:/bin",  # libvirt's fixed, short PATH
             "HOSTAGENT_SOCKET": str(tmp_path / "absent.sock"),
             "HOSTAGENT_SPOOL": str(spool)},
        capture_output=True, timeout=30, check=False,
    )
    assert (run.returncode, run.stdout) == (0, b""), run.stderr
    spooled = list(spool.glob("*.json"))
    assert len(spooled) == 1
    assert json.loads(spooled[0].read_text())["domain"] == "gaming1"


def test_the_unit_points_at_the_venv(staged: Staged) -> None:
    unit = staged.path("/etc/systemd/system/hostagent.service").read_text()
    assert unit == (REPO / "systemd" / "hostagent.service").read_text()
    exe = staged.path(f"{PREFIX}/bin/hostagent")
    assert os.access(exe, os.X_OK)
    link = staged.path("/usr/local/bin/hostagent")
    assert os.readlink(link) == f"{PREFIX}/bin/hostagent"


def test_the_venv_names_its_final_path_not_the_staging_one(staged: Staged) -> None:
    assert staged.path(f"{PREFIX}/bin/hostagent").read_text().startswith(
        f"#!{PREFIX}/bin/python"
    )
    venv = staged.path(PREFIX)
    leaks = [
        str(p.relative_to(venv))
        for p in [*venv.joinpath("bin").iterdir(), venv / "pyvenv.cfg"]
        if p.is_file() and not p.is_symlink() and str(staged.root) in p.read_text(errors="replace")
    ]
    assert leaks == []


def test_the_example_config_parses_with_the_installed_package(staged: Staged) -> None:
    example = staged.path("/etc/hostagent/config.example.toml")
    assert example.read_text() == (REPO / "examples" / "config.toml").read_text()
    # Never written by make: `hostagent config init` writes the first one.
    assert not staged.path("/etc/hostagent/config.toml").exists()
    assert config.load(example).lendee.domain == "gpu-node"
    # The installed package itself reads it (its python finds the staged venv by its
    # own location).
    check = subprocess.run(
        [str(staged.path(f"{PREFIX}/bin/python")), "-c",
         "import sys; from hostagent.cli import main; sys.exit(main(sys.argv[1:]))",
         "--config", str(example), "check-config"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert check.returncode == 0, check.stderr
    assert "OK (3 GPUs, 3 owners, lendee gpu-node)" in check.stdout
    assert str(staged.root) in check.stdout  # it was the staged file that was read


def test_the_output_says_what_to_do_next(staged: Staged) -> None:
    out = staged.make("install").stdout
    assert "hostagent config init" in out
    # Edited and checked (every problem, then the VMs' XML) before the service starts.
    assert out.index("edit it") < out.index("hostagent check-config && hostagent lint") \
        < out.index("lendee's prerequisites") < out.index("systemctl enable --now hostagent")
    assert "systemctl restart libvirtd" in out and "first hook" in out


# Last: it uninstalls what the tests above look at.
def test_reinstall_keeps_the_config_then_uninstall_keeps_it_too(staged: Staged) -> None:
    conf = staged.path("/etc/hostagent/config.toml")
    mine = (REPO / "examples" / "config.toml").read_text().replace(
        'domain = "gpu-node"', 'domain = "k3s-worker"')
    conf.write_text(mine)
    out = staged.make("install").stdout
    assert conf.read_text() == mine
    assert "config.toml is kept as it was" in out

    staged.make("uninstall")
    assert conf.read_text() == mine
    for gone in ("/etc/libvirt/hooks/qemu.d/hostagent", "/etc/systemd/system/hostagent.service",
                 "/etc/hostagent/config.example.toml", "/usr/local/bin/hostagent", PREFIX):
        assert not os.path.lexists(staged.path(gone)), gone
    # With DESTDIR set, make left this machine's systemd alone.
    assert not staged.calls.exists(), staged.calls.read_text()
