"""hostagent's systemd unit, as systemd reads it (test_unit_file.py, test_nix.py): its
settings, a root with it installed, and what `systemd-analyze security` says of it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "hostagent.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (Debian package systemd)"
)


def settings(text: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit, by key, in order (comments and sections dropped)."""
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key, []).append(value)
    return found


def stub_root(tmp_path: Path, unit_text: str) -> Path:
    root = tmp_path / "root"
    units = root / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    (units / "hostagent.service").write_text(unit_text)
    # The default dependencies of a service; the agent's own Wants= may be absent.
    vendor = root / "usr" / "lib" / "systemd" / "system"
    vendor.mkdir(parents=True)
    for target in ("sysinit", "basic", "shutdown", "multi-user", "network-online"):
        (vendor / f"{target}.target").write_text("[Unit]\nDescription=stub\n")
    for command in settings(unit_text)["ExecStart"]:
        executable = root / command.split()[0].lstrip("/")
        executable.parent.mkdir(parents=True, exist_ok=True)
        executable.write_text("#!/bin/sh\nexit 0\n")
        executable.chmod(0o755)
    return root


# `systemd-analyze security`'s exposure of the unit, and of the NixOS module's
# (test_nix.py): a change that raises it fails here. Lower it with the change that
# earned it, never raise it to let a change in.
EXPOSURE = 2.0


def exposure(root: Path) -> float:
    """The overall exposure `systemd-analyze security --offline=true` gives the unit
    under `root`; skips where this systemd-analyze has no offline review."""
    out = analyze(root, "security", "--offline=true", "--threshold=100")
    if "--offline" in out.stderr and "unrecognized" in out.stderr:
        pytest.skip("this systemd-analyze has no offline security review (systemd < 250)")
    level = re.search(r"Overall exposure level for hostagent\.service: ([\d.]+)", out.stdout)
    assert level is not None, out.stdout + out.stderr
    return float(level.group(1))


def analyze(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, *args, f"--root={root}", "hostagent.service"],
        capture_output=True, text=True, timeout=60, check=False,
    )
