"""The Nix files, evaluated as NixOS evaluates them.

`../shared/nixos-eval/` beside the repository (or HOSTAGENT_NIXOS_EVAL) is a NixOS
24.11 tree that nix-instantiate (Debian's nix-bin) evaluates offline, with a store under
a temporary directory and no daemon. tests/packaging/nixos.nix evaluates the module
there in several configurations at once (one NixOS evaluation costs seconds): the
README's example as written, a GPU given by UUID alone, configurations that fire every
assertion, the flake's checks, the option declarations that
test_the_typed_options_are_the_agents_schema compares with hostagent/core/config.py.
Separate evaluations show a wrong type and a misspelled option refused.

What this cannot show: the tree evaluates, it does not build. libvirt, QEMU, systemd
and the Python dependencies are stand-ins there (its README lists them), so whether
nix/package.nix builds (its dependencies present, its import check passing) is not seen
here: tests/unit/test_nix_dependencies.py compares its dependencies with pyproject.toml.
Nor is the build-time check of config.toml run by Nix: test_the_build_checks_the_file
runs the check derivation's own script, with this checkout's `hostagent`, on the
settings the module evaluated to (written as TOML by tomli-w here, by remarshal there).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from hostagent.core import config, config_read
from tests.packaging.units import EXPOSURE, exposure, needs_analyze, stub_root
from tests.packaging.units import settings as unit_settings

REPO = Path(__file__).resolve().parents[2]
NIX = shutil.which("nix-instantiate")
needs_nix = pytest.mark.skipif(
    NIX is None, reason="nix-instantiate is not installed (Debian package nix-bin)"
)
NIXOS_EVAL = Path(os.environ.get("HOSTAGENT_NIXOS_EVAL", REPO.parent / "shared" / "nixos-eval"))
needs_nixos = pytest.mark.skipif(
    NIX is None or not (NIXOS_EVAL / "eval.nix").is_file(),
    reason="nix-instantiate is not installed (Debian package nix-bin)" if NIX is None else
    f"no NixOS tree to evaluate the module in: {NIXOS_EVAL}/eval.nix is absent. Provide "
    "one there, or point HOSTAGENT_NIXOS_EVAL at a directory holding it: a NixOS tree "
    "(24.11) whose eval.nix takes `modules` and returns `sys`, its eval-config.nix "
    "evaluation, as ../shared/nixos-eval/README.md describes",
)
README = REPO / "README.md"


def nix_files() -> list[Path]:
    found = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "node_modules")]
        found += [Path(top) / f for f in files if f.endswith(".nix")]
    return sorted(found)


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


# --- evaluating NixOS -------------------------------------------------------------------


@dataclasses.dataclass
class Nix:
    """nix-instantiate with a store of its own under `root`: no daemon, no network."""

    root: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert NIX is not None
        env = {**os.environ, "NIX_REMOTE": "", "NIX_PATH": "",
               "XDG_CACHE_HOME": str(self.root / "cache")}
        return subprocess.run(
            [NIX, "--store", str(self.root / "store"), "--option", "sandbox", "false",
             "--eval", "--strict", "--json", *args],
            capture_output=True, text=True, timeout=300, check=False, env=env, cwd=self.root,
        )

    def nixos(self, configuration: str) -> subprocess.CompletedProcess[str]:
        """The settings of the module and `configuration` (a Nix expression), as NixOS
        merges and checks them."""
        path = self.root / f"configuration-{len(list(self.root.glob('configuration-*')))}.nix"
        path.write_text(configuration)
        modules = f"[ {REPO / 'nix' / 'module.nix'} {path} ]"
        return self.run(str(NIXOS_EVAL / "eval.nix"), "--arg", "modules", modules,
                        "-A", "sys.config.services.hostagent.settings")


def readme_block() -> str:
    text = README.read_text()
    start = text.index("\n## Installing on NixOS\n")
    end = text.find("\n## ", start + 1)
    found = [b for b in re.findall(r"^```nix\n(.*?)^```", text[start:end], re.S | re.M)
             if "services.hostagent" in b]  # the configuration, not the flake beside it
    assert len(found) == 1, "expected one nix block with services.hostagent under Installing on NixOS"
    return str(found[0])


def checkout(into: Path) -> None:
    """This checkout's files (tracked, or new and not ignored), as a user's clone has them."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, into / name)


