"""The lab: a private libvirtd, a private journald and real TCG guests.

Everything runs inside one mount namespace held by a sleeping process. In it, tmpfs
covers /run, /var/lib, /var/log and /var/cache, and the lab's own directories are
bound over /etc/libvirt and the few paths libvirtd, journald and hostagent use, so
the machine's own libvirt, journal and /etc are never touched. libvirtd runs hooks
with a scrubbed environment, which is why the hook's *default* paths
(/run/hostagent/hook.sock, /var/lib/hostagent/spool) must be the lab's inside it.

From outside the namespace the lab is reached through its directory: libvirt at
`qemu:///system?socket=<dir>/run-libvirt/libvirt-sock`, the hook socket at
`<dir>/run-hostagent/hook.sock`, the journal with `journalctl -D <dir>/journal`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import libvirt
import libvirt_qemu

from hostagent.surfaces import control
from tests.lab import image, leftovers
from tests.sysfs import FakeSysfs
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
# libvirt reports each error it raises on stderr too, by default: the lab reads errors
# as exceptions (a guest agent not up yet is one, many times a second).
libvirt.registerErrorHandler(lambda _context, _error: None, None)
# libvirt's domain states in `virsh domstate`'s words.
STATES = {0: "no state", 1: "running", 2: "idle", 3: "paused", 4: "in shutdown",
          5: "shut off", 6: "crashed", 7: "pmsuspended"}
HOOK = REPO / "hooks" / "qemu"

# Inside the namespace → directory under the lab root.
BINDS = {
    "/etc/libvirt": "etc-libvirt",
    "/run/libvirt": "run-libvirt",
    "/run/hostagent": "run-hostagent",
    "/run/log/journal": "journal",
    "/var/lib/libvirt": "var-lib-libvirt",
    "/var/lib/hostagent": "var-lib-hostagent",
    "/var/log/libvirt": "log-libvirt",
}
TMPFS = ("/run", "/var/lib", "/var/log", "/var/cache")

LIBVIRTD_CONF = """\
unix_sock_dir = "/run/libvirt"
unix_sock_group = "root"
unix_sock_ro_perms = "0700"
unix_sock_rw_perms = "0700"
auth_unix_ro = "none"
auth_unix_rw = "none"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
"""
# No cgroups, namespaces, security driver or virtlogd: the lab runs in a plain
# container as root, and each of those would need more of the host than we take.
QEMU_CONF = """\
user = "root"
group = "root"
dynamic_ownership = 0
remember_owner = 0
security_driver = "none"
cgroup_controllers = [ ]
namespaces = [ ]
stdio_handler = "file"
"""
JOURNALD_CONF = """\
[Journal]
Storage=volatile
ReadKMsg=no
ForwardToSyslog=no
ForwardToWall=no
ForwardToConsole=no
RateLimitBurst=0
"""

# A lab GPU: a small raw disk. QEMU takes a write lock on it, so a second VM that
# wants it fails to start ("Failed to get "write" lock"), as vfio refuses a busy device.
# Its user alias ua-hostagent-LABEL makes it the GPU's device for `hostagent.core.devices`,
# which leaves it out of the lendee's live definition as it would a <hostdev>.
# gpu-c is owned by nobody, like the GTX 960 of the seeds: always the lendee's.
GPUS = {
    "gpu-a": ("GPU-a0a0a0a0-0000-4000-8000-00000000000a", "Lab RTX 3050 A"),
    "gpu-b": ("GPU-b0b0b0b0-0000-4000-8000-00000000000b", "Lab RTX 3050 B"),
    "gpu-c": ("GPU-c0c0c0c0-0000-4000-8000-00000000000c", "Lab GTX 960 C"),
}
LENDEE = "gpu-node"
# gaming-win owns gpu-a too: a second VM on one card (owners of a card take turns).
OWNERS = {"gaming1": ("gpu-a",), "gaming2": ("gpu-b",), "gaming-win": ("gpu-a",)}

# How long libvirtd may take to answer after a start: about a second when the machine is
# idle, but a start beside other work on 2 cores has taken over 30 s. Past USUAL_WAIT
# its log is printed (the test's output shows what it was doing), and the wait goes on.
LIBVIRTD_PATIENCE = 180.0
USUAL_WAIT = 30.0
# How long a player waits for a game to be up (its guest agent answering) before giving
# up: a reclaim (drain, the lendee's shutdown through its agent, the game's boot) takes
# 10-40 s on an idle machine, and has taken over 90 s beside other work on 2 cores.
PLAYER_PATIENCE = 240.0
DEFERRED = "will start by itself"
# A start refused because the request could not be on disk within the hook's budget (a
# busy machine's slow save): the refusal says to start again, and a player does.
UNRECORDED = "could not record the request"

# The agent's configuration in the lab. Lab GPUs are disks, so their PCI addresses
# are made up, and the lab's fake sysfs (`lab_host`) is the host that has them;
# everything else is what a user writes.
AGENT_CONFIG = """\
[lendee]
domain = "gpu-node"
gpus = ["gpu-a", "gpu-b", "gpu-c"]

