"""The Nix files: they parse, the module's own logic evaluates, and (given a nixpkgs
tree in HOSTAGENT_NIXPKGS) a NixOS configuration that imports the module renders the
unit, the hook and the assertions we expect.

nix-instantiate comes from Debian's nix-bin (in the Makefile's APT_PACKAGES); it
evaluates without a Nix store or daemon as long as nothing is built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from hostagent import config
from tests.packaging.test_unit_file import settings as unit_settings

REPO = Path(__file__).resolve().parents[2]
NIX = shutil.which("nix-instantiate")
needs_nix = pytest.mark.skipif(
    NIX is None, reason="nix-instantiate is not installed (Debian package nix-bin)"
)
NIXPKGS = os.environ.get("HOSTAGENT_NIXPKGS", "")


def nix_files() -> list[Path]:
    found = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "node_modules")]
        found += [Path(top) / f for f in files if f.endswith(".nix")]
    return sorted(found)


def nix_eval(expr: str, *, timeout: float = 60) -> Any:
    assert NIX is not None
    out = subprocess.run(
        [NIX, "--eval", "--strict", "--json", "--expr", expr],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_nix_files_are_where_the_readme_says() -> None:
    names = {str(p.relative_to(REPO)) for p in nix_files()}
    assert {"flake.nix", "nix/module.nix", "nix/package.nix"} <= names


@needs_nix
@pytest.mark.parametrize("path", nix_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_parses(path: Path) -> None:
    assert NIX is not None
    out = subprocess.run([NIX, "--parse", str(path)], capture_output=True, text=True,
                         timeout=30, check=False)
    assert out.returncode == 0, out.stderr


# A stand-in for nixpkgs' lib and pkgs: just enough to evaluate the module's own
# expressions (assertions, hook path, service settings, the kubeconfig credential)
# where no nixpkgs tree is at hand. It knows nothing of option merging: the real check
# is test_nixos_configuration below. Extend it when the module uses more of lib.
STAND_IN = """
let
  lib = rec {
    mkOption = a: a;
    mkEnableOption = d: { description = d; };
    literalExpression = t: t;
    mkIf = c: v: if c then v else { };
    optional = c: v: if c then [ v ] else [ ];
    optionalAttrs = c: a: if c then a else { };
    hasPrefix = p: s: builtins.substring 0 (builtins.stringLength p) s == p;
    mapAttrsToList = f: a: map (n: f n a.${n}) (builtins.attrNames a);
    filterAttrsRecursive = pred: s: s;
    recursiveUpdate = a: b: a // builtins.mapAttrs (n: v:
      if builtins.isAttrs v && builtins.isAttrs (a.${n} or null)
      then recursiveUpdate a.${n} v else v) b;
    getExe = p: "${p}/bin/${p.meta.mainProgram}";
    types = {
      str = "str"; package = "package";
      nullOr = t: { inherit t; }; listOf = t: { inherit t; }; attrsOf = t: { inherit t; };
      enum = l: { inherit l; }; submodule = m: { inherit m; };
    };
  };
  pkgs = {
    formats.toml = { }: { type = "toml"; generate = name: builtins.toJSON; };
  };
  package = {
    outPath = "/nix/store/00000000000000000000000000000000-hostagent";
    meta.mainProgram = "hostagent";
  };
  evalModule = hostagent: libvirtd:
    (import MODULE {
      inherit lib pkgs;
      config = {
        services.hostagent = { enable = true; inherit package; } // hostagent;
        virtualisation.libvirtd.enable = libvirtd;
      };
    }).config;
  failed = c: map (a: a.message) (builtins.filter (a: !a.assertion) c.assertions);
  settings = {
    lendee = { domain = "gpu-node"; gpus = [ "gpu-a" ]; };
    gpus.gpu-a = { pci = "0000:01:00.0"; functions = [ "0000:01:00.1" ]; };
    owners.gaming1.gpus = [ "gpu-a" ];
  };
  good = evalModule {
    inherit settings;
    kubeconfigFile = "/run/secrets/kubeconfig";
    controlSocketGroup = "hostagent";
  } true;
  bad = evalModule {
    settings = { lendee = { domain = ""; gpus = [ ]; }; hook_socket = "/tmp/h.sock"; };
    kubeconfigFile = "/nix/store/00000000000000000000000000000000-kubeconfig";
    controlSocketGroup = null;
  } false;
