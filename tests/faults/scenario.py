"""What a fault scenario measures, and the faults it injects.

A scenario (the `fault` fixture) watches the lab while a test breaks it and puts the
figures users care about in one row of the table (see conftest.py):

- **intents lost**: starts the player was told would happen ("deferred") that neither
  happened, failed with a reason nor are still pending; and intents the agent
  journaled as pending that ended none of those ways. A failed intent is not lost (it
  is answered, with its reason) but fails the scenario unless its policy allows it;
- **double holders**: samples, taken every 100 ms straight from libvirt, in which the
  lendee and an owner that shares a GPU with it were both running; the lendee's GPUs
  are those of its live definition (with partial lending it may run with a subset);
- **forced stops**: times the lendee stopped for any other reason than its own
  shutdown (libvirt's stop reason: "destroyed", "crashed", "failed"...), leaving out
  the stops the test itself caused on purpose (`Scenario.deliberate`);
- **recovery time**: from the fault (`Scenario.fault`) to the moment the test saw the
  lab whole again (`Scenario.recovered`); with several faults, the longest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import shutil
import subprocess
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libvirt

from tests.lab.lab import DEFERRED, GPUS, LENDEE, OWNERS, Lab
from tests.waiting import wait_until

# libvirt's reasons for VIR_DOMAIN_SHUTOFF, as `virsh domstate --reason` names them.
SHUTOFF_REASONS = {0: "unknown", 1: "shutdown", 2: "destroyed", 3: "crashed", 4: "migrated",
                   5: "saved", 6: "failed", 7: "from snapshot", 8: "daemon"}


def shares_with_lendee(owner: str, lent: frozenset[str] = frozenset(GPUS)) -> bool:
    return bool(set(OWNERS[owner]) & lent)


def gpus_in_xml(xml: str) -> frozenset[str]:
    """The lab GPUs a domain's XML gives it (their disks' ua-hostagent-LABEL aliases)."""
    return frozenset(re.findall(r"<alias name='ua-hostagent-([a-z0-9-]+?)'/>", xml)) & set(GPUS)


@dataclass
class Stop:
    at: float
    reason: str
    deliberate: bool
    ran: bool  # False: a start that failed before the guest ran (a device in use)


class Watcher(threading.Thread):
    """Samples libvirt every `interval` seconds: who runs, and why the lendee stopped.

    It asks libvirt directly (what `virsh list` and `virsh domstate --reason` print),
    on a connection of its own that it reopens when libvirtd comes back. A domain that
    QEMU is still setting up (paused, starting) holds nothing yet: only RUNNING counts.
    """

    def __init__(self, uri: str, interval: float = 0.1) -> None:
        super().__init__(name="fault-watcher", daemon=True)
        self.uri = uri
        self.interval = interval
        self.overlaps: list[tuple[float, list[str]]] = []
        self.stops: list[Stop] = []
        self.samples = 0
        self.errors = 0
        self._conn: Any = None
        self._active: set[str] | None = None
        self._lent: tuple[int, frozenset[str]] | None = None  # (domain id, its GPUs)
        self._lendee_ran = False
        self._deliberate = 0
        self._done = threading.Event()
        self._sampled = threading.Condition()

    def run(self) -> None:
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        while not self._done.is_set():
            try:
                self._sample()
            except libvirt.libvirtError:
                self.errors += 1
                self._close()  # libvirtd is down or restarting: reconnect next time
            with self._sampled:
                self._sampled.notify_all()
            self._done.wait(self.interval)
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                conn.close()

    def _sample(self) -> None:
        if self._conn is None:
            self._conn = libvirt.open(self.uri)
        deliberate = self._deliberate > 0  # read before the sample: a stop inside counts
        now = time.monotonic()
        domains = {d.name(): d for d in
                   self._conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)}
        states = {name: d.state() for name, d in domains.items()}
        holders = sorted(n for n, (st, _) in states.items() if st == libvirt.VIR_DOMAIN_RUNNING)
        if LENDEE in holders:
            lent = self._lendee_gpus(domains[LENDEE])
            if any(o in holders and shares_with_lendee(o, lent) for o in OWNERS):
                self.overlaps.append((now, holders))
        if LENDEE in holders:
            self._lendee_ran = True
        if self._active is not None and LENDEE in self._active and LENDEE not in states:
            st, reason = self._conn.lookupByName(LENDEE).state()
            if st == libvirt.VIR_DOMAIN_SHUTOFF:
                self.stops.append(Stop(now, SHUTOFF_REASONS.get(reason, str(reason)),
                                       deliberate or self._deliberate > 0, self._lendee_ran))
                self._lendee_ran = False
        self._active = set(states)
        self.samples += 1

    def _lendee_gpus(self, dom: Any) -> frozenset[str]:
        """The GPUs this run of the lendee was started with (its live definition), read
        once per run; every lab GPU if its XML names none."""
        if self._lent is None or self._lent[0] != dom.ID():
            self._lent = (dom.ID(), gpus_in_xml(dom.XMLDesc(0)) or frozenset(GPUS))
        return self._lent[1]

    def settle(self, samples: int = 2, timeout: float = 30) -> None:
        """Wait until `samples` more samples have been taken (libvirtd answering)."""
        target = self.samples + samples
        deadline = time.monotonic() + timeout
        with self._sampled:
            while self.samples < target and time.monotonic() < deadline and self.is_alive():
                self._sampled.wait(0.2)

    @contextlib.contextmanager
    def deliberate(self) -> Iterator[None]:
        """Stops of the lendee inside this block are the test's own doing."""
        self._deliberate += 1
        try:
            yield
            self.settle()
        finally:
            self._deliberate -= 1

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    @property
    def forced(self) -> list[Stop]:
        return [s for s in self.stops if s.ran and s.reason != "shutdown" and not s.deliberate]

    @property
    def refused_starts(self) -> list[Stop]:
        """Starts of the lendee that QEMU refused (a device in use): never a holder."""
        return [s for s in self.stops if not s.ran]


