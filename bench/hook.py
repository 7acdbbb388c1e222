"""How much time the qemu hook adds to each libvirt operation.

libvirtd runs the hook synchronously for every domain operation, so its cost is the
interpreter's start plus whatever the hook does. This runs the real hooks/qemu, as
libvirtd does, against an agent that answers, an absent agent (the event is spooled)
and a hung agent (the budget runs out, then the event is spooled), and compares each
with a bare `python -I -S -c pass`.

    python bench/hook.py [--runs 300] [--python /usr/bin/python3] [--markdown FILE]
                         [--attack-runs 200] [--no-lab]

Budgets: with the agent up, p99 within 5 ms of the bare interpreter's p99; with the
agent absent or hung, p99 within the hook's own budget (HOSTAGENT_HOOK_BUDGET, 0.3 s by
default) of the bare interpreter's p99 (the budget starts once the interpreter runs).

Then the real agent, in the lab (its own libvirtd and journald, the lendee lent),
answers the hook idle and while each attack in `ATTACKS` runs: p99 and the events
spooled (the budget ran out first) during each, beside the idle figure. The budget
there: p99 within the hook's budget of the bare interpreter's, and nothing spooled.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.lab.lab import Lab

HOOK = Path(__file__).resolve().parents[1] / "hooks" / "qemu"
UP_BUDGET_MS = 5.0
HOOK_BUDGET_MS = 300.0  # hooks/qemu's default HOSTAGENT_HOOK_BUDGET
# A domain XML about the size of a real gaming VM's (passthrough, disks, NICs).
XML = (
    "<domain type='kvm'><name>gaming1</name><uuid>6f1c2b8e-0000-4000-8000-000000000001</uuid>"
    + "".join(
        f"<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x0000' bus='0x{i:02x}' slot='0x00' function='0x0'/></source></hostdev>"
        for i in range(8)
    )
    + "<devices>"
    + "<disk type='file' device='disk'><source file='/var/lib/x.qcow2'/></disk>" * 20
    + "</devices></domain>\n"
)


def shebang_interpreter(hook: Path) -> list[str]:
    first = hook.read_text().splitlines()[0]
    if not first.startswith("#!"):
        raise SystemExit(f"{hook} has no shebang line")
    return shlex.split(first[2:])


def serve(path: Path, answer: bool) -> Callable[[], None]:
    """A stand-in agent on `path`: answers "proceed", or accepts and never answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    held: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the benchmark is over
            if not answer:
                held.append(conn)
                continue
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                event_id = json.loads(data)["id"]
                reply = {"v": 1, "id": event_id, "verdict": "proceed", "message": ""}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def stop() -> None:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        for conn in held:
            conn.close()

    return stop


