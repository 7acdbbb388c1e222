"""Every program the tests run comes from a package `make setup` installs, or the tests
that need it skip with their reason: on a fresh Debian 12, `make test` runs the MQTT lab
tests (it did not: mosquitto_sub and mosquitto_pub, of mosquitto-clients, were missing).

PROGRAMS declares each program and its Debian package (or why it needs none); the tests
are read for the programs they run (subprocess, asyncio's subprocesses, shutil.which,
the lab's nsenter and spawn), and each must be declared; each package must be one of
the Makefile's APT_PACKAGES (or essential or required: on every Debian 12), and `dpkg -S`
must say the program is that package's.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.packaging.debian import essential, makefile_list

REPO = Path(__file__).resolve().parents[2]

# program -> the Debian packages that may provide it (a tuple), or why none needs to be
# installed by make setup (a string: the tests that need it skip saying so).
PROGRAMS: dict[str, tuple[str, ...] | str] = {
    "bash": ("bash",), "sh": ("dash",), "/bin/sh": ("dash",), "umount": ("mount",),
    "setpriv": ("util-linux",), "unshare": ("util-linux",), "nsenter": ("util-linux",),
    "journalctl": ("systemd",), "systemd-journald": ("systemd",),
    "systemd-analyze": ("systemd",), "dpkg-query": ("dpkg",), "dpkg": ("dpkg",), "cpio": ("cpio",),
    "ssh-keygen": ("openssh-client",), "sftp": ("openssh-client",),
    "virsh": ("libvirt-clients",), "libvirtd": ("libvirt-daemon",),
    "qemu-system-x86_64": ("qemu-system-x86",),
    "mosquitto": ("mosquitto",), "mosquitto_passwd": ("mosquitto",),
    "mosquitto_sub": ("mosquitto-clients",), "mosquitto_pub": ("mosquitto-clients",),
    "nix-instantiate": ("nix-bin",),
    "/usr/bin/python3": ("python3-minimal",),  # python3-venv's dependency
    "git": "what the clone was made with; tests that compare commits skip without it",
    "iptables": "only looked for: where it is installed the lab keeps the stand-in kubelet, "
                "which changes no host table (tests/controlplane/realkubelet.py missing)",
    "ip6tables": "only looked for, as iptables: the real kubelet would change the host's "
                 "tables, so its presence keeps the stand-in",
    "make": "what runs make test; tests/packaging/test_install.py skips without it",
    "go": ("Go, from go.dev, builds the lab's Kubernetes once per release "
           "(tests/controlplane skips saying so when neither Go nor the cached build is "
           "there)"),
    "hass": ("Home Assistant, in a venv of its own that make test installs once "
             "(tests/integration/hass.sh, HOSTAGENT_HASS) with a Python 3.13 the machine "
             "has: tests/integration/test_home_assistant.py skips saying so without one"),
}
# Packages the declared ones come with, as dependencies of APT_PACKAGES.
DEPENDENCIES = {"python3-minimal": "python3-venv"}

RUNNERS = {("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "check_output"),
           ("subprocess", "check_call"), ("subprocess", "call"), ("shutil", "which"),
           ("asyncio", "create_subprocess_exec")}
LAB_RUNNERS = {"nsenter", "spawn"}


def programs_run() -> dict[str, set[str]]:
    """Program -> the test files that run it, read from their calls."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            ours = isinstance(owner, ast.Name) and (owner.id, node.func.attr) in RUNNERS
            if not (ours or node.func.attr in LAB_RUNNERS):
                continue
            args = list(node.args)
            if node.func.attr == "spawn" and len(args) > 1:
                args = args[1:]  # spawn(name, argv)
            if not args:
                continue
            first = args[0]
            if isinstance(first, (ast.List, ast.Tuple)) and first.elts:
                first = first.elts[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
                word = first.value.split()[0]
                if not word.startswith("-"):
                    found.setdefault(word, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_program_the_tests_run_is_declared() -> None:
    found = programs_run()
    assert {"mosquitto_sub", "mosquitto_pub", "virsh", "cpio"} <= set(found), found
    undeclared = {p: sorted(f) for p, f in found.items() if p not in PROGRAMS}
    assert not undeclared, f"programs run by the tests that PROGRAMS does not name: {undeclared}"


def test_every_declared_package_is_installed_by_make_setup() -> None:
    apt = makefile_list("APT_PACKAGES")
    missing = {}
    for program, packages in PROGRAMS.items():
        if isinstance(packages, str):
            assert len(packages) > 20, f"{program}: say why no package is needed"
            continue
        wanted = {DEPENDENCIES.get(p, p) for p in packages}
        if not wanted & apt and not any(essential(p) for p in packages
                                        if shutil.which("dpkg-query")):
            missing[program] = packages
    assert not missing, f"no package of APT_PACKAGES provides these: {missing}"


def _candidates(program: str) -> list[str]:
    """The paths dpkg may list the program under (merged /usr: /bin is /usr/bin)."""
    if program.startswith("/"):
        paths = [program]
    else:
        found = shutil.which(program) or shutil.which(
            program, path="/usr/sbin:/sbin:/lib/systemd:/usr/lib/systemd")
        if found is None:
            return []
        paths = [found]
    out = []
    for p in paths:
        name = os.path.basename(p)
        real = os.path.realpath(p)
        out += [p, real, *(f"{d}/{name}" for d in ("/bin", "/sbin", "/usr/bin", "/usr/sbin",
                                                    "/lib/systemd", "/usr/lib/systemd"))]
    return list(dict.fromkeys(out))


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="not a Debian machine: no dpkg")
def test_each_program_is_its_declared_packages() -> None:
    declared = {program: (packages, _candidates(program))
                for program, packages in PROGRAMS.items() if not isinstance(packages, str)}
    # One dpkg for every path (each run reads the whole database: one per path took
    # seconds); it lists what owns each path it finds, and says nothing of the others
    # but that they are not found (its status is then 1).
    paths = sorted({path for _, candidates in declared.values() for path in candidates})
    out = subprocess.run(["dpkg", "-S", *paths], capture_output=True, text=True,
                         timeout=60) if paths else None
    assert out is None or out.returncode in (0, 1), out.stderr
    lines = [line.rstrip() for line in out.stdout.splitlines()] if out is not None else []
    wrong = {}
    for program, (packages, candidates) in declared.items():
        owners: set[str] = set()
        for path in candidates:
            owners |= {line.split(":")[0] for line in lines if line.endswith(": " + path)}
        if owners and not owners & set(packages):
            wrong[program] = (packages, ", ".join(sorted(owners)))
        elif not owners:
            wrong[program] = (packages, "not installed here")
    assert not wrong, f"program: (declared, what dpkg says): {wrong}"
