"""`hostagent history`: the transitions read back from the journal, and who held each GPU.

The agent writes one journal record per transition (see `hostagent.host.journal`); the
lendee's phase records and the owners' start/stop records each carry
``HOSTAGENT_HOLDERS`` (``gpu-a=gpu-node,gpu-b=-``): who holds every GPU right after
that transition. That is enough to rebuild, afterwards and without the agent, how long
each GPU was lent (held by the lendee), gaming (held by an owner) or idle, and how long
each swap from the lendee to an owner took.

`build` is pure: journal records (dicts as ``journalctl -o json`` prints them) in, a
`History` out. `read_journal` is the only I/O, through journalctl itself, so that
``--since`` and ``--until`` take exactly what ``journalctl`` takes ("1h ago", "today",
"2025-01-31 20:00", "@1738353600").

Only the service's own records count: ``SYSLOG_IDENTIFIER`` and the ``HOSTAGENT_*``
fields are whatever the sender wrote, and any local user can send a record with them
(``logger``, ``systemd-cat``). Journald itself adds the fields that start with an
underscore from what the kernel says of the sender; the service's unit
(``_SYSTEMD_UNIT``, from its control group) and root (``_UID=0``) are asked for.

What the journal cannot say is not guessed: a holder lasts until the next record that
says otherwise (or the end of the window), and time before the first record is not
counted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from hostagent.core.text import clean

__all__ = [
    "History",
    "HistoryError",
    "Segment",
    "Swap",
    "Transition",
    "build",
    "format_table",
    "parse_holders",
    "read_journal",
    "span",
    "to_json",
    "trusted",
    "until_time",
]

UNIT = "hostagent.service"  # systemd/hostagent.service, and the NixOS module's

TRANSITION_EVENTS = ("phase", "owner")
READ_EVENTS = (*TRANSITION_EVENTS, "intent")  # intents: who was waiting, for swaps
KINDS = ("lent", "gaming", "idle")


class HistoryError(Exception):
    """The journal could not be read; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Transition:
    at: float  # unix time
    event: str  # "phase" (the lendee) or "owner"
    vm: str
    from_: str
    to: str
    duration: float | None  # seconds spent in `from_`, when known
    result: str
    cause: str | None
    message: str
    holders: Mapping[str, str | None] | None  # after this transition; None: not recorded


@dataclass(frozen=True, kw_only=True)
class Segment:
    start: float
    end: float
    holder: str | None  # None: idle
    kind: str  # "lent", "gaming" or "idle"

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class Swap:
    """A GPU going from the lendee to an owner that asked for it: from the owner's request
    (the hook deferred its start, or `hostagent play`) to the owner holding it."""

    gpu: str
    owner: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, kw_only=True)
class History:
    start: float | None  # the first record's time; None when there is none
    end: float
    lendee: str | None  # the first lendee seen
    transitions: list[Transition]
    # Every lendee seen (the VMs of phase records), first seen first: with several
    # (`[lendees.NAME]`), a GPU any of them holds is lent.
    lendees: tuple[str, ...] = ()
    gpus: dict[str, list[Segment]] = field(default_factory=dict)
    swaps: list[Swap] = field(default_factory=list)

    def totals(self, gpu: str) -> dict[str, float]:
        """Seconds `gpu` spent lent, gaming and idle."""
        out = dict.fromkeys(KINDS, 0.0)
        for seg in self.gpus.get(gpu, []):
            out[seg.kind] += seg.duration
        return out


def parse_holders(text: str) -> dict[str, str | None]:
    """``gpu-a=gpu-node,gpu-b=-`` → {"gpu-a": "gpu-node", "gpu-b": None}."""
    out: dict[str, str | None] = {}
    for pair in text.split(","):
        gpu, sep, vm = pair.strip().partition("=")
        if sep and gpu:
            out[gpu] = None if vm in ("", "-") else vm
    return out


def _float(value: object) -> float | None:
    try:
        return float(str(value))
    except ValueError:
        return None


def _transition(rec: Mapping[str, Any]) -> Transition | None:
    event = rec.get("HOSTAGENT_EVENT")
    at = _float(rec.get("__REALTIME_TIMESTAMP", ""))
    if event not in TRANSITION_EVENTS or at is None:
        return None
    ms = _float(rec.get("HOSTAGENT_DURATION_MS", ""))
    holders = rec.get("HOSTAGENT_HOLDERS")
    cause = rec.get("HOSTAGENT_CAUSE")

    def field(name: str, limit: int = 200) -> str:  # printed later: cleaned as it comes in
        return clean(_text(rec.get(name, "")), limit)

    return Transition(
        at=at / 1e6, event=str(event), vm=field("HOSTAGENT_VM"), from_=field("HOSTAGENT_FROM"),
        to=field("HOSTAGENT_TO"), duration=None if ms is None else ms / 1000,
        result=field("HOSTAGENT_RESULT"),
        cause=None if cause is None else field("HOSTAGENT_CAUSE"),
        message=clean(_text(rec.get("MESSAGE", ""))),
        holders=parse_holders(field("HOSTAGENT_HOLDERS", 4000)) if isinstance(holders, str)
        else None)


