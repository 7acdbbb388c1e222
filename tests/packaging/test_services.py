"""The Debian packages `make setup` installs leave the machine's services as they were.

A package whose maintainer script enables and starts a service of the machine's own
(Debian's mosquitto starts its broker when installed) must be in the Makefile's
APT_SERVICES, whose services the install step stops and disables again when it is what
brought them: the lab runs private instances, and nothing of ours listens on the
machine's ports after `make test`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from tests.packaging.debian import (
    DPKG_INFO,
    essential,
    makefile_list,
)

REPO = Path(__file__).resolve().parents[2]


def enabled_services(package: str) -> set[str]:
    """The .service units the package's postinst enables (deb-systemd-helper enable)."""
    for name in (f"{package}.postinst", f"{package}:amd64.postinst"):
        script = DPKG_INFO / name
        if script.exists():
            return set(re.findall(r"deb-systemd-helper enable '([^']+)\.service'",
                                  script.read_text(errors="replace")))
    return set()


@pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian machine: no dpkg")
def test_every_package_that_starts_a_service_has_it_stopped_again() -> None:
    packages = makefile_list("APT_PACKAGES")
    kept_off = makefile_list("APT_SERVICES")
    installed = [p for p in sorted(packages) if DPKG_INFO.joinpath(f"{p}.list").exists()
                 or DPKG_INFO.joinpath(f"{p}:amd64.list").exists()]
    assert "mosquitto" in installed, "make setup ran: its packages are installed"
    starting = {p for p in installed if enabled_services(p) and not essential(p)}
    assert "mosquitto" in starting  # what the test is about, seen on this machine
    assert starting <= kept_off, f"these start a service when installed: {starting - kept_off}"
    recipe = (REPO / "Makefile").read_text()
    assert "systemctl disable --now $$p.service" in recipe