@pytest.fixture(scope="module")
def nix(tmp_path_factory: pytest.TempPathFactory) -> Nix:
    return Nix(tmp_path_factory.mktemp("nix"))


@pytest.fixture(scope="module")
def evaluated(nix: Nix) -> dict[str, Any]:
    """tests/packaging/nixos.nix's answer, the README example as written among them: it
    imports ./hostagent/nix/module.nix, a checkout beside it."""
    readme = nix.root / "readme"
    checkout(readme / "hostagent")
    (readme / "configuration.nix").write_text(readme_block())
    out = nix.run(str(REPO / "tests" / "packaging" / "nixos.nix"),
                  "--arg", "nixosEval", str(NIXOS_EVAL / "eval.nix"),
                  "--arg", "readme", str(readme / "configuration.nix"))
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@needs_nixos
def test_the_readme_example_evaluates_as_written(evaluated: dict[str, Any]) -> None:
    readme = evaluated["readme"]
    assert readme["failed"] == [] and readme["warnings"] == []
    # Down to the system itself: every derivation of it instantiates.
    assert re.fullmatch(r"/nix/store/\w{32}-nixos-system-.*\.drv", readme["toplevel"])
    assert "hostagent" in readme["groups"]
    # The file the agent reads is a configuration it takes, conveniences included.
    cfg = config.parse(tomli_w.dumps(readme["config"]))
    assert cfg.kubernetes is not None
    assert cfg.kubernetes.kubeconfig == Path("/run/credentials/hostagent.service/kubeconfig")
    assert cfg.control_group == "hostagent"


@needs_nix
def test_the_flakes_example_is_the_readmes(nix: Nix) -> None:
    readme = nix.root / "readme-example.nix"
    readme.write_text(readme_block())
    out = nix.run("--expr", f'builtins.removeAttrs (import {readme}) [ "imports" ] == '
                            f'import {REPO / "nix" / "example.nix"}')
    assert (out.returncode, out.stdout) == (0, "true"), out.stderr
    assert "imports = [ ./hostagent/nix/module.nix ];" in readme_block()


@needs_nixos
def test_the_flake_checks(evaluated: dict[str, Any]) -> None:
    """What `nix flake check` builds, with nixos-eval standing in for the nixpkgs input:
    the package, and the example's config.toml through the module's check."""
    checks = evaluated["checks"]
    assert checks["names"] == ["example-config", "package"]
    assert re.fullmatch(r"/nix/store/\w{32}-hostagent-[\d.]+\.drv", checks["package"])
    assert checks["example"].endswith("-hostagent-config-checked.toml.drv")
    assert checks["exampleCheck"] == evaluated["readme"]["check"]


@needs_nixos
def test_a_gpu_by_uuid_alone(evaluated: dict[str, Any]) -> None:
    uuid = evaluated["uuid"]
    assert uuid["failed"] == []
    assert uuid["toplevel"].endswith(".drv")
    assert uuid["config"]["gpus"] == {
        "gpu-d": {"uuid": "GPU-5f2ab1c4-0000-4000-8000-000000000004", "functions": []}
    }
    # A key the module does not type passes through to the file.
    assert uuid["config"]["timeouts"] == {"drain": "10m"}
    cfg = config.parse(tomli_w.dumps(uuid["config"]))
    assert cfg.gpus["gpu-d"].pci is None


@needs_nixos
def test_several_lendees_alone(evaluated: dict[str, Any]) -> None:
    """lendees.NAME without lendee: no assertion fires, and the file has no [lendee]
    (its untyped domain "" would be refused), as the agent takes it."""
    two = evaluated["lendees"]
    assert two["failed"] == [] and two["toplevel"].endswith(".drv")
    assert "lendee" not in two["config"]
    cfg = config.parse(tomli_w.dumps(two["config"]))
    assert list(cfg.lendees) == ["gpu-node-a", "gpu-node-b"]
    assert cfg.lendees["gpu-node-b"].node == "k8s-b"


@needs_nixos
def test_the_mqtt_password_is_a_credential(evaluated: dict[str, Any]) -> None:
    """mqttPasswordFile: read by systemd at start (LoadCredential=), never in the store;
    the agent reads it where systemd puts it, and takes the [mqtt] section as written."""
    mqtt = evaluated["mqtt"]
    assert mqtt["failed"] == [] and mqtt["toplevel"].endswith(".drv")
    cfg = config.parse(tomli_w.dumps(mqtt["config"]))
    assert cfg.mqtt is not None
    assert cfg.mqtt.password_file == Path("/run/credentials/hostagent.service/mqtt-password")
    assert (cfg.mqtt.address, cfg.mqtt.username, cfg.mqtt.vms) == (
        ("broker.lan", 8883), "hostagent", ("gaming1",))
    assert "LoadCredential=mqtt-password:/run/secrets/hostagent-mqtt" in mqtt["unit"].splitlines()
    assert "secrets/hostagent-mqtt" not in json.dumps(mqtt["config"])