@dataclass
class Metrics:
    intents_lost: int
    intents_failed: int
    double_holders: int
    forced_stops: int
    recovery_s: float | None
    details: list[str] = field(default_factory=list)


class Scenario:
    """One fault scenario: the watcher, the player's requests and the clock."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        # What the scenario's policy allows: a test that sets force_off_after, or
        # on_drain_timeout = "abort", raises these.
        self.forced_stops_allowed = 0
        self.intents_may_fail = 0
        self.watcher = Watcher(lab.uri)
        self.asks: list[tuple[str, int]] = []  # (owner, wall clock in µs) of each deferral
        self._fault_at: float | None = None
        self.recoveries: list[float] = []
        self.metrics: Metrics | None = None
        self.hooks: list[Path] = []
        self._console_at: dict[str, int] = {}

    def begin(self) -> None:
        # Consoles are appended to across tests: this scenario reads from here on.
        self._console_at = {name: len(self.lab.console(name)) for name in (LENDEE, *OWNERS)}
        self.watcher.start()
        self.watcher.settle(1)

    # ---- what the test does ---------------------------------------------------------
    def start_owner(self, vm: str, *, tries: int = 3) -> subprocess.CompletedProcess[str]:
        """`virsh start vm` as a player would (`Lab.ask`: once more while the agent could
        not record the request; `tries=1` where that refusal is the subject); a deferral
        is a promise to keep."""
        at = time.time_ns() // 1000
        out = self.lab.ask(vm, tries=tries)
        if out.returncode != 0 and DEFERRED in out.stderr:
            self.asks.append((vm, at))
        return out

    def fault(self) -> None:
        """The fault is injected now: the recovery clock starts."""
        self._fault_at = time.monotonic()

    def recovered(self) -> float:
        """The lab is whole again: the recovery clock stops. Returns the seconds."""
        assert self._fault_at is not None, "recovered() without a fault()"
        took = time.monotonic() - self._fault_at
        self.recoveries.append(took)
        return took

    def console(self, name: str) -> str:
        """What the guest printed on its console since the scenario began."""
        return self.lab.console(name)[self._console_at.get(name, 0):]

    def shutdowns(self, name: str) -> int:
        """How many times the guest powered off through its agent (it says so)."""
        return self.console(name).count("lab guest: shutdown")

    def boots(self, name: str) -> int:
        return self.console(name).count("lab guest: up")

    def deliberate(self) -> contextlib.AbstractContextManager[None]:
        return self.watcher.deliberate()

    # ---- the end ----------------------------------------------------------------------
    def measure(self) -> Metrics:
        if self.metrics is not None:
            return self.metrics
        self.watcher.settle(1, timeout=5)
        self.watcher.stop()
        details: list[str] = []
        pending = self._pending_intents()
        # An intent ends done, or failed with its reason (a journal record, an answer to
        # whoever waits); one that simply vanished is lost.
        ended = (self.lab.records(event="intent", to="done")
                 + self.lab.records(event="intent", to="failed"))
        failed = [e for e in ended if e.get("HOSTAGENT_TO") == "failed"]
        journaled = {e["HOSTAGENT_INTENT"]: e["HOSTAGENT_VM"]
                     for e in self.lab.records(event="intent", to="pending")}
        ended_ids = {e.get("HOSTAGENT_INTENT") for e in ended}
        lost_ids = sorted(i for i in journaled if i not in ended_ids and i not in pending)
        for i in lost_ids:
            details.append(f"intent {i} for {journaled[i]} ended neither done, failed nor "
                           "pending")
        unkept = [(vm, at) for vm, at in self.asks
                  if vm not in pending.values()
                  and not any(e["HOSTAGENT_VM"] == vm and int(e["__REALTIME_TIMESTAMP"]) >= at
                              for e in ended)]
        for vm, _ in unkept:
            details.append(f"the deferred start of {vm} never happened and is not pending")
        for e in failed:
            details.append(f"intent for {e['HOSTAGENT_VM']} failed: {e['MESSAGE']}")
        forced = self.watcher.forced
        for s in forced:
            details.append(f"{LENDEE} stopped ({s.reason}) without its own shutdown")
        refused = self.watcher.refused_starts
        if refused:
            details.append(f"{len(refused)} start(s) of {LENDEE} refused before it ran "
                           f"({', '.join(s.reason for s in refused)})")
        for _, holders in self.watcher.overlaps[:3]:
            details.append(f"running together: {', '.join(holders)}")
        self.metrics = Metrics(
            intents_lost=max(len(lost_ids), len(unkept)),
            intents_failed=len(failed),
            double_holders=len(self.watcher.overlaps),
            forced_stops=len(forced),
            recovery_s=max(self.recoveries) if self.recoveries else None,
            details=details)
        return self.metrics

    def check(self) -> None:
        m = self.measure()
        problems = []
        if m.intents_lost:
            problems.append(f"{m.intents_lost} intent(s) lost")
        if m.intents_failed > self.intents_may_fail:
            problems.append(f"{m.intents_failed} intent(s) failed")
        if m.double_holders:
            problems.append(f"{m.double_holders} sample(s) with two holders of a GPU")
        if m.forced_stops > self.forced_stops_allowed:
            problems.append(f"{m.forced_stops} forced stop(s) of {LENDEE}")
        assert self.watcher.samples > 0, "the watcher never reached libvirt"
        assert not problems, "; ".join(problems) + ": " + "; ".join(m.details)

    def _pending_intents(self) -> dict[str, str]:
        """id → owner of the intents still pending, from the agent or else its state file."""
        agent = self.lab.procs.get("agent")
        if agent is not None and agent.poll() is None:
            out = self.lab.hostagent("status", "--json")
            if out.returncode == 0:
                return {i["id"]: i["owner"] for i in json.loads(out.stdout)["intents"]}
        state = self.lab.root / "var-lib-hostagent" / "state.toml"
        try:
            saved = tomllib.loads(state.read_text())
        except (OSError, tomllib.TOMLDecodeError):
            return {}
        return {i["id"]: i["owner"] for i in saved.get("intents", [])}

    def close(self) -> None:
        """Put back what a failed test may have left broken, for the next one."""
        if self.watcher.is_alive():
            self.watcher.stop()
        for hook in self.hooks:  # removed by the lab's reset, once nothing runs hooks
            disarm(hook)
        agent = self.lab.procs.get("agent")
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGCONT)
        self.lab.start_libvirtd()  # if a fault left it dead; the next reset checks it answers

    # ---- faults -----------------------------------------------------------------------
    @contextlib.contextmanager
    def slow_hook(self, domain: str, op: str, sub: str,
                  seconds: float = 3) -> Iterator[Path]:
        """Hold libvirtd for `seconds` inside one hook call (`qemu.d/`, after our hook).

        libvirtd runs hooks synchronously, so this holds a start or a stop half-way,
        long enough to kill the agent there. Yields the file that appears when the
        hook starts waiting.
        """
        hooks = self.lab.root / "etc-libvirt" / "hooks" / "qemu.d"
        hooks.mkdir(exist_ok=True)
        held = self.lab.root / "log-libvirt" / f"held-{domain}-{op}-{sub}"
        held.unlink(missing_ok=True)
        script = hooks / "fault-slow"
        script.write_text(f"""#!/bin/sh
