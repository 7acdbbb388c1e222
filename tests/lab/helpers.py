"""What the lab's tests share: a free port and SSH keys, OpenSSH's own server in the lab,
the waits for a lend, a node's annotations, the lendee defined with its lab GPUs and
their plugin pods, the lab's lendee split in two, a command in a guest, a message to the
lab's broker, and the journal as journalctl shows it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostagent.service.hotplug import CHECKPOINT
from tests.lab.cluster import LabCluster
from tests.lab.lab import GPUS, LENDEE, Lab, domain_xml
from tests.mosquitto import USERS, Mosquitto
from tests.packaging.readme import commands
from tests.waiting import BOUND, wait_until



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path, comment: str) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f",
                    str(path)], check=True)
    return path


def public(key: Path) -> str:
    return " ".join(key.with_suffix(".pub").read_text().split()[:2])


def wait_lent(lab: Lab, after: int = 0, timeout: float = 60) -> None:
    """Wait for the (after+1)-th LENT record."""
    lab.wait_records(after + 1, timeout, event="phase", to="lent")


class OpenSsh:
    """Debian's ssh client, host key pinned, no agent, no config, no questions."""

    def __init__(self, port: int, known_hosts: Path) -> None:
        self.port = port
        self.options = ["-F", "/dev/null", "-o", "StrictHostKeyChecking=yes",
                        "-o", f"UserKnownHostsFile={known_hosts}", "-o", "BatchMode=yes",
                        "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
                        "-o", "ConnectTimeout=10"]

    def __call__(self, key: Path, *args: str, timeout: float = 90
                 ) -> subprocess.CompletedProcess[str]:
        *flags, command = args if args else ("",)
        argv = ["ssh", "-i", str(key), "-p", str(self.port), *self.options, *flags,
                "hostagent@127.0.0.1"] + ([command] if command else [])
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)

    def sftp(self, key: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["sftp", "-i", str(key), "-P", str(self.port), *self.options,
                               "-b", "/dev/null", "hostagent@127.0.0.1"],
                              capture_output=True, text=True, timeout=30, check=False)


def lends(lab: Lab, count: int, timeout: float = 90) -> None:
    lab.wait_records(count, timeout, event="phase", to="lent")


def annotations_of(node: dict[str, Any]) -> dict[str, str]:
    return node["metadata"].get("annotations") or {}


def eventually(condition: Callable[[], object], what: str, timeout: float = BOUND) -> None:
    """tests.waiting.wait_until for a lab condition, which runs a process each time
    (kubectl, virsh, the guest agent, journalctl): asked every 0.2 s."""
    wait_until(condition, what, timeout=timeout, every=0.2)


# What makes the lab's guest ignore an unplug request: no ACPI hot-plug driver, and
# the PCIe ports without their native hot-plug service either.
NEVER_LETS_GO = "acpiphp.disable=1 pcie_ports=compat"


def define_lendee(lab: Lab, kernel_args: str = "") -> None:
    """gpu-node's persistent definition, as the lab's, with more on its kernel command
    line (a running instance keeps its own until it restarts)."""
    assert lab.guest is not None
    xml = domain_xml(LENDEE, lab.guest, [lab.gpu_image(g) for g in sorted(GPUS)],
                     console=lab.root / "console" / f"{LENDEE}.log")
    xml = xml.replace("<cmdline>console=ttyS0", f"<cmdline>{kernel_args} console=ttyS0")
    path = lab.root / f"{LENDEE}.xml"
    path.write_text(xml)
    lab.virsh("define", str(path))


# The two-lendee lab's second lendee: a worker VM, and a node, of its own.
OTHER = "gpu-node-b"
ONE_LENDEE = '[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-a", "gpu-b", "gpu-c"]\n'


def two_lendees(lab: Lab, config: str, theirs: tuple[str, ...], *,
                kubeconfig: Path | None = None) -> str:
    """`config` (the lab's: one [lendee] holding every lab GPU) with two lendees
    instead: OTHER holds `theirs` (as its node's ServiceAccount, with `kubeconfig`),
    gpu-node the rest; both VMs defined with those GPUs. OTHER is left defined."""
    assert ONE_LENDEE in config
    mine = [g for g in sorted(GPUS) if g not in theirs]
    own = f'kubeconfig = "{kubeconfig}"\n' if kubeconfig is not None else ""
    lab.define(LENDEE, gpus=tuple(mine))
    lab.define(OTHER, gpus=theirs)
    return config.replace(ONE_LENDEE, f"[lendees.{LENDEE}]\ngpus = {json.dumps(mine)}\n\n"
                          f"[lendees.{OTHER}]\n{own}gpus = {json.dumps(list(theirs))}\n")


def gpu_pods(lab: Lab, kc: LabCluster, pods: dict[str, str]) -> None:
    """Pods of Jobs on gpu-node, each using one lab GPU (name -> GPU label), and the
    kubelet's device checkpoint in the guest saying which, as the device plugin's IDs."""
    for name in pods:
        kc.add_gpu_job(name)
    entries = []
    for name, gpu in pods.items():
        running = kc.running(name)
        entries.append({"PodUID": running["metadata"]["uid"], "ContainerName": "main",
                        "ResourceName": "nvidia.com/gpu",
                        "DeviceIDs": {"0": [GPUS[gpu][0]]}, "AllocResp": ""})
    text = json.dumps({"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {
        "nvidia.com/gpu": [uuid for uuid, _ in GPUS.values()]}}, "Checksum": 0})
    done = lab.guest_exec(LENDEE, "/bin/sh", "-c", 'mkdir -p "${1%/*}" && printf %s "$2" > "$1"',
                          "sh", CHECKPOINT, text)
    assert done.exitcode == 0, done


def guest(lab: Lab, *argv: str) -> str:
    return lab.guest_exec(LENDEE, *argv).stdout.strip()


def publish(broker: Mosquitto, topic: str, payload: str, user: str = "ha") -> None:
    pub = shutil.which("mosquitto_pub")
    assert pub is not None
    subprocess.run([pub, "-p", str(broker.port), "-u", user, "-P", USERS[user], "-q", "1",
                    "-t", topic, "-m", payload], check=True, timeout=30)


def journalctl(lab: Lab, command: str) -> list[str]:
    """README's `journalctl` line as written, against the lab's journald (`-D` its
    directory, from the test's start): the messages it prints."""
    assert command in commands(), f"README shows no {command!r}"
    argv = command.split()
    assert argv[0] == "journalctl" and "-f" not in argv
    out = subprocess.run(["journalctl", "-D", str(lab.root / "journal"), "--no-pager",
                          f"--since=@{lab.mark_us / 1e6:.6f}", *argv[1:]],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [line.split("]: ", 1)[1] for line in out.stdout.splitlines() if "]: " in line]