[gpus.gpu-a]
pci = "0000:0a:00.0"
functions = ["0000:0a:00.1"]
uuid = "GPU-a0a0a0a0-0000-4000-8000-00000000000a"
name = "Lab RTX 3050 A"

[gpus.gpu-b]
pci = "0000:0b:00.0"
uuid = "GPU-b0b0b0b0-0000-4000-8000-00000000000b"
name = "Lab RTX 3050 B"

[gpus.gpu-c]
pci = "0000:0c:00.0"
uuid = "GPU-c0c0c0c0-0000-4000-8000-00000000000c"
name = "Lab GTX 960 C"

[owners.gaming1]
gpus = ["gpu-a"]

[owners.gaming2]
gpus = ["gpu-b"]

[owners.gaming-win]
gpus = ["gpu-a"]

[timeouts]
guest_agent = "60s"
shutdown = "30s"
start = "60s"
drain = "30s"
ready = "60s"

[policy]
relend_delay = "{relend_delay}"
"""


@dataclass
class Lab:
    root: Path
    cache: Path = REPO / ".lab"
    guest: image.GuestImage | None = None
    host_before: dict[str, object] = field(default_factory=dict)
    mark_us: int = 0
    holder: subprocess.Popen[bytes] | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # The lab's mount namespace (readlink /proc/<holder>/ns/mnt), for `down` to find what
    # runs in it after the holder is gone.
    namespace: str | None = None
    # policy.partial in the configurations below: the product's default, unless a suite
    # that tests other roads sets it off (see tests/faults/conftest.py).
    partial: bool = True
    libvirtd_patience: float = LIBVIRTD_PATIENCE
    # The host's PCI devices as hostagent reads them (a fake sysfs: `lab_host`), and
    # the devices each lab GPU has beside its own disk (label -> names), which move
    # with it as a card's other functions do. A test may change both; reset() restores.
    sysfs: Path = Path()
    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The agent's control group, as systemd would give its unit (`unit_cgroup`).
    cgroup: Path | None = None
    # How many LENT records there were when each agent (by pid) was started: its first
    # lend may be over before a test looks (tests/faults/scenario.py's wait_lent).
    lent_before: dict[int, int] = field(default_factory=dict)
    # What journal() has read of this test's journal (it reads only what is new).
    _journal: list[dict[str, Any]] = field(default_factory=list)
    _journal_seen: set[str] = field(default_factory=set)
    _conn: Any = None  # libvirt, for what the tests poll (see `_libvirt`)

    # ---- paths -----------------------------------------------------------------
    def path(self, inside: str) -> Path:
        """Where a path inside the namespace lives on the host."""
        for mount, name in BINDS.items():
            if inside == mount or inside.startswith(mount + "/"):
                return self.root / name / inside[len(mount):].lstrip("/")
        raise ValueError(f"{inside} is not shared with the lab directory")

    @property
    def uri(self) -> str:
        return f"qemu:///system?socket={self.root}/run-libvirt/libvirt-sock"

    @property
    def hook_socket(self) -> Path:
        return self.root / "run-hostagent" / "hook.sock"

    @property
    def spool(self) -> Path:
        return self.root / "var-lib-hostagent" / "spool"

    # ---- life cycle ---------------------------------------------------------
    def up(self) -> Lab:
        self.host_before = host_fingerprint()
        self.guest = image.build(self.cache)
        self.root.mkdir(parents=True, exist_ok=True)
        leftovers.register(self.root)  # before anything starts: the run's check finds it
        self.sysfs = lab_host(self.root / "sysfs")
        for name in BINDS.values():
            (self.root / name).mkdir(exist_ok=True)
        # QEMU's capabilities take seconds to probe; they are the same for every lab.
        caps = self.cache / "libvirt-cache"
        caps.mkdir(parents=True, exist_ok=True)
        for d in ("gpus", "console", "hooks-log"):
            (self.root / d).mkdir(exist_ok=True)
        etc = self.root / "etc-libvirt"
        (etc / "libvirtd.conf").write_text(LIBVIRTD_CONF)
        (etc / "qemu.conf").write_text(QEMU_CONF)
        (self.root / "journald.conf").write_text(JOURNALD_CONF)
        (etc / "hooks").mkdir(exist_ok=True)
        # The repository's hook itself, not a copy: libvirtd executes the real file.
        hook = etc / "hooks" / "qemu"
        if hook.is_symlink() or hook.exists():
            hook.unlink()
        hook.symlink_to(HOOK)
        self._start_namespace()
        self._start_journald()
        self._start_libvirtd()
        self.reset()
        return self

    def down(self) -> None:
        """Stop every lab process, guests included, whatever a test left: a libvirtd killed
        or hung, a guest or an agent that ignores SIGTERM. The namespace, and so every
        mount, dies with the last of them. Raises if a process outlives a bounded wait."""
        try:
            if self.holder is not None and self.holder.poll() is None and self._libvirtd_alive():
                for dom in self.running():
                    self.virsh("destroy", dom, check=False)
        except Exception as e:  # a lab in any state comes down: what is left is killed below
            print(f"lab: destroying the guests failed ({e}); killing them", file=sys.stderr)
        if self._conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None
        for proc in reversed(list(self.procs.values())):
            _stop(proc)
        self.procs.clear()
        # QEMU guests are libvirtd's, daemonized: they outlive it. Every process the lab
        # started is found by its marks (tests/lab/leftovers.py) and killed.
        left = leftovers.end(self.pids_using_lab())
        if self.holder is not None:
            _stop(self.holder)
            self.holder = None
        left += leftovers.end(self.pids_using_lab())
        remove_cgroup(self.cgroup)
        if left:
            raise RuntimeError("lab: processes outlived SIGKILL: "
                               + "; ".join(leftovers.describe(pid) for pid in left))

    def reset(self) -> None:
        """No agent, every VM off, lab GPUs as new, no agent state or spool: the state
        each test starts from. A libvirtd or journald that a failed test left dead or
        hung is brought back first, so that one failure stays one failure."""
        if "agent" in self.procs:
            _stop(self.procs.pop("agent"))
        self._revive()
        # The journal outlives a test: records() only shows what came after this.
        self.mark_us = time.time_ns() // 1000
        self.lent_before.clear()
        self._journal, self._journal_seen = [], set()
        for dom in self.running():
            self.virsh("destroy", dom, check=False)
        # Hooks a test added (tests/faults' slow hook), removed now that nothing runs one.
        for hook in (self.root / "etc-libvirt" / "hooks" / "qemu.d").glob("fault-*"):
            hook.unlink()
        self.sysfs, self.extra = self.root / "sysfs", {}
        for gpu, (gpu_uuid, name) in GPUS.items():
            self.write_gpu(gpu, f"LABGPU {gpu_uuid} {name}")
        for dom in (LENDEE, *OWNERS):
            self.define(dom)
        # Emptied, not replaced: the namespace's bind mount holds the directory itself.
        for d in (self.root / "var-lib-hostagent", self.root / "agent"):
            d.mkdir(exist_ok=True)
            for f in d.iterdir():
                shutil.rmtree(f) if f.is_dir() else f.unlink()

    def pids_using_lab(self) -> list[int]:
        """The processes the lab started that run (tests/lab/leftovers.py)."""
        return leftovers.lab_pids(self.root, namespace=self.namespace)

    def _start_namespace(self) -> None:
        script = ["set -e"]
        for t in TMPFS:
            script.append(f"mount -t tmpfs -o mode=0755 lab-tmpfs {t}")
        for inside, name in BINDS.items():
            # Mount points are made only inside the tmpfs: never a new directory on the host.
            if any(inside.startswith(t + "/") for t in TMPFS):
                script.append(f"mkdir -p {inside}")
            else:
                script.append(f"test -d {inside} || {{ echo 'missing {inside}'; exit 1; }}")
            script.append(f"mount --bind {self.root / name} {inside}")
        script.append(f"mkdir -p /var/cache/libvirt && mount --bind {self.cache / 'libvirt-cache'} "
                      "/var/cache/libvirt")
        script.append(f"mount --bind {self.root / 'journald.conf'} /etc/systemd/journald.conf"
                      if Path("/etc/systemd/journald.conf").exists() else "true")
        # Debian's libvirtd resolves its compiled-in user libvirt-qemu before it reads
        # qemu.conf: give the namespace its own passwd/group that have it.
        for db, entry in (("passwd", "libvirt-qemu:x:64055:64055::/var/lib/libvirt:/bin/false"),
                          ("group", "libvirt-qemu:x:64055:")):
            text = Path(f"/etc/{db}").read_text()
            if not any(line.startswith("libvirt-qemu:") for line in text.splitlines()):
                text = text.rstrip("\n") + "\n" + entry + "\n"
            (self.root / db).write_text(text)
            script.append(f"mount --bind {self.root / db} /etc/{db}")
        script.append("echo ready")
        # The holder outlives the process that owns the lab only to end it: a test process
        # killed before its teardown leaves no guest, libvirtd or agent behind.
        script.append(f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done")
        script.append(f"exec {sys.executable} -I -S {leftovers.__file__} {self.root}")
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, leftovers.MARKER: str(self.root)})
        assert self.holder.stdout is not None
        with self.holder.stdout:
            ready = self.holder.stdout.readline().strip() == b"ready"
        if not ready:
            raise RuntimeError("could not set up the lab's mount namespace (are you root?)")
        self.namespace = os.readlink(f"/proc/{self.holder.pid}/ns/mnt")

    def nsenter(self, *argv: str) -> list[str]:
        """The command line that runs argv inside the lab's mount namespace."""
        assert self.holder is not None
        return ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", *argv]

    def spawn(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        kw["env"] = {**(kw.get("env") or os.environ), leftovers.MARKER: str(self.root)}
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(self.nsenter(*argv), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, **kw)
        self.procs[name] = proc
        return proc

    def _start_journald(self) -> None:
        journald = next((p for p in ("/lib/systemd/systemd-journald",
                                     "/usr/lib/systemd/systemd-journald") if Path(p).exists()),
                        None)
        if journald is None:
            return
        self.spawn("journald", [journald])
        wait_until(lambda: (self.root / "journal").exists()
                   and any((self.root / "journal").iterdir()), "journald to start", timeout=10)

    def _start_libvirtd(self, log_filters: str = "") -> None:
        # Warnings and errors go to <root>/libvirtd.log; `log_filters` adds the debug
        # messages of some categories, e.g. "1:util.command" (the benchmarks time hooks
        # by it), the rest stays at warnings.
        env = {**os.environ, "LIBVIRT_LOG_OUTPUTS": "1:stderr" if log_filters else "3:stderr"}
        if log_filters:
            env["LIBVIRT_LOG_FILTERS"] = log_filters
        with open(self.root / "libvirtd.log", "ab") as log:
            log.write(f"--- lab: libvirtd started at {time.strftime('%H:%M:%S')}\n".encode())
        self.spawn("libvirtd", ["libvirtd", "--config", "/etc/libvirt/libvirtd.conf"], env=env)
        self._wait_libvirtd()

    def _wait_libvirtd(self) -> None:
        """Until libvirtd answers. Past `USUAL_WAIT` its log is printed and the wait goes
        on, up to `libvirtd_patience`; one that exits or never answers raises, with its
        log (TimeoutError: it still runs)."""
        proc = self.procs["libvirtd"]
        start = time.monotonic()
        told = False
        while not self._libvirtd_alive():
            waited = time.monotonic() - start
            if proc.poll() is not None:
                raise RuntimeError(f"libvirtd exited with status {proc.returncode} after "
                                   f"{waited:.0f}s; its log:\n{self.libvirtd_log()}")
            if waited > self.libvirtd_patience:
                raise TimeoutError(f"libvirtd did not answer within {waited:.0f}s; its log:"
                                   f"\n{self.libvirtd_log()}")
            if waited > USUAL_WAIT and not told:
                told = True
                print(f"lab: libvirtd has not answered for {waited:.0f}s (a busy machine?); "
                      f"waiting up to {self.libvirtd_patience:g}s. Its log so far:\n"
                      f"{self.libvirtd_log()}", file=sys.stderr, flush=True)
            time.sleep(0.2)

    def libvirtd_log(self, lines: int = 40) -> str:
        """The end of what libvirtd wrote: its stderr and its log file."""
        out = []
        for f in (self.root / "libvirtd.log", self.root / "log-libvirt" / "libvirtd.log"):
            if f.exists():
                tail = f.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"{f}:\n" + "\n".join(f"  {line}" for line in tail))
        return "\n".join(out) or "(libvirtd wrote nothing)"

    def _libvirtd_alive(self) -> bool:
        # A hung libvirtd accepts connections and answers nothing: bound the call.
        try:
            return self.virsh("version", check=False, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _revive(self) -> None:
        """Bring back a journald that is dead, a libvirtd that is dead or never answers."""
        journald = self.procs.get("journald")
        if journald is not None and journald.poll() is not None:
            print("lab: journald had exited; starting it again", file=sys.stderr, flush=True)
            self._start_journald()
        proc = self.procs.get("libvirtd")
        if proc is not None and proc.poll() is None:
            try:
                self._wait_libvirtd()
                return
            except (TimeoutError, RuntimeError) as e:
                print(f"lab: {e}\nlab: starting libvirtd again", file=sys.stderr, flush=True)
        elif proc is not None:
            print(f"lab: libvirtd had exited (status {proc.returncode}); starting it again. "
                  f"Its log:\n{self.libvirtd_log()}", file=sys.stderr, flush=True)
        else:
            print("lab: libvirtd was left stopped; starting it again", file=sys.stderr,
                  flush=True)
        self.stop_libvirtd()
        self._start_libvirtd()

    def restart_libvirtd(self, *, log_filters: str = "") -> None:
        self.stop_libvirtd()
        self.start_libvirtd(log_filters=log_filters)

    def stop_libvirtd(self) -> None:
        """Stop libvirtd (running guests stay up); `start_libvirtd` brings it back."""
        proc = self.procs.pop("libvirtd", None)
        if proc is not None:
            _stop(proc)

    def start_libvirtd(self, *, log_filters: str = "") -> None:
        """Start libvirtd unless it runs, and wait for its answer."""
        proc = self.procs.get("libvirtd")
        if proc is None or proc.poll() is not None:
            self.procs.pop("libvirtd", None)
            self._start_libvirtd(log_filters)

    # ---- the agent ----------------------------------------------------------
    @property
    def config(self) -> Path:
        # Under the lab root, which the namespace shares: /etc stays the machine's.
        return self.root / "agent" / "config.toml"

    def config_text(self, *, relend_delay: str = "2s", kubeconfig: Path | None = None) -> str:
        """The lab's agent configuration; with `kubeconfig`, the Kubernetes steps too."""
        text = AGENT_CONFIG.format(relend_delay=relend_delay)
        if not self.partial:
            text = text.replace("[policy]\n", "[policy]\npartial = false\n")
        if kubeconfig is not None:
            text += f'\n[kubernetes]\nkubeconfig = "{kubeconfig}"\nevict_retry = "1s"\n'
        return text

    def write_config(self, text: str | None = None, *, relend_delay: str = "2s",
                     kubeconfig: Path | None = None) -> Path:
        self.config.parent.mkdir(exist_ok=True)
        text = text if text is not None else self.config_text(
            relend_delay=relend_delay, kubeconfig=kubeconfig)
        if "hotplug =" not in text:
            # The lab's lendee can hot-plug (libvirt gives each disk a root port), and the
            # default would take that road; the lab's tests of the restart pin it.
            text = text.replace("[policy]\n", '[policy]\nhotplug = "none"\n', 1)
        self.config.write_text(text)
        return self.config

    def start_agent(self, *args: str) -> subprocess.Popen[bytes]:
        """`hostagent run` inside the lab, as systemd would start it: in the control group
        of its unit, which journald names in each record (`hostagent history` reads only
        those)."""
        if not self.config.exists():
            self.write_config()
        argv = [str(REPO / ".venv" / "bin" / "hostagent"), "--config", str(self.config),
                "--sysfs", str(self.sysfs), *args, "run"]
        group = self.cgroup = unit_cgroup()
        if group is not None:  # joined before the agent's first record: sh execs it
            argv = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv]
        lent = len(self.records(event="phase", to="lent"))
        proc = self.spawn("agent", argv, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lent_before[proc.pid] = lent
        wait_until(lambda: proc.poll() is not None or self.agent_ready(), "the agent", timeout=30)
        return proc

    def log_lines(self) -> list[str]:
        """hostagent's log lines in the journal since the test began: its messages that
        are not records (no HOSTAGENT_EVENT), oldest first."""
        return [str(e.get("MESSAGE", "")) for e in self.journal("SYSLOG_IDENTIFIER=hostagent")
                if "HOSTAGENT_EVENT" not in e]

    def agent_ready(self) -> bool:
        return any(e.get("HOSTAGENT_RESULT") == "ready" and
                   int(e.get("_PID", 0)) == self.procs["agent"].pid for e in self.journal())

    def stop_agent(self, sig: int = signal.SIGTERM) -> int:
        proc = self.procs.pop("agent")
        proc.send_signal(sig)
        return proc.wait(30)

    def hostagent(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The CLI, run inside the lab (its control socket is the lab's)."""
        return subprocess.run(self.nsenter(str(REPO / ".venv" / "bin" / "hostagent"),
                                           "--config", str(self.config),
                                           "--sysfs", str(self.sysfs), *args),
                              capture_output=True, text=True, timeout=60, check=False)

    def records(self, **match: str) -> list[dict[str, Any]]:
        """hostagent's journal records, optionally filtered on HOSTAGENT_* fields."""
        out = []
        for e in self.journal("SYSLOG_IDENTIFIER=hostagent"):
            if int(e["__REALTIME_TIMESTAMP"]) >= self.mark_us and all(e.get(f"HOSTAGENT_{k.upper()}") == v for k, v in match.items()):
                out.append(e)
        return out

    def wait_record(self, timeout: float = 60, **match: str) -> dict[str, Any]:
        """The first journal record matching, once it is there."""
        return self.wait_records(1, timeout, **match)[0]

    def wait_records(self, count: int, timeout: float = 60, **match: str) -> list[dict[str, Any]]:
        """The journal records matching, once there are at least `count`: the agent writes
        a record after the change libvirt already shows, and journald stores it later still."""
        try:
            wait_until(lambda: len(self.records(**match)) >= count,
                       f"{count} journal record(s) with {match}", timeout=timeout, every=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}; phases so far: {self.phases()}") from None
        return self.records(**match)

    def phases(self) -> list[str]:
        """The lendee's phase transitions so far, as 'from>to'."""
        return [f"{e['HOSTAGENT_FROM']}>{e['HOSTAGENT_TO']}" for e in self.records(event="phase")]

    # ---- domains ------------------------------------------------------------
    def gpu_image(self, gpu: str) -> Path:
        return self.root / "gpus" / f"{gpu}.img"

    def write_gpu(self, gpu: str, first_line: str) -> None:
        """What the guest's stand-in nvidia-smi will read off this GPU's disk."""
        data = (first_line + "\n").encode().ljust(1 << 20, b"\0")
        self.gpu_image(gpu).write_bytes(data)

    def define(self, name: str, *, agent_delay: float = 0,
               gpus: tuple[str, ...] | None = None) -> None:
        """(Re)define a lab domain: the lendee takes every lab GPU, an owner its own,
        each with its extra devices; `gpus`: those instead (a lendee of several)."""
        gpus = gpus if gpus is not None else OWNERS.get(name, tuple(sorted(GPUS)))
        assert self.guest is not None, "define() needs the lab up"
        images = []
        for gpu in gpus:
            images.append(self.gpu_image(gpu))
            for extra in self.extra.get(gpu, ()):
                # Not a GPU to the guest's nvidia-smi: another function of the card.
                self.write_gpu(f"{gpu}-{extra}", f"LABFUNCTION {gpu} {extra}")
                images.append(self.gpu_image(f"{gpu}-{extra}"))
        xml = domain_xml(name, self.guest, images,
                         console=self.root / "console" / f"{name}.log",
                         agent_delay=agent_delay)
        f = self.root / f"{name}.xml"
        f.write_text(xml)
        self.virsh("define", str(f))

    def virsh(self, *args: str, check: bool = True,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(["virsh", "-c", self.uri, *args], capture_output=True, text=True,
                              timeout=timeout)
        if (args[:1] == ("shutdown",) and proc.returncode != 0
                and "End of file from agent socket" in proc.stderr):
            # The guest powered off before its agent could answer guest-shutdown:
            # the shutdown was delivered. Say so, as virsh would have on success.
            proc = subprocess.CompletedProcess(proc.args, 0, proc.stdout, "")
        if check and proc.returncode != 0:
            raise RuntimeError(f"virsh {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def running(self) -> list[str]:
        """The running domains, in the order of their ids (as `virsh list`); none while
        libvirtd does not answer."""
        try:
            domains = self._libvirt(
                lambda c: c.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE))
        except RuntimeError:
            return []
        return [d.name() for d in sorted(domains, key=lambda d: d.ID())]

    def state(self, name: str) -> str:
        """The domain's state in `virsh domstate`'s words."""
        return STATES.get(self._libvirt(lambda c: c.lookupByName(name).state()[0]), "unknown")

    def _libvirt(self, call: Callable[[Any], T]) -> T:
        """`call` on the lab's libvirt connection, in this process: the tests poll states
        and guest agents many times a second, and a virsh process for each poll (about 20
        ms of CPU) in three labs at once took a good share of 2 cores. A connection that
        died (libvirtd restarted) is opened again, once; any other error is raised as
        virsh's would be."""
        for attempt in (1, 2):
            try:
                if self._conn is None:
                    self._conn = libvirt.open(self.uri)
                return call(self._conn)
            except libvirt.libvirtError as e:
                alive = self._conn is not None and self._conn.isAlive() == 1
                if alive or attempt == 2:
                    raise RuntimeError(f"libvirt: {e}") from None
                with contextlib.suppress(libvirt.libvirtError):
                    if self._conn is not None:
                        self._conn.close()
                self._conn = None
        raise AssertionError("unreachable")

    def wait_state(self, name: str, state: str, timeout: float = 60) -> None:
        wait_until(lambda: self.state(name) == state, f"{name} to be {state}", timeout=timeout)

    # ---- a player ------------------------------------------------------------
    def play(self, owner: str, *, up: bool = False,
             asks: int = 3) -> subprocess.CompletedProcess[str]:
        """`virsh start owner` as a player does it, and the wait for the game (`wait_game`).

        A refusal that is no deferral (another owner holds the card) is returned at once,
        for the test to read. Otherwise the player waits, and asks again, up to `asks`
        times in all, only when nothing is coming: the game is off and the agent holds
        no request for it (it failed the start; asking again is how a player retries).
        Returns the first answer."""
        first = self.ask(owner)
        if first.returncode != 0 and DEFERRED not in first.stderr:
            return first
        deadline = time.monotonic() + PLAYER_PATIENCE
        for ask in range(asks):
            if ask:
                self.ask(owner)
            if self.wait_game(owner, up=up, deadline=deadline,
                              give_up_when_idle=ask < asks - 1):
                break
        return first

    def ask(self, owner: str, *, tries: int = 3) -> subprocess.CompletedProcess[str]:
        """`virsh start owner`, started again (as the refusal says to) while the agent
        could not record the request in time, up to `tries` times in all."""
        for _ in range(tries - 1):
            answer = self.virsh("start", owner, check=False)
            if answer.returncode == 0 or UNRECORDED not in answer.stderr:
                return answer
            time.sleep(1)
        return self.virsh("start", owner, check=False)

    def wait_game(self, owner: str, *, up: bool = False, deadline: float | None = None,
                  give_up_when_idle: bool = False) -> bool:
        """Wait until `owner` runs (with `up`, until its guest agent answers too: the game
        is on screen), within one deadline for the agent's work and the boot:
        `PLAYER_PATIENCE` from now unless given. With `give_up_when_idle`, returns False
        as soon as the game is off and the agent holds no request for it."""
        deadline = deadline if deadline is not None else time.monotonic() + PLAYER_PATIENCE
        idle_checked = time.monotonic()
        while time.monotonic() < deadline:
            if self.state(owner) == "running":
                if not up or self.agent(owner, "guest-ping", timeout=2) is not None:
                    return True
            elif give_up_when_idle and time.monotonic() - idle_checked > 3:
                idle_checked = time.monotonic()
                if not self._requested(owner) and self.state(owner) != "running":
                    return False
            time.sleep(0.2)
        raise TimeoutError(f"{owner} not {'up' if up else 'running'} within "
                           f"{PLAYER_PATIENCE:g}s; state {self.state(owner)}, "
                           f"phases {self.phases()}")

    def status(self) -> dict[str, Any]:
        """What `hostagent status --json` prints, asked over the control socket from this
        process: waits ask for it many times, and the CLI costs a Python start each time
        (about 0.3 s of CPU)."""
        reply = list(control.request(self.path("/run/hostagent/control.sock"), "status"))[-1]
        assert reply.get("ok"), reply
        data: dict[str, Any] = reply["data"]
        return data

    def _requested(self, owner: str) -> bool:
        """Whether the agent still holds a request to start `owner`: its last record of
        one is not an answer (none yet: the agent has not journaled the ask)."""
        asked = self.records(event="intent", vm=owner)
        return not asked or asked[-1].get("HOSTAGENT_TO") == "pending"

    def agent(self, name: str, command: str | dict[str, Any],
              timeout: float = 10) -> Any:
        """The guest agent's answer to `command` (its name, or the whole command), or None
        if it does not answer."""
        ask = json.dumps({"execute": command} if isinstance(command, str) else command)
        try:
            out = self._libvirt(lambda c: libvirt_qemu.qemuAgentCommand(
                c.lookupByName(name), ask, int(timeout), 0))
        except RuntimeError:
            return None
        return json.loads(out)["return"]

    def wait_agent(self, name: str, timeout: float = 60) -> None:
        wait_until(lambda: self.agent(name, "guest-ping", timeout=2) is not None,
                   f"{name}'s guest agent", timeout=timeout)

    def guest_exec(self, name: str, path: str, *args: str, timeout: float = 20) -> GuestResult:
        """Run a program in the guest through its agent and wait for it."""
        cmd = {"execute": "guest-exec",
               "arguments": {"path": path, "arg": list(args), "capture-output": True}}
        started = self.agent(name, cmd)
        if started is None:
            raise RuntimeError(f"{name}'s guest agent did not run {path}")
        status = {"execute": "guest-exec-status", "arguments": {"pid": started["pid"]}}
        deadline = time.monotonic() + timeout
        while True:
            ret = self.agent(name, status)
            if ret is None:
                raise RuntimeError(f"{name}'s guest agent stopped answering about {path}")
            if ret["exited"]:
                return GuestResult(ret.get("exitcode", -1),
                                   base64.b64decode(ret.get("out-data", "")).decode(),
                                   base64.b64decode(ret.get("err-data", "")).decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not exit in {name} within {timeout:g}s")
            time.sleep(0.1)

    def console(self, name: str) -> str:
        f = self.root / "console" / f"{name}.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def wait_console(self, name: str, text: str, timeout: float = 60) -> None:
        wait_until(lambda: text in self.console(name), f"{text!r} on {name}'s console",
                   timeout=timeout)

    # ---- journal ------------------------------------------------------------
    def journal(self, *match: str) -> list[dict[str, Any]]:
        """The lab journal's entries since the test began (`mark_us`) that match each
        `FIELD=value` given (as journalctl's matches: several values of one field, any;
        several fields, all). Read incrementally: each call asks journalctl only for the
        entries journald wrote after the last one read (its cursor), where reading the
        whole journal at every poll of every wait cost more CPU the longer a lab process
        ran; from the mark again, repeats dropped, if the cursor is gone."""
        command = ["journalctl", "-D", str(self.root / "journal"), "-o", "json", "--no-pager"]
        out = subprocess.run(command + (
            [f"--after-cursor={self._journal[-1]['__CURSOR']}"] if self._journal else
            [f"--since=@{self.mark_us / 1e6:.6f}"]), capture_output=True, text=True, check=False)
        if out.returncode != 0 and self._journal:
            out = subprocess.run(command + [f"--since=@{self.mark_us / 1e6:.6f}"],
                                 capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                if entry["__CURSOR"] not in self._journal_seen:
                    self._journal_seen.add(entry["__CURSOR"])
                    self._journal.append(entry)
        wanted: dict[str, set[str]] = {}
        for m in match:
            field_, _, value = m.partition("=")
            wanted.setdefault(field_, set()).add(value)
        return [e for e in self._journal
                if all(isinstance(e.get(f), str) and e[f] in values
                       for f, values in wanted.items())]


def unit_cgroup(unit: str = "hostagent.service") -> Path | None:
    """A control group that journald names `unit` in each record, made in the
    hierarchy it reads (the unified one); None where there is none to write to.

    It lies under a slice of the lab's own, never under the machine's system.slice,
    where a real hostagent.service may run: journald skips every `.slice` at the top
    of the path, so the records still say `_SYSTEMD_UNIT=unit`. `remove_cgroup` takes
    it away with the lab."""
    for top in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if (top / "cgroup.procs").exists() and not (top / "cgroup.clone_children").exists():
            group = top / f"hostagent-lab-{os.getpid()}.slice" / unit
            try:
                group.mkdir(parents=True, exist_ok=True)
            except OSError:
                return None
            return group
    return None


def remove_cgroup(group: Path | None) -> None:
    """Remove the group and its lab slice, once no process is left in them."""
    if group is None:
        return
    for path in (group, group.parent):
        try:
            path.rmdir()
        except OSError:
            return


@dataclass(frozen=True)
class GuestResult:
    exitcode: int
    stdout: str
    stderr: str


def host_fingerprint() -> dict[str, object]:
    """What the lab must never change on the machine: libvirt's and hostagent's
    system paths, the user database and journald's configuration."""
    seen: dict[str, object] = {}
    for top in ("/etc/libvirt", "/run/libvirt", "/var/lib/libvirt", "/var/log/libvirt",
                "/run/hostagent", "/var/lib/hostagent", "/etc/hostagent", "/etc/passwd",
                "/etc/group", "/etc/systemd/journald.conf", "/run/systemd/journal"):
        p = Path(top)
        paths = [p, *sorted(p.rglob("*"))] if p.is_dir() else [p]
        for f in paths:
            try:
                st = f.lstat()
            except OSError:
                seen[str(f)] = None
                continue
            seen[str(f)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
    return seen


def domain_xml(name: str, guest: image.GuestImage, gpus: list[Path], *, console: Path,
               agent_delay: float = 0) -> str:
    # no_timer_check: at boot the kernel checks that the timer's interrupts arrive within a
    # few ticks and panics if not ("IO-APIC + timer doesn't work!"), which a TCG guest on
    # a loaded host can fail (in loaded runs, guests died seconds into their boot).
    disks = "\n".join(
        f"""    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='{img}'/>
      <target dev='vd{chr(ord("b") + i)}' bus='virtio'/>
      <serial>{img.stem}</serial>
      <alias name='ua-hostagent-{img.stem}'/>
    </disk>""" for i, img in enumerate(gpus))
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <uuid>{uuid.uuid5(uuid.NAMESPACE_DNS, name + ".lab.hostagent")}</uuid>
  <memory unit='MiB'>192</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{guest.kernel}</kernel>
    <initrd>{guest.initrd}</initrd>
    <cmdline>console=ttyS0 quiet panic=-1 no_timer_check hostagent.agent_delay={agent_delay:g}</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
{disks}
    <channel type='unix'>
      <target type='virtio' name='org.qemu.guest_agent.0'/>
    </channel>
    <serial type='file'>
      <source path='{console}' append='on'/>
      <target port='0'/>
    </serial>
    <console type='file'>
      <source path='{console}' append='on'/>
      <target type='serial' port='0'/>
    </console>
    <video><model type='vga'/></video>
    <graphics type='vnc' socket='/run/libvirt/{name}-vnc.sock'/>
    <memballoon model='none'/>
  </devices>
</domain>
"""


def lab_host(root: Path) -> Path:
    """The host the lab configuration describes, as sysfs: gpu-a a card with its audio
    function, gpu-b and gpu-c one function each, every card in an IOMMU group of its
    own, all on vfio-pci. Built once per lab."""
    if not root.exists():
        host = FakeSysfs(root)
        host.gpu("0a", group="10").gpu("0b", group="11", audio=False)
        host.gpu("0c", group="12", audio=False)
    return root


def _stop(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def need_lab() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the lab needs root (mount namespaces, libvirtd)"
    for tool in ("libvirtd", "virsh", "qemu-system-x86_64", "unshare", "nsenter", "cpio"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (run `make setup`)"
    return None


def main(argv: list[str]) -> int:
    """A lab by hand, up until Ctrl-C (or SIGTERM), then down: nothing of it is left
    running."""
    reason = need_lab()
    if reason:
        print(f"lab: {reason}", file=sys.stderr)
        return 1
    lab = Lab(Path(argv[0]) if argv else REPO / ".lab" / "manual")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    # SIGINT too: a lab started in the background by a script inherits it ignored.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    try:
        lab.up()
        print(f"lab up: {lab.uri}\n"
              f"  virsh -c '{lab.uri}' list --all\n"
              f"  journalctl -D {lab.root / 'journal'}\n"
              f"  nsenter --mount=/proc/{lab.holder.pid if lab.holder else '?'}/ns/mnt  "
              "(a shell inside the lab's mount namespace)\n"
              "Ctrl-C (or SIGTERM) takes it down.", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        lab.down()
        print("lab down", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
