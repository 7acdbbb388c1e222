"""The agent's own costs, measured in the lab: event throughput, a storm of hooks,
footprint at rest, and the import time of `hostagent run`.

    python -m bench.agent [--idle 60] [--events 5000] [--storm 200]

Prints a table of figures and ratios; `--markdown FILE` also writes it as a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.lab.lab import REPO, Lab, need_lab

HOOK = REPO / "hooks" / "qemu"
PYTHON = "/usr/bin/python3"


def hook_line(i: int) -> bytes:
    return json.dumps({"v": 1, "kind": "hook", "id": f"bench-{i}", "time": time.time(),
                       "domain": f"other-{i % 50}", "op": "started", "sub": "begin",
                       "extra": "-", "xml": "<domain/>"}).encode() + b"\n"


async def throughput(sock: Path, events: int, clients: int) -> float:
    """Hook events per second the agent answers, from `clients` concurrent connections."""
    per = events // clients

    async def client(c: int) -> None:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        for i in range(per):
            writer.write(hook_line(c * per + i))
            await writer.drain()
            answer = json.loads(await reader.readline())
            assert answer["verdict"] == "proceed", answer
        writer.close()

    t = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return per * clients / (time.perf_counter() - t)


def storm(lab: Lab, n: int) -> tuple[list[float], int]:
    """n real hook processes at once (`reconnect begin`, as when libvirtd restarts with
    n running domains): each one's wall time, and how many had to spool."""
    spool = lab.spool
    before = len(list(spool.glob("*.json"))) if spool.exists() else 0
    env = {"PATH": "/usr/bin:/bin", "HOSTAGENT_SOCKET": str(lab.hook_socket),
           "HOSTAGENT_SPOOL": str(spool)}
    procs = []
    xml = lab.root / "storm.xml"
    xml.write_text("<domain/>")
    for i in range(n):
        with xml.open("rb") as stdin:  # one file description each: no shared offset
            procs.append((time.perf_counter(), subprocess.Popen(
                [PYTHON, "-I", "-S", str(HOOK), f"storm-{i:03d}", "reconnect", "begin", "-"],
                stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)))
    times = []
    for t, p in procs:
        p.wait()
        times.append(time.perf_counter() - t)
    after = len(list(spool.glob("*.json"))) if spool.exists() else 0
    return times, after - before


def cpu_and_rss(pid: int, seconds: float) -> tuple[float, float]:
    """CPU % of one core over `seconds`, and the resident set in MB at the end."""
    def ticks() -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    hz = os.sysconf("SC_CLK_TCK")
    t0, c0 = time.monotonic(), ticks()
    time.sleep(seconds)
    t1, c1 = time.monotonic(), ticks()
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
                  .splitlines() if line.startswith("VmRSS:"))
    return 100 * (c1 - c0) / hz / (t1 - t0), rss_kb / 1024


def import_time(runs: int = 15) -> tuple[float, float]:
    """Median wall time to import what `hostagent run` imports, and a bare start."""
    venv = str(REPO / ".venv" / "bin" / "python")

    def timed(code: str) -> float:
        t = time.perf_counter()
        subprocess.run([venv, "-c", code], check=True)
        return time.perf_counter() - t
    imports = "import hostagent.cli, hostagent.agent"
    return (statistics.median(timed(imports) for _ in range(runs)),
            statistics.median(timed("pass") for _ in range(runs)))


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", type=float, default=60, help="seconds of idle sampling")
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--storm", type=int, default=200)
    ap.add_argument("--markdown", type=Path)
    opts = ap.parse_args()
    reason = need_lab()
    if reason:
        print(f"bench: {reason}", file=sys.stderr)
        return 1
    lab = Lab(Path(tempfile.mkdtemp(prefix="hostagent-bench-")))
    rows: list[tuple[str, str, str]] = []
    try:
        lab.up()
        lab.reset()
        agent = lab.start_agent()
        lab.wait_record(event="phase", to="lent")
        rate = asyncio.run(throughput(lab.hook_socket, opts.events, clients=20))
        rows.append(("hook events absorbed", f"{rate:,.0f}/s",
                     f"{opts.events} events, 20 concurrent connections"))
        times, spooled = storm(lab, opts.storm)
        rows.append((f"storm: {opts.storm} hooks at once", f"p50 {p(times, .5) * 1000:.0f} ms, "
                     f"p99 {p(times, .99) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms",
                     f"{spooled} spooled, {opts.storm - spooled} answered live; "
                     "times include each interpreter's start on a loaded machine"))
        cpu, rss = cpu_and_rss(agent.pid, opts.idle)
        rows.append((f"agent idle over {opts.idle:g}s", f"{cpu:.2f}% of a core, {rss:.0f} MB RSS",
                     "budget < 0.5% and < 80 MB"))
    finally:
        lab.down()
    imp, bare = import_time()
    rows.append(("import of `hostagent run`", f"{imp * 1000:.0f} ms",
                 f"bare interpreter {bare * 1000:.0f} ms, ratio {imp / bare:.1f}x"))
    width = max(len(r[0]) for r in rows)
    for name, figure, note in rows:
        print(f"{name:<{width}}  {figure:<40}  {note}")
    if opts.markdown:
        with opts.markdown.open("a") as f:
            f.write("\n| measure | figure | note |\n|---|---|---|\n")
            f.writelines(f"| {a} | {b} | {c} |\n" for a, b, c in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
