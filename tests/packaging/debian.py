"""The Debian packages make installs (test_services.py, test_programs.py): the Makefile's
lists of them, and whether one is on every Debian before ours come."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
DPKG_INFO = Path("/var/lib/dpkg/info")


def makefile_list(name: str) -> set[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(rf"^{name}\s*:=(.*)$", text, re.M)
    assert m, f"the Makefile sets {name}"
    return {w for w in m[1].split() if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w)}


def essential(package: str) -> bool:
    """Essential or required packages are on every Debian 12 before ours come."""
    out = subprocess.run(["dpkg-query", "-W", "-f=${Essential} ${Priority}", package],
                         capture_output=True, text=True).stdout
    return out.startswith("yes") or out.endswith("required")