# Fault injection: libvirtd waits here, as it would for a slow hook.
[ "$1 $2 $3" = "{domain} {op} {sub}" ] || exit 0
: > /var/log/libvirt/{held.name}
sleep {seconds:g}
exit 0
""")
        script.chmod(0o755)
        self.hooks.append(script)
        try:
            yield held
        finally:
            # Disarmed, not removed: libvirtd lists qemu.d/ and then runs each script, so
            # a script removed in between fails the start it was running for ("cannot
            # execute binary"). Removed once nothing runs hooks (`Lab.reset`).
            disarm(script)


def disarm(script: Path) -> None:
    """`script` made a hook that does nothing, in one step (written beside qemu.d/, where
    libvirtd would run a half-written file, and renamed over it)."""
    if not script.exists():
        return
    disarmed = script.parent.parent / f".{script.name}.disarmed"
    disarmed.write_text("#!/bin/sh\nexit 0\n")
    disarmed.chmod(0o755)
    disarmed.replace(script)


# ---- the lab, broken on purpose ------------------------------------------------------


def kill_libvirtd(lab: Lab) -> None:
    """SIGKILL, not a clean stop: running guests stay up, libvirtd's state is as it was."""
    proc = lab.procs.pop("libvirtd")
    proc.kill()
    proc.wait(10)