def _text(value: object) -> str:
    """A journal field's text: journalctl prints one that is not valid UTF-8 as a list
    of bytes."""
    if isinstance(value, list):
        try:
            return bytes(value).decode(errors="replace")
        except (TypeError, ValueError):
            return ""
    return str(value)


def trusted(rec: Mapping[str, Any], unit: str = UNIT) -> bool:
    """Whether journald says `rec` came from root in the service's unit."""
    return rec.get("_SYSTEMD_UNIT") == unit and rec.get("_UID") == "0"


def build(records: Iterable[Mapping[str, Any]], *, until: float | None = None,
          unit: str = UNIT) -> History:
    """The history in journal `records` (journalctl's JSON objects), up to `until`
    (default: the last record), from the records of root in `unit` only. No side
    effects."""
    ordered = sorted((r for r in records if trusted(r, unit)),
                     key=lambda r: int(r.get("__REALTIME_TIMESTAMP", 0)))
    pairs = [(r, _transition(r)) for r in ordered]
    # Owner records carry no duration: it is the time since that VM's previous record.
    last_seen: dict[str, float] = {}
    for i, (r, t) in enumerate(pairs):
        if t is None:
            continue
        if t.duration is None and t.vm in last_seen:
            pairs[i] = (r, replace(t, duration=t.at - last_seen[t.vm]))
        last_seen[t.vm] = t.at
    transitions = [t for _, t in pairs if t is not None]
    if not transitions:
        return History(start=None, end=until or time.time(), lendee=None, transitions=[])
    lendees = tuple(dict.fromkeys(t.vm for t in transitions if t.event == "phase" and t.vm))
    lendee = lendees[0] if lendees else None
    end = max(until if until is not None else transitions[-1].at, transitions[-1].at)

    def kind(holder: str | None) -> str:
        return "idle" if holder is None else "lent" if holder in lendees else "gaming"

    current: dict[str, tuple[float, str | None]] = {}  # gpu → (since, holder)
    segments: dict[str, list[Segment]] = {}
    swaps: list[Swap] = []
    asked: dict[str, _Asked] = {}  # intent id → who asked when, until that owner runs
    from_lendee: set[str] = set()  # GPUs the lendee held last, and nobody since
    for rec, t in pairs:
        if t is None:
            _intent(rec, asked)
            continue
        for gpu, holder in (t.holders or {}).items():
            if gpu not in current:
                current[gpu] = (t.at, holder)
                segments[gpu] = []
                continue
            since, was = current[gpu]
            if was == holder:
                continue
            if t.at > since:
                segments[gpu].append(Segment(start=since, end=t.at, holder=was, kind=kind(was)))
            current[gpu] = (t.at, holder)
            if holder is not None and kind(holder) == "gaming" and (
                    was in lendees or gpu in from_lendee):
                waits = [a.at for a in asked.values() if a.owner == holder]
                if waits:
                    swaps.append(Swap(gpu=gpu, owner=holder, start=min(waits), end=t.at))
            if was in lendees and holder is None:
                from_lendee.add(gpu)
            else:
                from_lendee.discard(gpu)
        if t.event == "owner" and t.to == "running":
            for iid in [i for i, a in asked.items() if a.owner == t.vm and a.done]:
                del asked[iid]
    for gpu, (since, holder) in current.items():
        if end > since:
            segments[gpu].append(Segment(start=since, end=end, holder=holder, kind=kind(holder)))
    return History(start=transitions[0].at, end=end, lendee=lendee, transitions=transitions,
                   gpus=dict(sorted(segments.items())), swaps=swaps, lendees=lendees)


@dataclass
class _Asked:
    owner: str
    at: float
    done: bool = False


def _intent(rec: Mapping[str, Any], asked: dict[str, _Asked]) -> None:
    """Keep `asked` up to date with an intent record."""
    if rec.get("HOSTAGENT_EVENT") != "intent":
        return
    iid, owner = rec.get("HOSTAGENT_INTENT"), rec.get("HOSTAGENT_VM")
    at = _float(rec.get("__REALTIME_TIMESTAMP", ""))
    if not isinstance(iid, str) or not isinstance(owner, str) or at is None:
        return
    to = rec.get("HOSTAGENT_TO")
    if to == "pending":
        asked.setdefault(iid, _Asked(owner, at / 1e6))
    elif to == "done" and iid in asked:
        # The agent records "done" just before the owner's own start record: keep it
        # until that record has been seen.
        asked[iid].done = True
    else:
        asked.pop(iid, None)


