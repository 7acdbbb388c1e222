"""README.md read as its reader reads it (test_readme.py, test_readme_commands.py, the
lab's README tests): its sections, the code blocks in them, and the commands they give."""

from __future__ import annotations

import re
import textwrap
from functools import cache
from pathlib import Path

import yaml  # type: ignore[import-untyped]



README = Path(__file__).resolve().parents[2] / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(language: str, text: str | None = None) -> list[str]:
    return [str(b) for b in re.findall(rf"^ *```{language}\n(.*?)^ *```",
                                       README.read_text() if text is None else text,
                                       re.S | re.M)]


def block(title: str, language: str, containing: str = "") -> str:
    found = [b for b in blocks(language, section(title)) if containing in b]
    assert len(found) == 1, f"expected one {language} block under {title!r}"
    return found[0]


PROGRAMS = frozenset({
    "hostagent", "virsh", "journalctl", "make", "systemctl", "kubectl", "k3s", "ssh",
    "ssh-keygen", "pydoc", "helm", "nix", "nixos-rebuild", "apt-get", "git", "chmod", "rm",
    "groupadd", "editor", ".venv/bin/python", "/opt/hostagent/bin/python",
})


FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)


def _block_commands(language: str, body: str) -> list[str]:
    body = textwrap.dedent(body)
    if language == "yaml":
        if "shell_command:" not in body:
            return []
        return [" ".join(str(v).split()) for v in yaml.safe_load(body)["shell_command"].values()]
    if language in ("sh", "bash", "console"):
        lines = body.splitlines()
    elif language == "":
        lines = [line[2:] for line in body.splitlines() if line.startswith("$ ")]
    else:
        return []
    found: list[str] = []
    heredoc, line = "", ""
    for raw in lines:
        if heredoc:
            heredoc = "" if raw.strip() == heredoc else heredoc
            continue
        line += raw
        if line.endswith("\\"):
            line = line[:-1] + " "
            continue
        opened = re.search(r"<<-?'?(\w+)'?", line)
        heredoc = opened[1] if opened else ""
        command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
        line = ""
        if command:
            found.append(command)
    return found


@cache
def commands() -> tuple[str, ...]:
    text = README.read_text()
    found = [c for m in FENCE.finditer(text) for c in _block_commands(m[1], m[2])]
    for span in re.findall(r"`([^`]+)`", FENCE.sub("", text)):
        words = span.split()
        if len(words) > 1 and words[0] in PROGRAMS:
            found.append(" ".join(words))
    return tuple(dict.fromkeys(found))


def readme_ssh(command: str, port: int, keys: dict[str, Path], known_hosts: Path) -> list[str]:
    """One of README's ssh lines, its key, port, host and known_hosts the lab's; the
    options README leaves to the reader's ssh configuration made explicit."""
    assert command in commands(), f"README shows no {command!r}"
    for name, key in keys.items():
        command = command.replace(name, str(key))
    command = (command.replace("-p 2222", f"-p {port}")
               .replace("/config/ssh/known_hosts", str(known_hosts))
               .replace("@gaming-host.lan ", "@127.0.0.1 ").replace("@host ", "@127.0.0.1 "))
    argv = command.split()
    return [argv[0], "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentityAgent=none",
            "-o", f"UserKnownHostsFile={known_hosts}", *argv[1:]]
