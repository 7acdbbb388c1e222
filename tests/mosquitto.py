"""A real mosquitto (Debian's package) on a loopback port, with a password and an ACL
file, for the tests of the Home Assistant device.

Users: ``hostagent`` (the agent: its base topic and the discovery prefix), ``ha``
(Home Assistant: reads everything, commands the agent, says it is online) and
``intruder`` (reads the agent's topics, may publish nothing). No persistence: a
restart loses every retained message, so the agent must publish them again.
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")
PASSWD = shutil.which("mosquitto_passwd")
SUB, PUB = shutil.which("mosquitto_sub"), shutil.which("mosquitto_pub")
MISSING = ("mosquitto is not installed (Debian package mosquitto; `make setup` installs it)"
           if not (MOSQUITTO and PASSWD) else
           "mosquitto_sub and mosquitto_pub are not installed (Debian package "
           "mosquitto-clients; `make setup` installs it)" if not (SUB and PUB) else None)

USERS = {"hostagent": "agent-secret", "ha": "ha-secret", "intruder": "intruder-secret",
         "homeassistant": "homeassistant-secret"}  # the last: deploy/mosquitto.acl's
ACL = """\
user hostagent
topic readwrite hostagent/#
topic readwrite homeassistant/#

user ha
topic readwrite homeassistant/#
topic readwrite hostagent/#

user intruder
topic read hostagent/#
topic read homeassistant/#
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Mosquitto:
    """One broker; `start` and `stop` may be called again (same port, same files)."""

    def __init__(self, root: Path, port: int | None = None, *, acl: str = ACL) -> None:
        assert MOSQUITTO and PASSWD, MISSING
        self.root = root
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        passwords = root / "passwords"
        passwords.write_text("")
        for user, password in USERS.items():
            subprocess.run([PASSWD, "-b", str(passwords), user, password], check=True,
                           capture_output=True, timeout=30)
        (root / "acl").write_text(acl)
        for name in ("passwords", "acl"):
            (root / name).chmod(0o600)
        (root / "mosquitto.conf").write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous false\n"
            f"password_file {passwords}\n"
            f"acl_file {root / 'acl'}\n"
            "persistence false\n"
            # Run as the user that runs the tests: its files stay private to it.
            f"user {getpass.getuser()}\n"
            "log_dest stderr\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
            "log_type subscribe\n")  # `subscribed` reads these
        (root / "agent-password").write_text(USERS["hostagent"] + "\n")
        (root / "agent-password").chmod(0o600)  # the agent refuses one others may read

    def start(self) -> None:
        assert MOSQUITTO is not None
        self.log = (self.root / "mosquitto.log").open("ab")
        self.process = subprocess.Popen([MOSQUITTO, "-c", str(self.root / "mosquitto.conf")],
                                        stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:  # listening: a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("mosquitto did not start: "
                                       + (self.root / "mosquitto.log").read_text()) from None
                time.sleep(0.05)

    def subscribed(self, topic: str) -> set[str]:
        """The client ids the broker logged a subscription to `topic` for: mosquitto
        2.0.11 logs "<client id> <qos> <topic>" for each (src/handle_subscribe.c)."""
        log = (self.root / "mosquitto.log").read_text(errors="replace")
        return {words[-3] for line in log.splitlines()
                if len(words := line.split()) >= 4 and words[-1] == topic}

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)
            self.process = None
            self.log.close()


DEVICE = "homeassistant/device/hostagent/config"


class Dashboard:
    """`mosquitto_sub` as Home Assistant: every message on the agent's topics, timed."""

    def __init__(self, broker: Mosquitto, log: Path) -> None:
        self.broker, self.log = broker, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        sub = shutil.which("mosquitto_sub")
        assert sub is not None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sub, "-p", str(self.broker.port), "-u", "ha", "-P", USERS["ha"], "-i", "dash",
                 "-q", "1", "-F", "%U\t%r\t%t\t%p", "-t", "hostagent/#", "-t", DEVICE],
                stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def messages(self) -> list[tuple[float, str, str]]:
        """(time, topic, payload) of each message seen, oldest first."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            parts = line.split("\t", 3)
            if len(parts) == 4:
                out.append((float(parts[0]), parts[2], parts[3]))
        return out

    def last(self, topic: str) -> str | None:
        values = [p for _, t, p in self.messages() if t == topic]
        return values[-1] if values else None

    def wait(self, topic: str, payload: str | Callable[[str], bool],
             timeout: float = 120) -> None:
        """Until the last message on `topic` is `payload` (or one it accepts): the states
        of one change come one topic after the other (`homeassistant.states`' order)."""
        deadline = time.monotonic() + timeout
        while not ((last := self.last(topic)) is not None and (
                payload(last) if callable(payload) else last == payload)):
            assert time.monotonic() < deadline, (topic, payload, last)
            time.sleep(0.1)