in {
  good = {
    failed = failed good;
    hook = good.virtualisation.libvirtd.hooks.qemu.hostagent;
    service = good.systemd.services.hostagent;
    config = builtins.fromJSON good.environment.etc."hostagent/config.toml".source;
    groups = good.users.groups;
  };
  bad = {
    failed = failed bad;
    config = builtins.fromJSON bad.environment.etc."hostagent/config.toml".source;
  };
}
"""


@needs_nix
def test_the_module_logic_with_a_stand_in_lib() -> None:
    result = nix_eval(STAND_IN.replace("MODULE", str(REPO / "nix" / "module.nix")))
    good, bad = result["good"], result["bad"]
    assert good["failed"] == []
    assert good["hook"] == (
        "/nix/store/00000000000000000000000000000000-hostagent/libexec/hostagent/qemu-hook"
    )
    service = good["service"]["serviceConfig"]
    assert service["ExecStart"] == (
        "/nix/store/00000000000000000000000000000000-hostagent/bin/hostagent"
        " --config /etc/hostagent/config.toml run"
    )
    assert service["LoadCredential"] == ["kubeconfig:/run/secrets/kubeconfig"]
    assert good["groups"] == {"hostagent": {}}
    # The agent reads the kubeconfig where systemd put it, never from the store.
    assert good["config"]["kubernetes"] == {
        "kubeconfig": "/run/credentials/hostagent.service/kubeconfig"
    }
    assert good["config"]["control_group"] == "hostagent"
    config.parse(tomli_w.dumps(good["config"]))

    assert "control_group" not in bad["config"]
    failed = "\n".join(bad["failed"])
    assert "virtualisation.libvirtd.enable = true" in failed
    assert "settings.lendee.domain is not set" in failed
    assert "settings.lendee.gpus is empty" in failed
    assert "kubeconfigFile must be an absolute path outside the Nix store" in failed
    assert "settings.hook_socket must stay /run/hostagent/hook.sock" in failed


@needs_nix
def test_the_module_service_matches_the_unit_file() -> None:
    """Same properties in both: every [Service] setting of systemd/hostagent.service
    is in the module's serviceConfig with the same value (ExecStart aside)."""
    result = nix_eval(STAND_IN.replace("MODULE", str(REPO / "nix" / "module.nix")))
    service = result["good"]["service"]
    nixos = {k: v for k, v in service["serviceConfig"].items()
             if k not in ("ExecStart", "LoadCredential")}
    unit = (REPO / "systemd" / "hostagent.service").read_text()
    service_section = unit.split("[Service]")[1].split("[Install]")[0]
    expected = unit_settings(service_section)
    assert expected.pop("Environment") == ["PYTHONFAULTHANDLER=1"]
    assert service["environment"] == {"PYTHONFAULTHANDLER": "1"}
    del expected["ExecStart"]

    def normal(value: Any) -> list[str]:
        values = value if isinstance(value, list) else [value]
        words = " ".join("yes" if v is True else "no" if v is False else str(v) for v in values)
        return words.split()

    assert {k: normal(v) for k, v in nixos.items()} == {
        k: normal(v) for k, v in expected.items()
    }
    unit_section = unit_settings(unit.split("[Unit]")[1].split("[Service]")[0])
    assert set(service["after"]) == set(" ".join(unit_section["After"]).split())
    assert set(service["wants"]) == set(" ".join(unit_section["Wants"]).split())


# --- with a real nixpkgs ----------------------------------------------------------------

NIXOS = """
let
  nixpkgs = NIXPKGS;
  machine = { libvirtd, hostagent }: import (nixpkgs + "/nixos/lib/eval-config.nix") {
    system = "x86_64-linux";
    modules = [
      MODULE
      {
        boot.loader.grub.enable = false;
        fileSystems."/".device = "/dev/null";
        system.stateVersion = "24.11";
        virtualisation.libvirtd.enable = libvirtd;
        services.hostagent = { enable = true; } // hostagent;
      }
    ];
  };
  failed = c: map (a: a.message) (builtins.filter (a: !a.assertion) c.config.assertions);
  good = machine {
    libvirtd = true;
    hostagent = {
      settings = SETTINGS;
      kubeconfigFile = "/run/secrets/hostagent-kubeconfig";
      controlSocketGroup = "hostagent";
    };
  };
  bad = machine { libvirtd = false; hostagent = { }; };
in {
  good = {
    failed = failed good;
    settings = good.config.services.hostagent.settings;
    hook = good.config.virtualisation.libvirtd.hooks.qemu.hostagent;
    unit = good.config.systemd.units."hostagent.service".text;
    etc = good.config.environment.etc."hostagent/config.toml".enable;
    group = good.config.users.groups ? hostagent;
  };
  bad.failed = failed bad;
}
"""


@needs_nix
@pytest.mark.skipif(
    not NIXPKGS,
    reason="set HOSTAGENT_NIXPKGS to a nixpkgs tree to evaluate the module in a NixOS "
    "configuration (none here: nixpkgs is not installable from the registries this "
    "project reaches)",
)
def test_nixos_configuration() -> None:
    settings = tomllib.loads((REPO / "examples" / "config.toml").read_text())
    expr = (NIXOS.replace("NIXPKGS", json.dumps(str(Path(NIXPKGS).resolve())))
            .replace("MODULE", str(REPO / "nix" / "module.nix"))
            .replace("SETTINGS", f"builtins.fromJSON {json.dumps(json.dumps(settings))}"))
    result = nix_eval(expr, timeout=600)
    good, bad = result["good"], result["bad"]

    assert good["failed"] == []
    # The settings, as the module typed and filtered them, are a config the agent takes.
    config.parse(tomli_w.dumps(good["settings"]))
    assert good["hook"].endswith("/libexec/hostagent/qemu-hook")
    assert good["hook"].startswith("/nix/store/")
    assert good["etc"] is True and good["group"] is True

    unit = unit_settings(good["unit"])
    assert unit["Type"] == ["notify"]
    assert unit["WatchdogSec"] == ["30s"]
    assert unit["ExecStart"][0].endswith(" --config /etc/hostagent/config.toml run")
    assert unit["LoadCredential"] == ["kubeconfig:/run/secrets/hostagent-kubeconfig"]
    assert unit["ProtectSystem"] == ["strict"]
    assert "libvirtd.service" in " ".join(unit["After"]).split()
    assert "libvirtd.service" in " ".join(unit["Wants"]).split()

    failed = "\n".join(bad["failed"])
    assert "virtualisation.libvirtd.enable = true" in failed
    assert "settings.lendee.domain is not set" in failed
    assert "settings.lendee.gpus is empty" in failed
