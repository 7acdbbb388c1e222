"""The README's installation examples are configurations the agent takes.

The Debian section's TOML goes through the agent's own loader; the NixOS section's
`services.hostagent` is evaluated by Nix (it uses neither lib nor pkgs) and must be the
same configuration, once the module's two conveniences are spelled as TOML keys.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from hostagent import config

README = Path(__file__).resolve().parents[2] / "README.md"
NIX = shutil.which("nix-instantiate")


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def block(title: str, language: str) -> str:
    found = re.findall(rf"^```{language}\n(.*?)^```", section(title), re.S | re.M)
    assert len(found) == 1, f"expected one {language} block under {title!r}"
    return str(found[0])


def toml_example() -> dict[str, Any]:
    return tomllib.loads(block("Installing on Debian", "toml"))


def test_the_debian_example_is_a_valid_config() -> None:
    cfg = config.parse(block("Installing on Debian", "toml"), "README.md")
    assert cfg.lendee.domain == "gpu-node"
    assert set(cfg.owners) == {"gaming1", "gaming2"}
    assert cfg.kubernetes is not None and cfg.control_group == "hostagent"


def test_the_readme_shows_how_to_follow_the_agent() -> None:
    nixos = section("Installing on NixOS")
    assert "journalctl -u hostagent -f" in nixos
    assert "journalctl -u hostagent HOSTAGENT_VM=gaming1" in nixos
    debian = section("Installing on Debian")
    assert "make install" in debian and "systemctl restart libvirtd" in debian


@pytest.mark.skipif(NIX is None, reason="nix-instantiate is not installed (Debian package nix-bin)")
def test_the_nixos_example_is_the_same_configuration(tmp_path: Path) -> None:
    example = tmp_path / "configuration.nix"
    example.write_text(block("Installing on NixOS", "nix"))
    assert NIX is not None
    out = subprocess.run(
        [NIX, "--eval", "--strict", "--json", "--expr",
         # Only this attribute is read: `imports` and the rest are never evaluated.
         f"(import {example}).services.hostagent"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert out.returncode == 0, out.stderr
    hostagent = json.loads(out.stdout)
    assert hostagent["enable"] is True
    # The module's conveniences, as the TOML file spells them.
    settings = hostagent["settings"]
    settings["control_group"] = hostagent["controlSocketGroup"]
    expected = toml_example()
    # kubeconfigFile reaches the agent as kubernetes.kubeconfig (through systemd's
    # credentials, so the path differs); both examples name one.
    assert expected["kubernetes"].pop("kubeconfig").startswith("/")
    assert hostagent["kubeconfigFile"].startswith("/")
    assert settings == expected
    config.parse(tomli_w.dumps(settings))