def qemu_pid(lab: Lab, name: str) -> int:
    return int((lab.root / "run-libvirt" / "qemu" / f"{name}.pid").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def qemu_pids(lab: Lab) -> list[int]:
    """Every QEMU process of this lab (its disks are under the lab root)."""
    found = []
    for pid in lab.pids_using_lab():
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if argv0.endswith(b"qemu-system-x86_64"):
            found.append(pid)
    return found


def power_cut(lab: Lab) -> None:
    """The host goes down hard: agent, libvirtd and every VM killed, /run wiped.

    What survives is what survives a reboot: /etc, /var/lib (the agent's state and
    spool, libvirt's definitions) and the journal (as if it were persistent).
    """
    agent = lab.procs.pop("agent", None)
    if agent is not None:
        agent.kill()
        agent.wait(10)
    kill_libvirtd(lab)
    for pid in qemu_pids(lab):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while qemu_pids(lab) and time.monotonic() < deadline:
        time.sleep(0.05)
    for run in ("run-libvirt", "run-hostagent"):
        for f in (lab.root / run).iterdir():
            shutil.rmtree(f) if f.is_dir() and not f.is_symlink() else f.unlink()


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    """tests.waiting.wait_until, its bound first as the fault tests give it."""
    wait_until(cond, what, timeout=timeout)


def count(lab: Lab, **match: str) -> int:
    """The matching records journald has stored so far: for a count of none, or one
    taken as a starting point. To assert that some were written, `counted`."""
    return len(lab.records(**match))


def counted(lab: Lab, expected: int, timeout: float = 60, **match: str) -> int:
    """The matching records once there are at least `expected` (one bound): the agent
    writes a record after what the test waited for, and journald stores it later still,
    so a count read at once can be short under load."""
    return len(lab.wait_records(expected, timeout, **match))


def wait_lent(lab: Lab, timeout: float = 60) -> None:
    """Until the lendee is lent again: one LENT record more than now or, the first time
    for an agent just started, than before its start (on a busy machine its first lend
    can be over before the caller looks, and would then be waited for twice)."""
    agent = lab.procs.get("agent")
    before = lab.lent_before.pop(agent.pid, None) if agent else None
    if before is None:
        before = count(lab, event="phase", to="lent")
    lab.wait_records(before + 1, timeout, event="phase", to="lent")


def config(lab: Lab, *, relend_delay: str = "1s", guest_agent: str = "60s") -> None:
    lab.write_config(lab.config_text(relend_delay=relend_delay)
                     .replace('guest_agent = "60s"', f'guest_agent = "{guest_agent}"'))



def kill_agent(lab: Lab) -> None:
    assert lab.stop_agent(signal.SIGKILL) == -signal.SIGKILL

