"""`hostagent play`, `release` and `reclaim`: send the request, show its progress.

On a terminal, one line that updates in place: the current step, the time elapsed and
what the agent waits for. Otherwise (a pipe, a log, a script), one plain line per step.
``--json`` prints the agent's replies as they come, one JSON object a line.

Exit status: 0 done (gaming1 runs, is off, the GPUs are free); 1 the request failed
(the reason on stderr) or the agent could not be reached; 3 ``--timeout`` ran out,
which only stops the waiting: the agent goes on (a `play` still starts the VM); 130
interrupted, likewise.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from hostagent.surfaces.control import ControlError, ControlTimeout, request
from hostagent.core.text import clean

__all__ = ["TIMED_OUT", "follow", "format_reply"]

TIMED_OUT = 3
INTERRUPTED = 130
_TICK = 0.5  # how often the terminal line's clock moves

Reply = dict[str, Any]


def format_reply(reply: Reply) -> str:
    """A progress line or a result as text, for a log, a pipe or an SSH client.

    What the agent says may quote a guest, the API server or a journal: every line is
    cleaned as it is printed (`hostagent.core.text`)."""
    if "ok" not in reply:
        elapsed = reply.get("elapsed_s")
        line = f"[{elapsed:6.1f}s] " if isinstance(elapsed, int | float) else ""
        line += str(reply.get("message", ""))
        if reply.get("waiting"):
            line += f" (waiting for {reply['waiting']})"
        return clean(line, None)
    if not reply["ok"]:
        return f"error: {clean(reply.get('error'), None)}"
    data = reply.get("data") or {}
    if "lendee" in data:
        table = format_status(data)
        return f"{clean(data['message'], None)}\n\n{table}" if "message" in data else table
    return clean(data.get("message", "ok"), None)


class _Line:
    """One terminal line redrawn in place: step, clock, what it waits for."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.step: Reply | None = None
        self.seen_at = 0.0

    def show(self, reply: Reply) -> None:
        self.step, self.seen_at = reply, time.monotonic()
        self.draw()

    def draw(self) -> None:
        if self.step is None:
            return
        elapsed = float(self.step.get("elapsed_s") or 0.0) + time.monotonic() - self.seen_at
        text = f"[{elapsed:5.0f}s] {self.step.get('message', '')}"
        if self.step.get("waiting"):
            text += f" - waiting for {self.step['waiting']}"
        text = clean(text, None)
        width = max(20, shutil.get_terminal_size().columns - 1)
        if len(text) > width:
            text = text[:width - 1] + "…"
        self.out.write("\r\033[K" + text)
        self.out.flush()

    def clear(self) -> None:
        if self.step is not None:
            self.out.write("\r\033[K")
            self.out.flush()
            self.step = None