@needs_nixos
def test_open_firewall_opens_the_ssh_buttons_and_the_metrics_ports(
        evaluated: dict[str, Any]) -> None:
    """The NixOS firewall is on by default: the SSH button and the metrics listened on a
    port nobody could reach. openFirewall opens each that listens beyond loopback."""
    assert evaluated["firewall"]["failed"] == []
    assert sorted(evaluated["firewall"]["ports"]) == [2222, 9477]
    assert evaluated["firewallLoopback"]["ports"] == [2022]
    assert evaluated["readme"]["ports"] == []  # off by default


@needs_nixos
def test_the_package_option_is_mk_package_option(evaluated: dict[str, Any]) -> None:
    package = evaluated["package"]
    assert package["defaultText"] == "pkgs.hostagent"
    assert package["description"].startswith("The hostagent package to use.")
    assert package["type"] == "package"


@needs_nixos
def test_the_readmes_nixos_uninstall_reaches_the_cluster(evaluated: dict[str, Any]) -> None:
    """The unit's kubeconfig is a credential systemd removes once the unit stops: README's
    NixOS uninstall (stop, then unmark-node) gives unmark-node the file the credential
    came from, the README example's kubeconfigFile."""
    unit = evaluated["readme"]["unit"]
    credential = re.search(r"^LoadCredential=kubeconfig:(\S+)$", unit, re.M)
    assert credential is not None, unit
    assert evaluated["readme"]["config"]["kubernetes"]["kubeconfig"].startswith(
        "/run/credentials/")
    text = README.read_text()
    uninstall = text[text.index("\n## Uninstalling\n"):]
    line = next(p for p in uninstall.split("\n\n") if p.startswith("On NixOS"))
    assert (f"systemctl stop hostagent && hostagent unmark-node --kubeconfig "
            f"{credential.group(1)}") in " ".join(line.split()), line


@needs_nixos
def test_every_assertion_fires_with_its_message(evaluated: dict[str, Any]) -> None:
    cases = evaluated["assertions"]
    failed = [m for case in cases.values() for m in case["failed"]]
    defined = {m for case in cases.values() for m in case["all"]}
    assert defined - set(failed) == set(), "an assertion of nix/module.nix never fires here"
    assert sorted(cases["nothing"]["failed"]) == sorted([
        "services.hostagent needs libvirt: set virtualisation.libvirtd.enable = true (the agent drives the VMs through libvirtd, and its hook is installed through virtualisation.libvirtd.hooks.qemu).",
        'services.hostagent.settings.lendee.domain is not set: name the libvirt domain of the Kubernetes worker VM that borrows the GPUs, e.g. lendee.domain = "gpu-node";',
        'services.hostagent.settings.lendee.gpus is empty: list the GPUs the lendee borrows (labels from settings.gpus, or PCI addresses), e.g. lendee.gpus = [ "gpu-a" ];',
        "services.hostagent.kubeconfigFile must be an absolute path outside the Nix store, which anyone on the machine can read: keep the kubeconfig in e.g. /run/secrets or /var/lib/secrets.",
        "services.hostagent.mqttPasswordFile must be an absolute path outside the Nix store, which anyone on the machine can read: keep the password in e.g. /run/secrets or /var/lib/secrets.",
        "services.hostagent.settings.hook_socket must stay /run/hostagent/hook.sock: libvirtd runs the hook with a scrubbed environment, so the hook knows only that path.",
        "services.hostagent.settings.state_dir must stay /var/lib/hostagent: libvirtd runs the hook with a scrubbed environment, so the hook knows only that path.",
    ])
    assert sorted(cases["store"]["failed"]) == [
        'services.hostagent.settings.kubernetes.kubeconfig is a kubeconfig, a credential to the cluster, in the Nix store, which anyone on the machine can read: give the path of a file outside it as a string, e.g. kubernetes.kubeconfig = "/run/secrets/hostagent-kubeconfig"; or better, kubeconfigFile (systemd hands it to the service as a credential) (a path literal such as ./file is copied into the store), and replace the credential, which others may have copied.',
        'services.hostagent.settings.mqtt.password_file is the broker\'s password in the Nix store, which anyone on the machine can read: give the path of a file outside it as a string, e.g. mqtt.password_file = "/run/secrets/mqtt-password"; or better, mqttPasswordFile (systemd hands it to the service as a credential) (a path literal such as ./file is copied into the store), and replace the password, which others may have copied.',
        'services.hostagent.settings.ssh.host_key is a private key in the Nix store, which anyone on the machine can read: give the path of a file outside it as a string, e.g. ssh.host_key = "/var/lib/hostagent/ssh_host_ed25519_key"; (a path literal such as ./file is copied into the store), and replace the key, which others may have copied.',
        'services.hostagent.settings.verify.ssh.key is a private key in the Nix store, which anyone on the machine can read: give the path of a file outside it as a string, e.g. verify.ssh.key = "/var/lib/hostagent/id_ed25519"; (a path literal such as ./file is copied into the store), and replace the key, which others may have copied.',
    ]
    assert sorted(cases["twice"]["failed"]) == sorted([
        # A relative path, this time.
        "services.hostagent.kubeconfigFile must be an absolute path outside the Nix store, which anyone on the machine can read: keep the kubeconfig in e.g. /run/secrets or /var/lib/secrets.",
        "services.hostagent: set kubeconfigFile or settings.kubernetes.kubeconfig, not both.",
        "services.hostagent: set controlSocketGroup or settings.control_group, not both.",
        "services.hostagent: set mqttPasswordFile or settings.mqtt.password_file, not both.",
        'services.hostagent.settings.gpus.gpu-a has neither pci nor uuid: give its PCI address as `lspci -D` shows it, e.g. pci = "0000:01:00.0"; (a GPU bound to vfio-pci needs it), or its uuid if NVML on the host sees it.',
    ])


