"""README's "Your first real swap" and "Uninstalling", command by command, in the lab:
the shipped RBAC applied, the agent's kubeconfig made by README's own script (with
the lab's kubectl for `k3s kubectl` and the lab's API server for the server's
address), `auth can-i`, `check-config`, `lint`, `status`, a `play`, the journal's lines
as README prints them, `release`, and `unmark-node` leaving the node as it was."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.lab.cluster import lab_cluster, lab_plane
from tests.lab.lab import LENDEE, Lab
from tests.packaging.readme import README, block, section
from tests.waiting import wait_until

pytestmark = pytest.mark.lab
GPU_LIST = re.compile(r"\bgpu-[a-z]\b(?:, gpu-[a-z]\b)*")
NAMED = re.compile(r" \([^()]*, (?:[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]|GPU-[^()]*)\)")


def words(message: str) -> str:
    """A journal line as README abridges it: GPUs without their model and address, and
    any list of GPUs as one word (README's host has two, the lab's three)."""
    return GPU_LIST.sub("GPUS", NAMED.sub("", message))


def step(title: str) -> str:
    """The text of one numbered step of "Your first real swap", unwrapped."""
    found = re.search(rf"^\d+\. \*\*{re.escape(title)}\*\*(.*?)(?=^\d+\. \*\*|\Z)",
                      section("Your first real swap"), re.S | re.M)
    assert found, f"README's first swap has no step {title!r}"
    return " ".join(found[1].split())


def test_the_first_real_swap_and_its_undo_as_readme_says(lab: Lab, tmp_path: Path) -> None:
    with lab_cluster(lab, workloads=False) as kc:
        plane = lab_plane(lab)
        kubectl = f"{plane.labkube} kubectl --kubeconfig {plane.admin}"

        # 1. The agent's permissions: the shipped RBAC and this host's identity, applied
        # as README says (its node is the lab's lendee).
        apply = textwrap.dedent(block("Your first real swap", "sh", "apply -f"))
        assert "kubectl apply -f deploy/rbac.yaml" in apply and f"/{LENDEE}/" in apply
        out = subprocess.run(["bash", "-euo", "pipefail", "-c",
                              f'kubectl() {{ {kubectl} "$@"; }}\n{apply}'],
                             cwd=README.parent, capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        assert f"serviceaccount/{LENDEE}" in out.stdout, out.stdout

        # 2. Its kubeconfig, by README's script: k3s's kubectl and k3s.yaml are the lab's.
        script = textwrap.dedent(block("Your first real swap", "sh", "create token"))
        k3s_yaml = tmp_path / "k3s.yaml"
        k3s_yaml.write_text(plane.kubectl("config", "view", "--raw", "--flatten",
                                          "--minify").stdout)
        assert "/etc/rancher/k3s/k3s.yaml" in script and "SERVER-LAN-ADDRESS:6443" in script
        script = (f'k3s() {{ shift; {kubectl} "$@"; }}\n'
                  + script.replace("/etc/rancher/k3s/k3s.yaml", str(k3s_yaml))
                  .replace("SERVER-LAN-ADDRESS:6443", plane.server.removeprefix("https://")))
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                             capture_output=True, text=True, check=False)
        assert out.returncode == 0, out.stderr
        kubeconfig = tmp_path / "hostagent.kubeconfig"
        kubeconfig.chmod(0o600)
        said = step("Its kubeconfig.")
        can_i = re.search(r"`kubectl --kubeconfig /etc/hostagent/kubeconfig (auth can-i [^`]+)`"
                          r" on the gaming host says `(\w+)`", said)
        assert can_i, "README checks the kubeconfig with auth can-i"
        out = plane.kubectl(*can_i[1].split(), kubeconfig=kubeconfig, check=False)
        assert out.stdout.strip() == can_i[2], out.stderr

        # 3. [lendee] node: `kubectl get nodes -o wide` lists it.
        assert "`kubectl get nodes -o wide`" in step("`[lendee] node`.")
        assert LENDEE in plane.kubectl("get", "nodes", "-o", "wide").stdout

        # 4. Check: check-config, then lint, each clean on a host set up right.
        lab.write_config(lab.config_text(kubeconfig=kubeconfig, relend_delay="1s"))
        for command in ("check-config", "lint"):
            assert f"`hostagent {command}`" in step("Check.")
            out = lab.hostagent(command)
            assert out.returncode == 0, f"hostagent {command}:\n{out.stdout}{out.stderr}"

        # 5. The swap: lent, then `hostagent play gaming1`, the journal as README shows.
        lab.start_agent()
        swap = step("The swap.")
        assert "`hostagent status` says `lent`" in swap
        # Each lend here may boot the lendee (TCG: slow), so a longer bound; each look
        # runs a process (the CLI, journalctl), so a slower pace.
        wait_until(lambda: json.loads(lab.hostagent("status", "--json").stdout)["lendee"]
                   ["phase"] == "lent", "the first lend", timeout=120, every=0.5)
        assert re.search(r"\blent\b", lab.hostagent("status").stdout)
        lab.mark_us = time.time_ns() // 1000
        assert "`hostagent play gaming1`" in swap
        out = lab.hostagent("play", "gaming1")
        assert out.returncode == 0, out.stderr
        lab.wait_game("gaming1")
        wait_until(lambda: len(lab.records(event="phase", to="lent")) >= 1, "the partial lend",
                   timeout=120, every=0.5)
        printed = section("Your first real swap").split("journalctl -u hostagent -f")[1]
        printed = printed.split("```\n", 1)[1].split("```", 1)[0]
        shown = [words(line.strip()) for line in printed.strip().splitlines()]
        assert shown[0] == "gaming1 wants GPUS: draining gpu-node", shown
        seen = [words(e["MESSAGE"]) for e in lab.records(event="phase")]
        assert seen[:len(shown)] == shown, "\n".join(seen)
        assert kc.node()["spec"].get("unschedulable") is not True

        # ... and back: `hostagent release gaming1`, then the lendee takes gpu-a back.
        assert "`hostagent release gaming1`" in swap
        out = lab.hostagent("release", "gaming1")
        assert out.returncode == 0, out.stderr
        lab.wait_state("gaming1", "shut off", timeout=120)
        wait_until(lambda: any(GPU_LIST.search(e["MESSAGE"]) and "not lent" not in e["MESSAGE"]
                               for e in lab.records(event="phase", to="lent")[1:]),
                   "gpu-a lent again", timeout=120, every=0.5)

        # Uninstalling: the agent stopped, unmark-node takes off what it put there.
        uninstall = block("Uninstalling", "sh", "unmark-node")
        assert "systemctl stop hostagent" in uninstall
        lab.stop_agent()
        node = kc.node()
        assert any(k.startswith("hostagent.io/") for k in node["metadata"].get("annotations", {}))
        dry = lab.hostagent("unmark-node", "--dry-run")
        assert dry.returncode == 0 and "hostagent.io/" in dry.stdout, dry.stdout + dry.stderr
        assert any(k.startswith("hostagent.io/")
                   for k in kc.node()["metadata"].get("annotations", {})), "--dry-run wrote"
        out = lab.hostagent("unmark-node")
        assert out.returncode == 0, out.stderr
        node = kc.node()
        left = [k for k in {**node["metadata"].get("annotations", {}),
                            **node["metadata"].get("labels", {})} if k.startswith("hostagent.io/")]
        assert left == [], left
        assert not [t for t in node["spec"].get("taints", []) if t["key"].startswith("hostagent.io/")]