def until_time(text: str, *, now: float) -> float | None:
    """The unix time of a ``--until`` value in its simple forms ("now", "@UNIXTIME",
    "YYYY-MM-DD[ HH:MM[:SS]]", local time); None for the rest of journalctl's syntax,
    which only journalctl knows exactly (the history then ends at its last record)."""
    text = text.strip()
    if text == "now":
        return now
    if text.startswith("@"):
        return _float(text[1:])
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


# ---- reading the journal ---------------------------------------------------------------

def read_journal(*, since: str | None = None, until: str | None = None,
                 directory: Path | None = None, journalctl: str = "journalctl",
                 unit: str = UNIT) -> list[dict[str, Any]]:
    """hostagent's transition records, oldest first, through journalctl (`directory`:
    read the journal files there, as ``journalctl -D``): those root wrote from `unit`."""
    exe = shutil.which(journalctl)
    if exe is None:
        raise HistoryError("journalctl is not installed: the history is read from the journal")
    argv = [exe, "-o", "json", "--no-pager", "-q"]
    if directory is not None:
        argv += ["-D", str(directory)]
    if since:
        argv += ["--since", since]
    if until:
        argv += ["--until", until]
    # Same field twice: either value; different fields: both must match.
    argv += [f"_SYSTEMD_UNIT={unit}", "_UID=0", "SYSLOG_IDENTIFIER=hostagent",
             *(f"HOSTAGENT_EVENT={e}" for e in READ_EVENTS)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise HistoryError(f"journalctl failed: {out.stderr.strip() or out.returncode}")
    records = []
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


# ---- output ----------------------------------------------------------------------------

def span(seconds: float) -> str:
    """A duration for people: 0.8s, 42s, 4m10s, 2h05m."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    rows = [tuple(clean(c, None) for c in r) for r in rows]  # cleaned again as printed
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _holders_text(holders: Mapping[str, str | None] | None) -> str:
    if holders is None:
        return ""
    return " ".join(f"{g}={vm or '-'}" for g, vm in holders.items())


def format_table(h: History) -> str:
    """Each transition with how long the state it left lasted, then the time per GPU."""
    if not h.transitions:
        return "no transitions in the journal for this period"
    rows: list[tuple[str, ...]] = [("TIME", "VM", "CHANGE", "AFTER", "RESULT", "HOLDERS")]
    for t in h.transitions:
        rows.append((_clock(t.at), t.vm, f"{t.from_} → {t.to}",
                     "-" if t.duration is None else span(t.duration), t.result or "-",
                     _holders_text(t.holders)))
    lines = _table(rows)
    assert h.start is not None
    total = h.end - h.start
    lines += ["", f"per GPU, {_clock(h.start)} to {_clock(h.end)} ({span(total)}):"]
    rows = [("GPU", "LENT", "GAMING", "IDLE", "SWAPS")]
    for gpu in h.gpus:
        totals = h.totals(gpu)
        swaps = [s for s in h.swaps if s.gpu == gpu]
        rows.append((gpu, *(_share(totals[k], total) for k in KINDS),
                     f"{len(swaps)}" + (f" ({', '.join(span(s.duration) for s in swaps)})"
                                        if swaps else "")))
    lines += _table(rows)
    return "\n".join(lines)


def _share(seconds: float, total: float) -> str:
    return f"{span(seconds)} ({100 * seconds / total:.0f}%)" if total > 0 else span(seconds)


def to_json(h: History) -> dict[str, Any]:
    return {
        "start": h.start,
        "end": h.end,
        "lendee": h.lendee,
        "lendees": list(h.lendees),
        "transitions": [
            {"at": t.at, "time": _clock(t.at), "event": t.event, "vm": t.vm,
             "lendee": t.vm if t.event == "phase" else None, "from": t.from_,
             "to": t.to, "duration_s": t.duration, "result": t.result, "cause": t.cause,
             "holders": None if t.holders is None else dict(t.holders), "message": t.message}
            for t in h.transitions],
        "gpus": {
            gpu: {**{f"{k}_s": round(v, 3) for k, v in h.totals(gpu).items()},
                  "segments": [{"start": s.start, "end": s.end, "holder": s.holder,
                                "kind": s.kind} for s in segs]}
            for gpu, segs in h.gpus.items()},
        "swaps": [{"gpu": s.gpu, "owner": s.owner, "start": s.start, "end": s.end,
                   "duration_s": round(s.duration, 3)} for s in h.swaps],
    }
