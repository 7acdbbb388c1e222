"""README's commands that no other lab test runs, as README writes them: the lab by hand
(`.venv/bin/python -m tests.lab.lab DIR`, its printed `virsh -c` and `journalctl -D`,
Ctrl-C), and, on one boot of gpu-node with the lab's cluster, `virsh autostart --disable`
as lint asks for it, README's ssh-keygen line, `hostagent reserve` and its SSH line,
`hold` (and Home Assistant's hold switch over MQTT), `reclaim` followed with `journalctl
-u hostagent -f`, the `journalctl` forms README gives, the node's Events through
`kubectl`, and `lend` and `resume` as the NixOS section's restart of libvirtd uses them.
tests/packaging/test_readme_commands.py says which test runs each of README's commands."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.lab.cluster import lab_cluster
from tests.lab.lab import LENDEE, REPO, Lab, need_lab
from tests.lab.helpers import wait_lent
from tests.lab.helpers import publish
from tests.mosquitto import Mosquitto, free_port
from tests.packaging.readme import block
from tests.packaging.readme import commands, readme_ssh
from tests.lab.helpers import (
    eventually,
    journalctl,
)

pytestmark = pytest.mark.lab


def _pids_naming(path: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path) in (proc / "cmdline").read_bytes().decode(
                    errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_a_lab_by_hand_comes_up_and_goes_down_as_readme_says(tmp_path: Path) -> None:
    reason = need_lab()
    if reason:
        pytest.skip(reason)
    line = block("The lab", "sh", "tests.lab.lab").split("#")[0].split()
    assert line[:3] == [".venv/bin/python", "-m", "tests.lab.lab"] and line[3] == "/tmp/mylab"
    root = tmp_path / "mylab"
    proc = subprocess.Popen([*line[:3], str(root)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        printed: list[str] = []
        assert proc.stdout is not None
        while not printed or "Ctrl-C" not in printed[-1]:
            out = proc.stdout.readline()
            assert out, "the lab exited before it was up:\n" + "".join(printed)
            printed.append(out)
        text = "".join(printed)
        # "prints its libvirt URI", and the commands to look inside, which work as printed.
        uri = re.search(r"^lab up: (\S+)$", text, re.M)
        assert uri and f"socket={root}" in uri[1], text
        virsh = re.search(r"^  (virsh -c '[^']+' list --all)$", text, re.M)
        assert virsh, text
        listed = subprocess.run(virsh[1], shell=True, capture_output=True, text=True,
                                timeout=60, check=False)
        assert listed.returncode == 0, listed.stderr
        assert {LENDEE, "gaming1", "gaming2"} <= set(listed.stdout.split()), listed.stdout
        journal = re.search(r"^  (journalctl -D \S+)$", text, re.M)
        assert journal, text
        read = subprocess.run(f"{journal[1]} --no-pager -n 5", shell=True, capture_output=True,
                              text=True, timeout=60, check=False)
        assert read.returncode == 0, read.stderr
        # "Ctrl-C takes it down": every lab process stops; the directory stays for its logs.
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        assert rest.strip().endswith("lab down"), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _pids_naming(root) == []
    assert root.is_dir() and any(root.iterdir())


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, check=False)


def test_hold_reclaim_and_lend_as_readme_says(lab: Lab, tmp_path: Path) -> None:
    """On one boot of gpu-node, with the lab's cluster: autostart as lint asks, a key made
    by README's ssh-keygen line, reservations by the CLI and over SSH, `hold` (and Home
    Assistant's hold switch), `reclaim` followed with `journalctl -u hostagent -f`, the
    node's Events, and the NixOS section's `systemctl restart libvirtd` then `hostagent
    lend`."""
    broker = Mosquitto(lab.root / "mosquitto")
    broker.start()
    with contextlib.ExitStack() as stack:
        stack.callback(broker.stop)
        kc = stack.enter_context(lab_cluster(lab, workloads=False))
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig))
        # "Leave libvirt's autostart off ... (`virsh autostart --disable VM`; `hostagent
        # lint` flags it)": lint's fix is README's command.
        lab.virsh("autostart", "gaming2")
        try:
            flagged = lab.hostagent("lint", "gaming2").stdout
            assert "libvirt autostarts it" in flagged, flagged
            assert "virsh autostart --disable VM".replace("VM", "gaming2") in flagged
        finally:
            lab.virsh("autostart", "--disable", "gaming2")
        assert "autostarts" not in lab.hostagent("lint", "gaming2").stdout

        # The SSH endpoint, with a phone's key made by README's ssh-keygen line.
        port = free_port()
        made = 'ssh-keygen -t ed25519 -N "" -f /config/ssh/button_key'
        assert made in commands()
        keys = {"phone_key": tmp_path / "phone_key"}
        out = subprocess.run(made.replace(made.split()[-1], str(keys["phone_key"])), shell=True,
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 0, out.stderr
        authorized = lab.root / "agent" / "authorized_keys"
        public = " ".join(keys["phone_key"].with_suffix(".pub").read_text().split()[:2])
        authorized.write_text(f'verbs="reserve",vms="gaming1" {public}\n')
        authorized.chmod(0o600)
        lab.write_config(lab.config_text(kubeconfig=kc.kubeconfig) + f"""