ENABLED = """{
  virtualisation.libvirtd.enable = true;
  services.hostagent = {
    enable = true;
    settings = { lendee = { domain = "gpu-node"; gpus = GPUS; }; gpus.gpu-a.pci = "0000:01:00.0"; };
    EXTRA
  };
}"""


@needs_nixos
@pytest.mark.parametrize("gpus, extra, message", [
    ('"gpu-a"', "",
     "A definition for option `services.hostagent.settings.lendee.gpus' is not of type "
     "`list of string'"),
    ('[ "gpu-a" ]', 'settings.policy.on_drain_timeout = "procede";',
     "A definition for option `services.hostagent.settings.policy.on_drain_timeout' is not of "
     'type `null or one of "proceed", "abort"\''),
    ('[ "gpu-a" ]', 'kubeconfigFiel = "/run/secrets/kubeconfig";',
     "The option `services.hostagent.kubeconfigFiel' does not exist."),
], ids=["wrong-type", "not-in-the-enum", "misspelled-option"])
def test_a_mistake_is_refused_when_nixos_evaluates(
    nix: Nix, gpus: str, extra: str, message: str
) -> None:
    out = nix.nixos(ENABLED.replace("GPUS", gpus).replace("EXTRA", extra))
    assert out.returncode != 0
    assert message in out.stderr


@needs_nixos
def test_the_build_checks_the_file(evaluated: dict[str, Any], tmp_path: Path) -> None:
    """A typo in a free-form key evaluates; building the system runs the agent's own
    check-config on the file, which refuses it with the agent's message."""

    def build(settings: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
        # As the derivation runs it: its script, under stdenv's shell options, with the
        # package on PATH (here: this checkout's, installed in the running Python's venv).
        toml = tmp_path / f"{name}.toml"
        toml.write_text(tomli_w.dumps(settings))
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
               "configFile": str(toml), "out": str(tmp_path / f"{name}-out")}
        return subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", evaluated["typo"]["check"]],
                              capture_output=True, text=True, timeout=60, env=env,
                              check=False)

    good = build(evaluated["readme"]["config"], "readme")
    assert good.returncode == 0, good.stderr
    assert (tmp_path / "readme-out").resolve() == tmp_path / "readme.toml"

    typo = evaluated["typo"]
    assert typo["failed"] == [] and typo["config"]["policy"] == {"relend_dealy": "1m"}
    bad = build(typo["config"], "typo")
    assert bad.returncode == 1
    assert bad.stderr.splitlines() == [
        f'hostagent: {tmp_path}/typo.toml: policy.relend_dealy: unknown key; did you mean '
        '"relend_delay"?',
        "hostagent refuses services.hostagent.settings: each key named above is under settings "
        "(services.hostagent.checkConfig = false skips this check)",
    ]
    assert not (tmp_path / "typo-out").exists()
    # And the script is the one the module builds /etc/hostagent/config.toml with.
    assert evaluated["readme"]["check"] == typo["check"]