@contextmanager
def place() -> Iterator[Path]:
    # Short, so that the socket path fits in sun_path.
    with tempfile.TemporaryDirectory(prefix="hookbench-") as d:
        yield Path(d)


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, input=XML.encode(), capture_output=True, env=env, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0 or done.stdout:
        raise SystemExit(f"{shlex.join(cmd)}: exit {done.returncode}, stdout {done.stdout!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300, help="runs per case (default 300)")
    parser.add_argument("--python", help="interpreter (default: the hook's shebang line)")
    parser.add_argument("--hook", type=Path, default=HOOK, help="the hook script")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    parser.add_argument("--attack-runs", type=int, default=200,
                        help="runs against the real agent, idle and per attack (default 200)")
    parser.add_argument("--no-lab", action="store_true",
                        help="leave out the real agent in the lab, idle and under attack")
    opts = parser.parse_args()
    interpreter = [opts.python, "-I", "-S"] if opts.python else shebang_interpreter(opts.hook)
    hook = [*interpreter, str(opts.hook), "gaming1", "prepare", "begin", "-"]
    bare = [*interpreter, "-c", "pass"]

    with place() as up_dir, place() as absent_dir, place() as hung_dir:
        stop_up = serve(up_dir / "hook.sock", answer=True)
        stop_hung = serve(hung_dir / "hook.sock", answer=False)
        base_env = {"PATH": "/usr/bin:/bin"}
        cases: dict[str, tuple[list[str], dict[str, str]]] = {
            "bare interpreter": (bare, base_env),
        }
        for name, d in [
            ("agent up", up_dir),
            ("agent absent", absent_dir),
            ("agent hung", hung_dir),
        ]:
            env = {**base_env, "HOSTAGENT_SOCKET": str(d / "hook.sock")}
            env["HOSTAGENT_SPOOL"] = str(d / "spool")
            cases[name] = (hook, env)
        times: dict[str, list[float]] = {name: [] for name in cases}
        try:
            for cmd, env in cases.values():  # warm the page cache first
                timed(cmd, env)
            # Interleaved, so that a change in machine load hits every case alike.
            for i in range(opts.runs):
                for name, (cmd, env) in cases.items():
                    times[name].append(timed(cmd, env))
                if (i + 1) % 50 == 0:
                    print(f"{i + 1}/{opts.runs} runs", file=sys.stderr)
        finally:
            stop_up()
            stop_hung()
        spooled = {
            name: len(list((d / "spool").glob("*.json"))) if (d / "spool").is_dir() else 0
            for name, d in [
                ("agent up", up_dir),
                ("agent absent", absent_dir),
                ("agent hung", hung_dir),
            ]
        }

    shown = [*interpreter, os.path.relpath(opts.hook)]
    title = f"hook: {shlex.join(shown)}, {opts.runs} runs per case, {os.cpu_count()} CPUs"
    print(title)
    print(f"spooled: {spooled}")
    rows = {name: summary(ms) for name, ms in times.items()}
    base = rows["bare interpreter"]
    budgets = {"agent up": UP_BUDGET_MS, "agent absent": HOOK_BUDGET_MS,
               "agent hung": HOOK_BUDGET_MS}
    head = ["p50 ms", "p99 ms", "max ms", "p50 ×", "p99 ×", "Δp99 ms", "budget", ""]
    table = []
    for name, (p50, p99, top) in rows.items():
        delta = p99 - base[1]
        budget = budgets.get(name)
        verdict = "" if budget is None else "met" if delta <= budget else "MISSED"
        table.append([name, f"{p50:.1f}", f"{p99:.1f}", f"{top:.1f}", f"{p50 / base[0]:.2f}",
                      f"{p99 / base[1]:.2f}", f"{delta:+.1f}",
                      "" if budget is None else f"Δp99 ≤ {budget:g}", verdict])
    print(f"{'case':18}" + "".join(f"{h:>11}" for h in head))
    for row in table:
        print(f"{row[0]:18}" + "".join(f"{c:>11}" for c in row[1:]))
    if opts.markdown:
        with opts.markdown.open("a") as f:
            f.write(f"\n{title}; spooled per case: {spooled}\n\n")
            f.write("| hook | " + " | ".join(h or "verdict" for h in head) + " |\n")
            f.write("|---" * (len(head) + 1) + "|\n")
            f.writelines("| " + " | ".join(row) + " |\n" for row in table)
    if not opts.no_lab:
        under_attack(interpreter, opts.hook, opts.attack_runs, base[1], opts.markdown)


def summary(seconds: list[float]) -> tuple[float, float, float]:
    ms = [s * 1000 for s in seconds]
    p99 = statistics.quantiles(ms, n=100, method="inclusive")[98] if len(ms) > 1 else ms[0]
    return statistics.median(ms), p99, max(ms)



# --- the real agent, idle and under attack ------------------------------------------------
#
# An attack is a context manager given the lab (reset: no agent, every VM off) and a
# scratch directory: it writes the agent's configuration, starts the agent and waits
# for the lend (`start_lent`), starts the attack, yields a note for the table while the
# hook is timed, then stops the attack. Add one to ATTACKS.

Attack = Callable[["Lab", Path], AbstractContextManager[str]]
ATTACKS: dict[str, Attack] = {}
HOOK_DOMAIN = "bench-vm"  # a domain hostagent does not manage: the agent answers proceed


def attack(name: str) -> Callable[[Attack], Attack]:
    def register(fn: Attack) -> Attack:
        ATTACKS[name] = fn
        return fn
    return register


def start_lent(lab: Lab, extra_config: str = "") -> subprocess.Popen[bytes]:
    """The agent with the lab's configuration plus `extra_config`, once it has lent."""
    lab.write_config(lab.config_text(relend_delay="1s") + extra_config)
    agent = lab.start_agent()
    lab.wait_record(event="phase", to="lent", timeout=120)
    return agent


@contextmanager
def idle(lab: Lab, scratch: Path) -> Iterator[str]:
    start_lent(lab)
    yield "the lendee lent, nothing else happening"


@attack("SSH session flood")
@contextmanager
def ssh_session_flood(lab: Lab, scratch: Path) -> Iterator[str]:
    """A listed status-only key asks for 4,500 sessions on each of its connections, and
    connects again as each is closed (tests/faults/test_ssh_attacks.py)."""
    from tests.faults.helpers import SESSION_FLOOD
    from tests.lab.helpers import free_port, keygen, public

    port = free_port()
    key = keygen(scratch / "dashboard", "dashboard")
    keys = lab.root / "agent" / "authorized_keys"
    keys.parent.mkdir(exist_ok=True)
    keys.write_text(f'verbs="status" {public(key)} dashboard\n')
    keys.chmod(0o600)
    start_lent(lab, f'\n[ssh]\nlisten = "127.0.0.1:{port}"\nauthorized_keys = "{keys}"\n')
    host_key = lab.path("/var/lib/hostagent/ssh_host_ed25519_key.pub")
    known = scratch / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {host_key.read_text()}")
    stats = scratch / "stats"
    flood = subprocess.Popen([sys.executable, "-c", SESSION_FLOOD, str(port), str(key),
                              str(known), "4500", str(stats)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (stats.exists() and int(stats.read_text().split()[0]) >= 3):
            if time.monotonic() > deadline:
                raise SystemExit("bench: the SSH session flood never got going")
            time.sleep(0.1)
        before = [int(n) for n in stats.read_text().split()]
        yield "a listed key, 4,500 sessions asked per connection"
        after = [int(n) for n in stats.read_text().split()]
    finally:
        flood.kill()
        flood.wait()
    print(f"SSH session flood: {after[0] - before[0]} connections, {after[1] - before[1]} "
          "commands run while the hook was timed", file=sys.stderr)


@contextmanager
def in_a_loop(work: Callable[[], None]) -> Iterator[list[int]]:
    """`work` again and again in a thread until the block ends; yields [times done]."""
    done = threading.Event()
    ran = [0]

    def loop() -> None:
        while not done.is_set():
            work()
            ran[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield ran
    finally:
        done.set()
        thread.join(60)


def control(lab: Lab, verb: str, *, hang_up: bool = False, **args: str) -> None:
    """One request on the lab's control socket, as root; read to the end, or hang up
    once the agent said something."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(60)
        s.connect(str(lab.root / "run-hostagent" / "control.sock"))
        s.sendall(json.dumps({"v": 1, "verb": verb, "args": args}).encode() + b"\n")
        while (chunk := s.recv(65536)) and not (hang_up and b"\n" in chunk):
            pass


@attack("slow fsync")
@contextmanager
def slow_fsync(lab: Lab, scratch: Path) -> Iterator[str]:
    """Every fsync of the agent takes a second (an SD card, a busy disk) while its state
    changes every 0.2 s: hold, then lend, each a save (tests/faults/test_load.py)."""
    from tests.faults.helpers import slow_disk

    with slow_disk(lab, 1.0):
        start_lent(lab)

    def change() -> None:
        for verb in ("hold", "resume"):
            control(lab, verb)
            time.sleep(0.1)

    with in_a_loop(change) as ran:
        yield "fsync 1 s, a state change every 0.2 s"
    print(f"slow fsync: {2 * ran[0]} state changes while the hook was timed", file=sys.stderr)


@attack("control flood")
@contextmanager
def control_flood(lab: Lab, scratch: Path) -> Iterator[str]:
    """Root's client gone wrong, twice: malformed lines and verbs naming no VM there is,
    one connection each, in a loop (tests/faults/test_load.py)."""
    start_lent(lab)
    before = len(lab.records(event="control"))

    def flood() -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(lab.root / "run-hostagent" / "control.sock"))
            s.sendall(b"{not json\n")
            while s.recv(65536):
                pass
        control(lab, "release", vm="no-such-vm")
        control(lab, "play", vm="gaming9")

    with in_a_loop(flood) as one, in_a_loop(flood) as two:
        yield "two clients, malformed and unknown-VM requests in a loop"
    records = len(lab.records(event="control")) - before
    print(f"control flood: {3 * (one[0] + two[0])} requests, {records} journal records",
          file=sys.stderr)


@attack("repeated requests")
@contextmanager
def repeated_requests(lab: Lab, scratch: Path) -> Iterator[str]:
    """`play gaming1`, hung up once the agent answers, again and again: its GPU is
    reclaimed from the lendee meanwhile, then it runs (tests/faults/test_load.py)."""
    start_lent(lab)
    with in_a_loop(lambda: control(lab, "play", hang_up=True, vm="gaming1")) as ran:
        # Timed once gaming1 runs: its boot under TCG takes both of a small machine's
        # cores, which no agent can help (the fault row covers the reclaim itself).
        lab.wait_state("gaming1", "running", timeout=120)
        yield "play gaming1 and hang up, in a loop, gaming1 started by the first"
    intents = len(lab.records(event="intent", to="pending", vm="gaming1"))
    print(f"repeated requests: {ran[0]} requests, {intents} intent(s) recorded",
          file=sys.stderr)


@attack("journal flood")
@contextmanager
def journal_flood(lab: Lab, scratch: Path) -> Iterator[str]:
    """Any local user sends forged hostagent records to journald as fast as it can, from
    two processes (tests/faults/test_untrusted.py): the agent writes each of its records
    to the same journald, from its event loop."""
    from tests.faults.helpers import FORGED

    start_lent(lab)
    send = ("import json, sys, systemd.journal as j\nf = json.loads(sys.argv[1])\n"
            "while True:\n    j.send(**f)\n")
    floods = [subprocess.Popen(lab.nsenter("setpriv", "--reuid=65534", "--regid=65534",
                                           "--clear-groups", sys.executable, "-c", send,
                                           json.dumps(FORGED)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for _ in range(2)]
    try:
        yield "two processes of a local user send forged hostagent records in a loop"
    finally:
        for flood in floods:
            flood.kill()
            flood.wait()
    forged = len(lab.journal("_UID=65534", "SYSLOG_IDENTIFIER=hostagent"))
    print(f"journal flood: {forged} forged records in the journal", file=sys.stderr)


def under_attack(interpreter: list[str], hook: Path, runs: int, bare_p99: float,
                 markdown: Path | None) -> None:
    """The hook against the real agent, idle and under each attack."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.lab.lab import Lab, need_lab

    reason = need_lab()
    if reason:
        print(f"bench: no real agent, idle or under attack: {reason}", file=sys.stderr)
        return
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-bench-")))
    cmd = [*interpreter, str(hook), HOOK_DOMAIN, "prepare", "begin", "-"]
    env = {"PATH": "/usr/bin:/bin", "HOSTAGENT_SOCKET": str(lab.hook_socket),
           "HOSTAGENT_SPOOL": str(lab.spool)}
    results: list[tuple[str, str, float, float, float, int]] = []
    try:
        lab.up()
        for name, run in {"idle": idle, **ATTACKS}.items():
            lab.reset()
            with tempfile.TemporaryDirectory(prefix="hostagent-attack-") as d, \
                    run(lab, Path(d)) as note:
                spool_before = len(list(lab.spool.glob("*.json")))
                times = [timed(cmd, env) for _ in range(runs)]
                spooled = len(list(lab.spool.glob("*.json"))) - spool_before
            p50, p99, top = summary(times)
            results.append((name, note, p50, p99, top, spooled))
            print(f"{name}: p99 {p99:.1f} ms, {spooled} spooled", file=sys.stderr)
    finally:
        lab.down()
    idle_p99 = results[0][3]
    head = ["p50 ms", "p99 ms", "max ms", "Δp99 vs idle ms", "spooled", "budget", "verdict",
            "what runs"]
    table = []
    for name, note, p50, p99, top, spooled in results:
        ok = p99 - bare_p99 <= HOOK_BUDGET_MS and spooled == 0
        table.append([name, f"{p50:.1f}", f"{p99:.1f}", f"{top:.1f}",
                      f"{p99 - idle_p99:+.1f}", str(spooled),
                      f"Δp99 ≤ {HOOK_BUDGET_MS:g} of bare, 0 spooled",
                      "met" if ok else "MISSED", note])
    title = (f"hook against the real agent in the lab, {runs} runs per case "
             f"(`{HOOK_DOMAIN} prepare begin`, answered from memory)")
    print(title)
    lines = [["case", *head], *table]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) + 1)]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())
    if markdown:
        with markdown.open("a") as f:
            f.write(f"\n{title}\n\n")
            f.write("| hook, real agent | " + " | ".join(head) + " |\n")
            f.write("|---" * (len(head) + 1) + "|\n")
            f.writelines("| " + " | ".join(row) + " |\n" for row in table)


if __name__ == "__main__":
    main()