[ssh]
listen = "127.0.0.1:{port}"
authorized_keys = "{authorized}"

[mqtt]
broker = "mqtt://127.0.0.1:{broker.port}"
username = "hostagent"
password_file = "{broker.root / 'agent-password'}"
base_topic = "hostagent"
""")
        lab.start_agent()
        host_key = lab.path("/var/lib/hostagent/ssh_host_ed25519_key.pub")
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_key.read_text()}")
        wait_lent(lab)

        # Reservations: README's lines, at a time three hours ahead (20:00 may be near).
        at = (datetime.now() + timedelta(hours=3)).strftime("%H:%M")
        cli = "hostagent reserve gaming1 --at 20:00"
        assert cli in commands()
        out = lab.hostagent(*cli.replace("20:00", at).split()[1:])
        assert out.returncode == 0 and "gaming1 is reserved for" in out.stdout, out
        out = lab.hostagent("reserve", "gaming1", "--cancel")
        assert "hostagent reserve gaming1 --cancel" in commands()
        assert out.returncode == 0, out
        phone = "ssh -i phone_key -p 2222 hostagent@host reserve gaming1 20:00"
        out = run([a.replace("20:00", at) for a in readme_ssh(phone, port, keys, known_hosts)])
        assert out.returncode == 0 and "reserved" in out.stdout, out
        out = run([*readme_ssh(phone, port, keys, known_hosts)[:-1], "cancel"])
        assert out.returncode == 0, out
        assert json.loads(lab.hostagent("status", "--json").stdout)["reservations"] == []
        said = journalctl(lab, "journalctl -u hostagent HOSTAGENT_EVENT=reserve")
        assert [w for line in said for w in ("reserved", "cancel") if w in line] == [
            "reserved", "cancel", "reserved", "cancel"], said
        ran = [line for line in journalctl(lab, "journalctl -u hostagent HOSTAGENT_EVENT=ssh")
               if " runs '" in line]
        assert [line.split(" runs ")[1] for line in ran] == [
            f"'reserve gaming1 {at}'", "'reserve gaming1 cancel'"], ran
        history = journalctl(lab, "journalctl -u hostagent HOSTAGENT_VM=gaming1")
        assert history and all("gaming1" in line for line in history), history

        # `hold`: "lend no more: a running lendee keeps running".
        out = lab.hostagent("hold")
        assert out.returncode == 0, out
        assert lab.state(LENDEE) == "running"
        # Home Assistant's hold switch too: a command over MQTT, journaled with its caller.
        publish(broker, "hostagent/hold/set", "ON")
        lab.wait_record(event="control", via="mqtt")
        said = journalctl(lab, "journalctl -u hostagent HOSTAGENT_VIA=mqtt")
        assert said and all("mqtt" in line for line in said), said
        # `reclaim`, followed with README's `journalctl -u hostagent -f`: one line per
        # transition; the lendee "stays off until `lend`".
        follow = subprocess.Popen(["journalctl", "-D", str(lab.root / "journal"), "-n", "0",
                                   *"journalctl -u hostagent -f".split()[1:]],
                                  stdout=subprocess.PIPE, text=True)
        phases = len(lab.records(event="phase"))
        out = lab.hostagent("reclaim")
        assert out.returncode == 0, out
        assert lab.state(LENDEE) == "shut off"
        # The lendee stays off until `lend`: on hold, and no timer left to start it.
        status = lab.status()
        assert status["lendee"]["hold"] and status["relend_in_s"] is None, status
        eventually(lambda: lab.records(event="phase")[-1]["HOSTAGENT_TO"] == "off",
                   "the reclaim's last record")
        moved = [e["MESSAGE"] for e in lab.records(event="phase")[phases:]]
        followed: list[str] = []

        def read() -> None:
            assert follow.stdout is not None
            for line in follow.stdout:
                followed.append(line.rstrip("\n").split("]: ", 1)[-1])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        eventually(lambda: set(moved) <= set(followed), "each transition followed", timeout=30)
        follow.terminate()
        reader.join(30)
        follow.communicate(timeout=30)  # its pipe closed
        assert moved and [line for line in followed if line in moved] == moved, followed
        assert lab.state(LENDEE) == "shut off" and moved[-1].startswith("gpu-node is off")
        # The node's Events: "`kubectl get events`, `kubectl describe node gpu-node`".
        for command in ("kubectl get events", "kubectl describe node gpu-node"):
            assert command in commands()
            shown = kc.plane.kubectl(*command.split()[1:]).stdout
            assert "Reclaimed" in shown and "Lent" in shown, shown

        # NixOS 25.05: "`hostagent reclaim` ..., then `systemctl restart libvirtd` and
        # `hostagent lend`" (the lab's libvirtd); `resume` is lend's other name.
        boots = len(lab.records(event="phase", to="booting"))
        lab.restart_libvirtd()
        out = lab.hostagent("lend")
        assert out.returncode == 0, out
        eventually(lambda: len(lab.records(event="phase", to="booting")) > boots,
                   "lend after libvirtd's restart booting gpu-node")
        out = lab.hostagent("resume")
        assert out.returncode == 0, out