def follow(path: Path, verb: str, args: dict[str, Any], *, json_lines: bool = False,
           timeout: float | None = None, out: TextIO = sys.stdout,
           err: TextIO = sys.stderr) -> int:
    """Run one streaming request against the control socket; the exit status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    line = _Line(out) if not json_lines and out.isatty() else None
    try:
        for reply in request(path, verb, args, timeout=None, deadline=deadline,
                             idle=_TICK if line else None,
                             on_idle=line.draw if line else None):
            result = reply.get("type") == "result"
            if json_lines:
                print(json.dumps(reply, separators=(",", ":")), file=out, flush=True)
            elif not result and line is not None:
                line.show(reply)
            elif not result:
                print(format_reply(reply), file=out, flush=True)
            if not result:
                continue
            if line is not None:
                line.clear()
            if reply.get("ok"):
                if not json_lines:
                    print(format_reply(reply), file=out, flush=True)
                return 0
            print(f"hostagent: {clean(reply.get('error'), None)}", file=err)
            return 1
    except ControlTimeout as e:
        if line is not None:
            line.clear()
        ran_out = deadline is not None and time.monotonic() >= deadline
        why = f"after {timeout:g}s (--timeout)" if ran_out else f"({e})"
        print(f"hostagent: {_stopped(verb, args, why)}", file=err)
        return TIMED_OUT
    except KeyboardInterrupt:
        if line is not None:
            line.clear()
        print(f"hostagent: {_stopped(verb, args, 'on request')}", file=err)
        return INTERRUPTED
    except ControlError as e:
        if line is not None:
            line.clear()
        print(f"hostagent: {e}", file=err)
        return 1
    return 1  # not reached: request() ends with a result or raises


def _stopped(verb: str, args: dict[str, Any], why: str) -> str:
    goes_on = {"play": f"{args.get('vm')} still starts by itself",
               "release": f"the shutdown of {args.get('vm')} goes on",
               "reclaim": "the reclaim goes on"}.get(verb, "the request goes on")
    return f"stopped waiting {why}; {goes_on}: follow it with `hostagent status`"


def format_status(data: dict[str, Any]) -> str:
    """The status verb's reply as text; each line cleaned as it is printed (the reason
    and the check's summary quote the guest and the API server)."""
    lendee = data["lendee"]
    since = time.time() - lendee["since"]
    lines = [f"lendee {lendee['domain']}: {lendee['phase']} for {_age(since)}"
             + (" (lending on hold)" if lendee["hold"] else "")]
    if lendee["reason"]:
        lines.append(f"  reason: {lendee['reason']}")
    if lendee.get("lent"):
        lines.append(f"  runs with {', '.join(lendee['lent'])}")
    cluster = data.get("cluster") or {}
    if cluster.get("gpu_api_from"):
        lines.append(f"  its node's GPUs are served by {cluster.get('gpu_api')}: "
                     f"{cluster['gpu_api_from']}")
    if cluster.get("waiting"):
        lines.append(f"  its return is waiting for {cluster['waiting']}")
    if cluster.get("cordoned_for"):
        lines.append(f"  its node is cordoned {clean(cluster['cordoned_for'], 200)}: it takes "
                     "no new pod (drain.cordon_ahead)")
    holders = cluster.get("holders")
    if holders:
        lines.append("  its node's pods hold " + ", ".join(
            f"{gpu} ({pods})" for gpu, pods in sorted(holders.items())))
    if lendee.get("changes"):
        why = f" ({lendee['changes_why']})" if lendee.get("changes_why") else ""
        lines.append(f"  its GPUs change {lendee['changes']}{why}")
    if lendee.get("regrow_waiting"):
        lines.append("  would take the GPUs freed since, once no pod on its node uses a GPU")
    checked = data.get("verified")
    if checked:
        lines.append(f"  GPUs checked in the guest {_age(time.time() - checked['at'])} ago: "
                     + ("ok" if checked["ok"] else "MISMATCH") + f" ({checked['summary']})")
    if data.get("relend_in_s") is not None:
        lines.append(f"  lending again in {_age(data['relend_in_s'])}")
    for other in data.get("lendees", [])[1:]:  # several lendees: each other's own line
        lines.append(f"lendee {clean(other['domain'], 64)}: {other['phase']} for "
                     f"{_age(time.time() - other['since'])}"
                     + (" (lending on hold)" if other["hold"] else "")
                     + (f", runs with {', '.join(other['lent'])}" if other.get("lent") else ""))
        if other["reason"]:
            lines.append(f"  reason: {other['reason']}")
        if other.get("relend_in_s") is not None:
            lines.append(f"  lending again in {_age(other['relend_in_s'])}")
    rows: list[tuple[str, ...]] = [("GPU", "NAME", "PCI", "OWNERS", "HELD BY")]
    for g in data["gpus"]:
        rows.append(tuple(clean(c, None) for c in (
            g["gpu"], g["name"] or "-", _functions(g["pci"], g.get("functions", [])),
            ", ".join(g["owners"]) or "-", g["holder"] or "nobody")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    groups = sorted({tuple(sorted([g["gpu"], *g["moves_with"]]))
                     for g in data["gpus"] if g.get("moves_with")})
    for group in groups:
        lines.append(f"{' and '.join(group)} share an IOMMU group: lent and reclaimed together")
    lines += _not_lent(data["gpus"])
    lines.append("")
    if data["intents"]:
        lines.append("waiting to start:")
        for i in data["intents"]:
            lines.append(f"  {i['owner']} (asked via {i['source']}, {_age(i['age_s'])} ago)")
    else:
        lines.append("nothing waiting to start")
    for r in data.get("reservations", ()):
        held = ("its GPUs held for it now" if r["holding"] else
                f"its GPUs taken back from {_clock(r['evict_at'])}" if r.get("evict_at")
                else "the pods on its GPUs not told yet")
        every = f" (every {r['every']})" if r.get("every") else ""
        lines.append(f"reserved: {r['vm']} at {_clock(r['at'])}{every} by {r['by']}: {held}; "
                     f"unused, it expires at {_clock(r['expires_at'])}")
    if not data.get("libvirt_connected", True):
        lines.append("libvirt: NOT connected (reconnecting)")
    failed = [c for c in data.get("health", []) if not c["ok"]]
    if failed:
        lines.append("")
        lines.append("failed checks:")
        lines += [f"  {c['check']}: {c['detail']}" for c in failed]
    elif data.get("health"):
        lines.append(f"health: {len(data['health'])} checks pass")
    if data.get("version"):
        lines.append(f"hostagent {data['version']}")
    return "\n".join(clean(line, None) for line in lines)


def _not_lent(gpus: list[dict[str, Any]]) -> list[str]:
    """Why each idle GPU is not lent, by the reason's name and in words
    (`hostagent.core.idle`); a status without it (an older agent's) says nothing."""
    lines = []
    for g in gpus:
        why = g.get("not_lent")
        if why:
            until = why.get("until")
            when = f" (in {_age(until - time.time())})" if until is not None else ""
            lines.append(f"{g['gpu']} is not lent ({why['reason']}): {why['words']}{when}")
    return lines


def _clock(at: float) -> str:
    """A time on the host's clock, with its date when it is not today."""
    when = datetime.fromtimestamp(at)
    return when.strftime("%H:%M" if when.date() == datetime.now().date() else "%a %d %b %H:%M")


def _functions(pci: str, functions: list[str]) -> str:
    """``0000:01:00.0+.1+.2+.3``: a GPU's address and the functions that move with it
    (those of its own slot by function number)."""
    slot = pci.rsplit(".", 1)[0]
    return pci + "".join(f"+.{f.rsplit('.', 1)[1]}" if f.rsplit(".", 1)[0] == slot
                         else f"+{f}" for f in functions)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