@needs_nixos
def test_the_unit_is_systemd_hostagent_service(evaluated: dict[str, Any]) -> None:
    """Equal in substance: the same settings with the same values, section by section,
    but for the store path of ExecStart= and what NixOS and the README's options add."""
    added_by_nixos = {
        "Unit": {"X-Restart-Triggers"},
        "Service": {"LoadCredential"},  # kubeconfigFile, mqttPasswordFile
        "Install": set(),
    }

    def sections(text: str) -> dict[str, dict[str, list[str]]]:
        parts = re.split(r"^\[(\w+)\]$", text, flags=re.M)
        return {name: unit_settings(body) for name, body in zip(parts[1::2], parts[2::2],
                                                                 strict=True)}

    def words(values: list[str]) -> list[str]:
        found = " ".join(values).replace('"', "").split()
        return sorted({"true": "yes", "false": "no"}.get(w, w) for w in found)

    nixos = sections(evaluated["readme"]["unit"])
    unit = sections((REPO / "systemd" / "hostagent.service").read_text())
    assert nixos.keys() == unit.keys()
    for name, expected in unit.items():
        got = dict(nixos[name])
        assert set(got) - set(expected) == added_by_nixos[name], name
        if name == "Service":
            [exec_start] = got.pop("ExecStart")
            [installed] = expected.pop("ExecStart")
            assert exec_start.split()[0].startswith("/nix/store/")
            assert exec_start.split()[1:] == installed.split()[1:]
            # NixOS sets PATH, LOCALE_ARCHIVE and TZDIR for every service.
            assert set(expected.pop("Environment")) <= set(words(got.pop("Environment")))
            # Where python3, systemctl and the libraries are: the store, not /usr.
            assert got.pop("ExecPaths") == ["/nix/store"]
            assert expected.pop("ExecPaths") == ["/usr /opt/hostagent/"]
        assert {k: words(got[k]) for k in expected} == {
            k: words(v) for k, v in expected.items()}, name


@needs_nixos
@needs_analyze
def test_the_nixos_unit_keeps_exposure_low(evaluated: dict[str, Any], tmp_path: Path) -> None:
    """The unit NixOS renders, as `systemd-analyze security` rates it: no higher than
    systemd/hostagent.service is held to."""
    assert exposure(stub_root(tmp_path, evaluated["readme"]["unit"])) <= EXPOSURE


@needs_nixos
def test_the_hook_is_wired_in_qemu_d(evaluated: dict[str, Any]) -> None:
    """Through /etc, which every activation points at the current package: libvirtd's
    link is made only when libvirtd starts, so after an upgrade a store path there would
    still be the old hook (and a garbage collection would take it away)."""
    readme = evaluated["readme"]
    assert readme["hook"] == "/etc/hostagent/qemu-hook"
    assert re.fullmatch(r"/nix/store/\w{32}-hostagent-[\d.]+/libexec/hostagent/qemu-hook",
                        readme["hookTarget"])
    assert "ln -s --force /etc/hostagent/qemu-hook /var/lib/libvirt/hooks/qemu.d/hostagent\n" \
        in readme["libvirtdConfig"]


# --- the typed options against hostagent/core/config.py -------------------------------------

# Left at their default, these write a value the agent refuses ("" or []): the module's
# assertions name them instead (test_every_assertion_fires_with_its_message).
ASSERTED = {"lendee.domain", "lendee.gpus"}
NIX_KIND = {"str": "string", "enum": "string", "bool": "boolean", "listOf": "array",
            "attrsOf": "table", "submodule": "table"}
SAMPLES: dict[str, object] = {"string": "x", "integer": 1, "boolean": True, "array": ["x"],
                              "table": {}}
