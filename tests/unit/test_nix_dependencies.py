"""nix/package.nix depends on exactly what pyproject.toml requires.

nixpkgs checks a Python package's runtime dependencies when it builds it, and the
package's import check imports `hostagent.service.agent`: a dependency pyproject.toml names and
package.nix lacks stops `nixos-rebuild` before the service exists (prometheus-client
once did). Neither check runs here (nothing is built), so the two lists are compared as
text.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# pyproject.toml's name -> the python3Packages attributes that provide it (any one).
# Names that nixpkgs spells as PyPI does need no entry.
NIXPKGS_NAMES: dict[str, set[str]] = {
    "libvirt-python": {"libvirt"},
    # nixpkgs renamed `systemd` to `systemd-python`; package.nix takes either.
    "systemd-python": {"systemd-python", "systemd"},
}


def requirement_name(requirement: str) -> str:
    """`prometheus-client>=0.17` -> `prometheus-client` (PEP 503 normalised)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m is not None, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def pyproject_dependencies(text: str) -> set[str]:
    return {requirement_name(r) for r in tomllib.loads(text)["project"]["dependencies"]}


def nix_list(text: str, attribute: str) -> str:
    """The text of the list `attribute = [ ... ];` in a Nix file, comments removed."""
    text = re.sub(r"#[^\n]*", "", text)
    m = re.search(rf"^\s*{attribute}\s*=\s*\[(.*?)\];", text, re.S | re.M)
    assert m is not None, f"no `{attribute} = [ ... ];` in nix/package.nix"
    return m.group(1)


def package_attributes(text: str, attribute: str = "dependencies") -> set[str]:
    """The python3Packages attributes named in package.nix's list `attribute`."""
    return set(re.findall(r"python3Packages\.([A-Za-z0-9_-]+)", nix_list(text, attribute)))


def mismatches(pyproject: str, package: str) -> tuple[list[str], list[str]]:
    """(requirements package.nix lacks, package.nix attributes pyproject.toml lacks)."""
    wanted = pyproject_dependencies(pyproject)
    have = package_attributes(package)
    missing = sorted(name for name in wanted if not NIXPKGS_NAMES.get(name, {name}) & have)
    known = set().union(*(NIXPKGS_NAMES.get(name, {name}) for name in wanted))
    extra = sorted(have - known)
    return missing, extra


def test_package_nix_depends_on_exactly_what_pyproject_requires() -> None:
    missing, extra = mismatches(
        (REPO / "pyproject.toml").read_text(), (REPO / "nix" / "package.nix").read_text()
    )
    assert missing == [], (
        f"pyproject.toml requires {missing} but nix/package.nix does not list it: add "
        "python3Packages.<name> to its dependencies (and to NIXPKGS_NAMES here if nixpkgs "
        "names it differently)"
    )
    assert extra == [], f"nix/package.nix depends on {extra}, which pyproject.toml does not"


def test_the_build_system_too() -> None:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert {requirement_name(r) for r in requires} == package_attributes(
        (REPO / "nix" / "package.nix").read_text(), "build-system"
    )


def test_a_missing_dependency_is_caught() -> None:
    """The comparison is not vacuous: the old package.nix, without prometheus-client."""
    pyproject = (REPO / "pyproject.toml").read_text()
    package = (REPO / "nix" / "package.nix").read_text()
    old = package.replace("python3Packages.prometheus-client", "")
    assert mismatches(pyproject, old) == (["prometheus-client"], [])
    # Either of systemd-python's nixpkgs names will do, and a renamed one is an extra.
    assert mismatches(pyproject, package.replace("python3Packages.systemd-python or ", "")) == ([], [])
    renamed = package.replace("python3Packages.tomli-w", "python3Packages.tomli_w")
    assert mismatches(pyproject, renamed) == (["tomli-w"], ["tomli_w"])