INTEGERS = [-1, 0, 1, 2]  # as tests/packaging/nixos.nix probes them
# A configuration to try a value in, where a table of entries is read at its first.
BASE: dict[str, Any] = {
    "lendee": {"domain": "gpu-node", "gpus": ["gpu-a", "gpu-b"]},
    "lendees": {"gpu-node-b": {"gpus": ["gpu-c", "gpu-d"]}},
    "gpus": {"gpu-a": {"pci": "0000:01:00.0"}, "gpu-b": {"pci": "0000:02:00.0"},
             "gpu-c": {"pci": "0000:03:00.0"}, "gpu-d": {"pci": "0000:04:00.0"}},
    "owners": {"gaming1": {"gpus": ["gpu-a"]}},
}


def reads(read: Any, value: object, key: str) -> config_read._Problem | None:
    """The agent's complaint about `value` at `key`, or None if it takes it."""
    try:
        read(value, key)
    except config_read._Problem as p:
        return p
    return None


def takes(read: Any, value: object, key: str) -> bool:
    """Whether the agent takes `value` at `key`, set in BASE (`<name>`: its first entry),
    where bounds that span sections are checked too (lendee.min_gpus against
    lendee.gpus); where BASE cannot hold the key, by the key's reader alone."""
    document = json.loads(json.dumps(BASE))
    table, parts = document, []
    for part in key.split(".")[:-1]:
        if part == "<name>":
            part = next(iter(table), "x")
        parts.append(part)
        table = table.setdefault(part, {})
    table[key.rsplit(".", 1)[-1]] = value
    try:
        config.parse(tomli_w.dumps(document))
    except config.ConfigError as e:
        if e.key == ".".join([*parts, key.rsplit(".", 1)[-1]]):
            return False
        return reads(read, value, key) is None
    return True


def agent_kinds(read: Any, key: str, wrap: Any = lambda v: v, at: str = "") -> set[str]:
    """The TOML kinds the agent's reader takes at `key` (a wrong one is "expected ...")."""
    def refused(p: config_read._Problem | None) -> bool:
        return p is not None and p.key == key + at and p.problem.startswith("expected ")
    return {kind for kind, sample in SAMPLES.items() if not refused(reads(read, wrap(sample),
                                                                          key))}


def nix_kind(option: dict[str, Any], where: str) -> str:
    if "takes" in option:
        return "integer"
    assert option["kind"] in NIX_KIND, f"{where}: extend NIX_KIND for {option['kind']}"
    return NIX_KIND[option["kind"]]


def bare(hint: Any) -> Any:
    """`X | None` -> X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return hint


def compare(options: dict[str, Any], cls: type, prefix: str) -> list[str]:
    """What the module's typed options under `prefix` say that dataclass `cls` does not."""
    fields = {f.name: f for f in dataclasses.fields(cls) if config_read._READ in f.metadata}
    hints = typing.get_type_hints(cls)
    problems = []
    for name, option in options.items():
        key = f"{prefix}.{name}".lstrip(".")
        where = f"services.hostagent.settings.{key}"
        if name not in fields:
            problems.append(f"{where}: typed in the module, unknown to hostagent/core/config.py")
            continue
        f = fields[name]
        read = f.metadata[config_read._READ]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (
            f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[operator]
        hint = bare(hints[name])

        # Optionality.
        if not option["hasDefault"] and not required:
            problems.append(f"{where}: the module requires it, the agent does not")
        elif option["hasDefault"] and option["default"] is None and required:
            problems.append(f"{where}: the module lets it be left out, the agent requires it")
        elif option["hasDefault"] and option["default"] is not None \
                and option["kind"] != "submodule":
            if required and key not in ASSERTED:
                problems.append(f"{where}: the module writes {option['default']!r} by default, "
                                "the agent requires a value: assert on it")
            elif not required:
                p = reads(read, option["default"], key)
                if p is not None or read(option["default"], key) != default:
                    problems.append(f"{where}: the module's default {option['default']!r} is not "
                                    f"the agent's {default!r}")

        # The TOML kind, and what is inside it.
        kinds = agent_kinds(read, key)
        if kinds != {nix_kind(option, where)}:
            problems.append(f"{where}: the module takes {nix_kind(option, where)}, the agent "
                            f"{sorted(kinds)}")
            continue
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [str(m.value) for m in hint]
            if option.get("values") != values:
                problems.append(f"{where}: the module's choices {option.get('values')} are not "
                                f"the agent's {values}")
        elif option["kind"] == "enum":
            problems.append(f"{where}: the module restricts it to {option['values']}, the agent "
                            "has no such choice")
        if "takes" in option:
            agent = [takes(read, v, key) for v in INTEGERS]
            if option["takes"] != agent:
                problems.append(f"{where}: of {INTEGERS} the module takes {option['takes']}, "
                                f"the agent {agent}")
        if option["kind"] == "listOf":
            elem = agent_kinds(read, key, lambda v: [v], "[0]")
            if elem != {nix_kind(option["elem"], where)}:
                problems.append(f"{where}: items are {nix_kind(option['elem'], where)} in the "
                                f"module, {sorted(elem)} for the agent")
        table = option["elem"] if option["kind"] == "attrsOf" else option
        if "options" in table:
            if not table["freeform"]:
                problems.append(f"{where}: not free-form, so new keys of the agent's are refused")
            inner = typing.get_args(hint)[1] if typing.get_origin(hint) is Mapping else hint
            name_part = ".<name>" if option["kind"] == "attrsOf" else ""
            problems += compare(table["options"], inner, key + name_part)

        # A default the description names is the agent's.
        m = re.search(r"the agent's default: `([^`]*)`", option["description"])
        if m:
            said = read(tomllib.loads(f"v = {m.group(1)}")["v"], key)
            if said != default:
                problems.append(f"{where}: the description says the agent's default is "
                                f"{m.group(1)}, it is {default!r}")
    return problems


@needs_nixos
def test_the_typed_options_are_the_agents_schema(evaluated: dict[str, Any]) -> None:
    """Every option the module types agrees with hostagent/core/config.py, read from its
    dataclasses and readers: present, required or not alike, the same TOML type (and
    items, integer bounds, choices), and free-form tables, so a key the module does not
    type passes through to the agent. Keys the module leaves untyped are not compared."""
    settings = evaluated["settings"]
    assert settings["freeform"]
    assert compare(settings["options"], config.Config, "") == []


def test_the_comparison_catches_what_it_should() -> None:
    """compare() is not vacuous: the module as it was (pci required) and other drifts."""
    def option(kind: str, **more: Any) -> dict[str, Any]:
        return {"kind": kind, "nullable": False, "hasDefault": True, "default": None,
                "description": "", **more}

    pci_required = {"gpus": option("attrsOf", default={}, elem=option(
        "submodule", freeform=True, options={"pci": option("str", hasDefault=False)}))}
    assert compare(pci_required, config.Config, "") == [
        "services.hostagent.settings.gpus.<name>.pci: the module requires it, the agent does not"
    ]
    drifts = {
        "lendee": option("submodule", default={}, freeform=False, options={
            "gpus": option("str", default=""),
            "nodes": option("str"),
            "min_gpus": option("int", takes=[False, True, True, True]),  # 0 is not enough
        }),
        "owners": option("attrsOf", default={}, elem=option("submodule", freeform=True, options={
            "gpus": option("listOf", default=[], elem=option("str"))})),
        "policy": option("submodule", default={}, freeform=True, options={
            "on_drain_timeout": option("enum", values=["proceed"]),
            "partial": option("str"),
            "relend_delay": option("str", description="(the agent's default: `\"1m\"`)"),
        }),
        "verify": option("submodule", default={}, freeform=True, options={
            "ssh": option("submodule", freeform=True, options={
                "port": option("int", takes=[True] * len(INTEGERS))})}),
    }
    assert compare(drifts, config.Config, "") == [
        "services.hostagent.settings.lendee: not free-form, so new keys of the agent's are refused",
        "services.hostagent.settings.lendee.gpus: the module takes string, the agent ['array']",
        "services.hostagent.settings.lendee.nodes: typed in the module, unknown to hostagent/core/config.py",
        "services.hostagent.settings.lendee.min_gpus: of [-1, 0, 1, 2] the module takes [False, True, True, True], the agent [False, False, True, True]",
        "services.hostagent.settings.owners.<name>.gpus: the module writes [] by default, the agent requires a value: assert on it",
        "services.hostagent.settings.policy.on_drain_timeout: the module's choices ['proceed'] are not the agent's ['proceed', 'abort']",
        "services.hostagent.settings.policy.partial: the module takes string, the agent ['boolean']",
        "services.hostagent.settings.policy.relend_delay: the description says the agent's default is \"1m\", it is 30.0",
        "services.hostagent.settings.verify.ssh.port: of [-1, 0, 1, 2] the module takes [True, True, True, True], the agent [False, False, True, True]",
    ]
