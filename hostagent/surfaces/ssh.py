"""The SSH endpoint: a home-automation button asks hostagent to start a game.

    ssh -i button_key -p 2222 hostagent@host play gaming1

runs the control verb ``play`` for gaming1, streams its progress to the client as text
lines and exits 0 once gaming1 runs. It replaces the script a button used to call over
SSH, where the waiting lived and the bugs did (a ``sudo`` hidden by ``PATH``, a
kubeconfig only root could read): here there is no shell, no sudo and no script.

Security model
--------------
- Off unless the configuration has an ``[ssh]`` section.
- Public-key authentication only, against ``ssh.authorized_keys``; no password,
  keyboard-interactive, host-based or certificate authentication. The user name is
  not checked (write ``hostagent@``); the key decides everything.
- A connection opens one session, which runs one command line (an ``exec`` request),
  as ``ssh host verb`` does, and nothing else: a second session, shell, pty,
  subsystems (SFTP), SCP, X11, agent and port forwarding are all refused, and a
  connection refused `MAX_REFUSALS` times is closed. A session that asked for a
  terminal runs nothing (``ssh -tt`` would not wait for it).
- The command line is never given to a shell. It is at most `MAX_COMMAND` characters of
  printable ASCII, split on single spaces into a verb and at most one VM name
  (``[A-Za-z0-9_.-]+``), and for ``reserve`` its time (``reserve gaming1 20:00``) or
  ``cancel``; or ``hold``, ``resume``, ``lend`` or ``reclaim`` with ``--lendee NAME``,
  one lendee where several lend (`hostagent.surfaces.ssh_command`); anything else is
  refused before anything happens.
- Each key may use only the verbs and VMs its line lists.
- Every connection, key, command and decision is one journal record
  (``HOSTAGENT_EVENT=ssh``, with ``HOSTAGENT_KEY``, ``HOSTAGENT_FINGERPRINT``,
  ``HOSTAGENT_PEER`` and ``HOSTAGENT_RESULT``). What happens before a key is accepted
  (a connection, an unknown key, a connection that ends without one) is recorded
  `PREAUTH_BURST` times per `PREAUTH_INTERVAL` seconds, then summarised in one record:
  anyone can connect, and a flood must not flood the journal. What each address's
  connections do after that (a key offered, authenticated, a command, its end) is
  recorded `PEER_BURST` times per `PEER_INTERVAL` seconds per network (its /24 or /64,
  as for the connections below: one host may have a whole /64), the rest counted
  in one "suppressed" record: past journald's own rate limit, the agent's transitions
  would be dropped with the flood.

Floods
------
The endpoint shares the agent's process, its descriptors and its event loop with the
hook socket: no flood may starve it, from strangers or from a listed key.

- At most `MAX_CONNECTIONS` connections are served at once. Of those, at most
  `MAX_UNAUTHENTICATED` have not authenticated yet, and at most `MAX_PER_PREFIX` of
  them come from one /24 (IPv4) or /64 (IPv6), where one host has many addresses.
  Over a limit, a connection that has not authenticated is closed for the new one: of
  the network that holds the most, a stranger's (no listed key offered) before one
  that offered a listed key (public keys are no secret), both before those from an
  address a key holder has authenticated from; then from the addresses that had spent
  the most of their eviction budget when they came, of the address that holds the
  most, the oldest. An address may have `EVICT_BURST` connections closed for its own,
  then one per `EVICT_EVERY` seconds (over that, its newcomer is refused), and gets
  one back each time a key holder of it authenticates:
  whoever holds connections open without authenticating, and reconnects at once, from
  one address or from many of a /24, closes its own and cannot lock a button out.
  A connection has `LOGIN_TIMEOUT` seconds to authenticate.
- One key holds at most `MAX_PER_KEY` authenticated connections; one more is
  disconnected. An authenticated connection that runs no command for `IDLE_TIMEOUT`
  seconds is closed.
- At most `MAX_RUNNING` commands run at once over SSH, every key together; one more
  gets exit status 75 and "busy" at once. Nor can a connection multiply its command:
  one session each (above), a second refused, and after `MAX_REFUSALS` refusals the
  connection is closed, so thousands of channels asked on one connection cost a few.

Authorized keys
---------------
OpenSSH's ``authorized_keys`` format, one key per line, ``#`` for comments. The
options field says what the key may do::

    verbs="play,release,status",vms="gaming1" ssh-ed25519 AAAAC3Nza... kitchen-button
    verbs="status" ssh-ed25519 AAAAC3Nza... dashboard
    verbs="*",vms="*" ssh-ed25519 AAAAC3Nza... admin

- ``verbs="..."`` (required): the verbs the key may use, comma-separated, or ``*``.
- ``vms="..."``: the VMs it may name (``play``, ``release`` and ``reserve`` name one),
  or ``*`` for every owner VM. Without it the key may use no verb that names a VM.
- ``cancel-any`` among the verbs (not a command): the key may cancel or replace a
  reservation someone else made; without it, only the reservations it made itself.
- ``restrict``, ``no-pty``, ``no-port-forwarding``, ``no-agent-forwarding``,
  ``no-X11-forwarding`` and ``no-user-rc`` are accepted and change nothing: hostagent
  grants none of those to any key.
- Any other option (``command=``, ``from=``, ``environment=``...) is an error, and so
  is a line that is not a public key: the file is refused whole, naming the line.
  Refusing beats granting something the line did not mean.
- The comment names the key in the journal, next to its SHA256 fingerprint.

The file, and every directory above it, must be owned by root (or by the user the
agent runs as) and not be writable by group or others (as sshd's StrictModes); it is
read through one descriptor opened without following a link (`hostagent.host.trusted`), so
a link flipped between the check and the read grants nothing. It is read when the
endpoint starts and read again at a connection when it changed; while it is missing or
broken, every key is refused (and the journal says why) until it is fixed: no restart
is needed.

The host key is ``ssh.host_key`` (default ``<state_dir>/ssh_host_ed25519_key``). If the
file does not exist at start (or is empty: no key was ever served from it), an ed25519
key is created (mode 0600, with the public half in ``<file>.pub``), written atomically
and durably, and its fingerprint journaled; add the ``.pub`` line to the client's
known_hosts. An existing key is never replaced: one that cannot be read, or that group
or others may read (as OpenSSH refuses it), stops the endpoint with the fix.

`serve` raises `Transient` when the address cannot be listened on (taken, or not yet
configured at boot): the caller retries it later. Other `EndpointError`s need a person.

Exit status carried back to the client: 0 done; 1 the verb failed (the reason is the
last line on stderr); 64 the command line is malformed; 77 the key may not do that;
75 too many commands are running over SSH, try again; 70 the agent failed
unexpectedly.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import asyncssh

from hostagent.host import journal
from hostagent.surfaces.control import CANCEL_ANY, Caller, serving
from hostagent.surfaces.follow import format_reply
from hostagent.core.ratelimit import Summarised
from hostagent.core.text import clean
from hostagent.surfaces.ssh_command import (
    MAX_COMMAND,
    VM_VERBS,
    BadCommand,
    lendee_args,
    parse_command,
    reserve_args,
)
from hostagent.surfaces.ssh_keys import (
    EndpointError,
    Grant,
    KeysError,
    _KeyFile,
    load_host_key,
    parse_authorized_keys,
)

__all__ = [
    "LOGIN_TIMEOUT",
    "MAX_COMMAND",
    "IDLE_TIMEOUT",
    "EVICT_BURST",
    "EVICT_EVERY",
    "MAX_CONNECTIONS",
    "MAX_PER_KEY",
    "MAX_PER_PREFIX",
    "MAX_REFUSALS",
    "MAX_RUNNING",
    "MAX_UNAUTHENTICATED",
    "VM_VERBS",
    "BadCommand",
    "Endpoint",
    "EndpointError",
    "ExitStatus",
    "Grant",
    "KeysError",
    "Transient",
    "load_host_key",
    "parse_authorized_keys",
    "parse_command",
    "prefix",
    "reserve_args",
    "serve",
]

Reply = dict[str, Any]
VerbHandler = Callable[[dict[str, Any]], AsyncIterator[Reply]]

MAX_CONNECTIONS = 32  # served at once
MAX_UNAUTHENTICATED = 16  # of those, not yet authenticated
MAX_PER_PREFIX = 4  # of those, from one /24 or /64
MAX_PER_KEY = 4  # authenticated connections of one key
MAX_RUNNING = 8  # commands running at once over SSH, every key together
MAX_REFUSALS = 3  # requests refused on one connection before it is closed
LOGIN_TIMEOUT = 5.0  # seconds to authenticate (a button does it in well under one)
IDLE_TIMEOUT = 30.0  # seconds an authenticated connection may run no command
ACCEPT_BACKLOG = 8  # the listen queue, and asyncio's batch of accepts
PREAUTH_BURST = 20  # records before authentication, per interval, then a summary
PREAUTH_INTERVAL = 60.0
PEER_BURST = 200  # records of one network's connections, per interval, then a summary
PEER_INTERVAL = 10.0
MAX_PEERS = 256  # networks (or addresses) counted apart (the oldest forgotten first)
EVICT_BURST = 1  # strangers one address may have closed to make room for its own,
EVICT_EVERY = 5.0  # then one more each this many seconds


class ExitStatus(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 64  # sysexits EX_USAGE: the command line is malformed
    SOFTWARE = 70  # EX_SOFTWARE: the agent failed
    TEMPFAIL = 75  # EX_TEMPFAIL: busy, try again
    NOPERM = 77  # EX_NOPERM: the key may not do that


class Transient(EndpointError):
    """The endpoint cannot start now but may later (the port is taken, the address is
    not configured yet): retry with backoff rather than stop."""


# --- the server --------------------------------------------------------------------------


def prefix(address: str) -> str:
    """The network `address` counts in: its /24 (IPv4, mapped ones too) or its /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class Endpoint:
    """What every connection shares: the verbs, the keys, the journal, the limits."""

    def __init__(self, verbs: Mapping[str, VerbHandler], keys: Path, *,
                 lendees: tuple[str, ...] = (),
                 max_connections: int = MAX_CONNECTIONS,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_per_prefix: int = MAX_PER_PREFIX, max_per_key: int = MAX_PER_KEY,
                 max_running: int = MAX_RUNNING, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.verbs = verbs
        self.names = frozenset(verbs)
        self.lendees = lendees  # the names --lendee may give
        self.keys = _KeyFile(keys, self.names | {CANCEL_ANY})  # a grant, not a command
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_per_prefix = max_per_prefix
        self.max_per_key = max_per_key
        self.max_running = max_running
        self.idle_timeout = idle_timeout
        self.live: set[_Connection] = set()
        # Not authenticated yet, oldest first: one of them makes room for a newcomer
        # over a limit (see _victim; the login timeout bounds how long each waits).
        self.waiting: dict[_Connection, None] = {}
        self.per_key: dict[str, int] = {}  # fingerprint → authenticated connections
        self.running = 0  # commands running
        self.preauth = Summarised(self._preauth_record, interval=PREAUTH_INTERVAL,
                                  burst=PREAUTH_BURST)
        self.per_peer: dict[str, Summarised] = {}
        self.evictions: dict[str, tuple[float, float]] = {}  # address → (budget, when)
        self.known: dict[str, None] = {}  # addresses key holders authenticated from

    def budget(self, address: str) -> float:
        """The evictions `address` may still cause now (a token bucket)."""
        budget, then = self.evictions.get(address, (EVICT_BURST, 0.0))
        return min(EVICT_BURST, budget + (time.monotonic() - then) / EVICT_EVERY)

    def _may_evict(self, address: str) -> bool:
        """Spend one of `address`'s evictions, if it has one left."""
        budget = self.budget(address)
        self.evictions.pop(address, None)
        self.evictions[address] = (budget - 1 if budget >= 1 else budget, time.monotonic())
        if len(self.evictions) > MAX_PEERS:
            del self.evictions[next(iter(self.evictions))]
        return budget >= 1

    def refund(self, address: str) -> None:
        """A key holder of `address` got in: what it spent to make room is given back,
        and its address's strangers are closed for others' after everyone else's."""
        self.known.pop(address, None)
        self.known[address] = None
        if len(self.known) > MAX_PEERS:
            del self.known[next(iter(self.known))]
        if address in self.evictions:
            self.evictions[address] = (min(EVICT_BURST, self.budget(address) + 1),
                                       time.monotonic())

    def say(self, address: str, message: str, **fields: Any) -> None:
        """One record of what `address`'s connections did, within its network's rate
        (one host may have a whole /64)."""
        network = prefix(address)
        limit = self.per_peer.get(network)
        if limit is None:
            if len(self.per_peer) >= MAX_PEERS:
                self.per_peer.pop(next(iter(self.per_peer))).flush()
            limit = self.per_peer[network] = Summarised(
                lambda text, count, reasons: journal.record(
                    "ssh", f"{network}: {text}", result="suppressed", count=count,
                    peer=network, priority=journal.Priority.NOTICE),
                interval=PEER_INTERVAL, burst=PEER_BURST, what="records suppressed")
        if limit.allow(str(fields.get("result", ""))):
            journal.record("ssh", message, **fields)

    @staticmethod
    def _preauth_record(message: str, count: int, reasons: dict[str, int]) -> None:
        if count == 1:
            [result] = reasons
            journal.record("ssh", message, result=result,
                           priority=journal.Priority.WARNING if result in ("refused", "evicted")
                           else journal.Priority.INFO)
        else:
            journal.record("ssh", f"before authentication: {message}", result="summary",
                           count=count, priority=journal.Priority.WARNING)

    def admit(self, conn: _Connection) -> str | None:
        """Count a new connection; None, or why it is refused. Over a limit on
        strangers, one of them is closed to make room: the oldest of whoever holds the
        most (by network, then by address), so that one host that keeps reconnecting
        closes its own connections, never those of another address."""
        if len(self.live) >= self.max_connections and not self.waiting:
            return f"{len(self.live)} authenticated connections already (the limit)"
        same = [c for c in self.waiting if c.prefix == conn.prefix]
        full = len(same) >= self.max_per_prefix or len(self.waiting) >= self.max_unauthenticated \
            or len(self.live) >= self.max_connections
        conn.standing = int(self.budget(conn.address))
        conn.known = conn.address in self.known
        if full and not self._may_evict(conn.address):
            # Each eviction lets its victim reconnect and evict in turn: unbudgeted,
            # strangers from many addresses of a /24 closed one another faster than a
            # button could offer its key, and it was closed too, the oldest waiting.
            return (f"{conn.address} has had {EVICT_BURST} connections closed for its own "
                    f"lately; {len(self.waiting)} waiting to authenticate, "
                    f"{len(same)} of them from {conn.prefix}")
        if len(same) >= self.max_per_prefix:
            self._evict(_victim(same, conn), f"{len(same)} connections from {conn.prefix} "
                        "were waiting to authenticate (the limit)")
        elif len(self.waiting) >= self.max_unauthenticated:
            self._evict(_victim(list(self.waiting), conn), f"{len(self.waiting)} connections "
                        "were waiting to authenticate (the limit)")
        elif len(self.live) >= self.max_connections:
            self._evict(_victim(list(self.waiting), conn), f"{len(self.live)} connections "
                        "were open (the limit)")
        self.live.add(conn)
        self.waiting[conn] = None
        return None

    def _evict(self, old: _Connection, why: str) -> None:
        self.gone(old)
        self.preauth(f"closed the connection from {old.peer}, the oldest waiting to "
                     f"authenticate, for a newer one: {why}", "evicted")
        old.close()

    def vouched(self, conn: _Connection) -> None:
        """`conn` offered a listed key: it is closed for a newcomer after the strangers
        (a listed public key is no secret: it still waits to sign, and counts)."""
        conn.vouched = True

    def authenticated(self, conn: _Connection, fingerprint: str) -> str | None:
        """Count `conn` as its key's; None, or why it must be closed."""
        self.waiting.pop(conn, None)
        held = self.per_key.get(fingerprint, 0)
        if held >= self.max_per_key:
            return f"this key already holds {held} connections (the limit)"
        self.per_key[fingerprint] = held + 1
        return None

    def gone(self, conn: _Connection) -> None:
        """Forget `conn` (closed, or being closed); once only."""
        if conn not in self.live:
            return
        self.live.discard(conn)
        self.waiting.pop(conn, None)
        if conn.counted is not None:
            left = self.per_key.get(conn.counted, 0) - 1
            if left > 0:
                self.per_key[conn.counted] = left
            else:
                self.per_key.pop(conn.counted, None)

    async def run(self, grant: Grant, peer: str, command: str | None,
                  out: Callable[[str], None], err: Callable[[str], None]) -> ExitStatus:
        """Check and run one command line; the exit status for the client."""
        shown = repr(command[:MAX_COMMAND + 16]) if command is not None else "(a shell)"
        address = peer.rsplit(":", 1)[0]
        fields: dict[str, Any] = {"key": grant.comment, "fingerprint": grant.fingerprint,
                                  "peer": peer}
        try:
            verb, vm = parse_command(command, self.names, self.lendees)
        except BadCommand as e:
            self.say(address, f"refused command {shown} from {grant.comment} at {peer}: "
                           f"{e}", result="refused", command=shown, **fields,
                           priority=journal.Priority.WARNING)
            err(f"hostagent: refused: {e}\n")
            return ExitStatus.USAGE
        denied = grant.may(verb, vm)
        if denied is not None:
            self.say(address, f"denied {shown} to {grant.comment} at {peer}: {denied}",
                           vm=vm, result="denied", command=shown, **fields,
                           priority=journal.Priority.WARNING)
            err(f"hostagent: denied: {denied}\n")
            return ExitStatus.NOPERM
        if self.running >= self.max_running:
            busy = f"{self.running} commands are running over SSH already (the limit)"
            self.say(address, f"refused {shown} to {grant.comment} at {peer}: {busy}",
                           vm=vm, result="busy", command=shown, **fields,
                           priority=journal.Priority.WARNING)
            err(f"hostagent: busy: {busy}; try again shortly\n")
            return ExitStatus.TEMPFAIL
        self.say(address, f"{grant.comment} at {peer} runs {shown}", vm=vm,
                       result="allowed", command=shown, **fields)
        status = ExitStatus.SOFTWARE
        caller = Caller(user=grant.comment, via="ssh", peer=peer, fingerprint=grant.fingerprint,
                        cancel_any=grant.may(CANCEL_ANY, vm) is None)
        self.running += 1
        try:
            # The verb runs in this task: it names its caller with control.current_caller().
            with serving(caller):
                args = ({"vm": vm} if vm else lendee_args(command or "")) | (
                    reserve_args(command or "") if verb == "reserve" else {})
                async for reply in self.verbs[verb](args):
                    text = format_reply(reply) + "\n"
                    if "ok" not in reply:
                        out(text)
                        continue
                    if reply["ok"]:
                        out(text)
                        status = ExitStatus.OK
                    else:
                        err(f"hostagent: {reply.get('error')}\n")
                        status = ExitStatus.FAILED
                    break
        except asyncio.CancelledError:
            self.say(address, f"{grant.comment} at {peer} hung up during {shown}; what "
                           "it started goes on", vm=vm, result="hung-up", command=shown,
                           **fields)
            raise
        except Exception as e:  # a bug in a verb must not take the server down
            logging.getLogger("hostagent").exception("ssh: %s failed", shown)
            err(f"hostagent: agent error: {e}\n")
            status = ExitStatus.SOFTWARE
        finally:
            self.running -= 1
        self.say(address, f"{shown} for {grant.comment} at {peer} ended with exit "
                       f"status {int(status)}", vm=vm, result="ok" if status == 0 else "failed",
                       command=shown, exit_status=int(status), **fields)
        return status


def _victim(strangers: list[_Connection], newcomer: _Connection) -> _Connection:
    """The connection to close for `newcomer`: of the network that holds the most of
    `strangers`, a stranger's before one that offered a listed key, both before those
    from an address a key holder has authenticated from; of those, from the addresses
    that had spent the most of their budget making room when they came (a host that
    keeps reconnecting), of the address that holds the most, the oldest. The newcomer's
    own network and address count one more (its own connection is coming)."""
    def most(conns: list[_Connection], key: Callable[[_Connection], str]) -> list[_Connection]:
        counts = Counter(key(c) for c in conns)
        counts[key(newcomer)] += 1
        top = max(counts.values())
        # Ties go to the newcomer's own group, else to the one whose oldest is oldest.
        chosen = key(newcomer) if counts[key(newcomer)] == top else next(
            key(c) for c in conns if counts[key(c)] == top)
        return [c for c in conns if key(c) == chosen] or conns

    network = most(strangers, lambda c: c.prefix)
    # A stranger before one that offered a listed key, and both before those from an
    # address a key holder has authenticated from.
    first = min((c.known, c.vouched) for c in network)
    network = [c for c in network if (c.known, c.vouched) == first]
    least = min(c.standing for c in network)
    return most([c for c in network if c.standing == least], lambda c: c.address)[0]


class _Session(asyncssh.SSHServerSession[str]):
    """One channel: one exec, nothing else."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._chan: Any = None
        self._command: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._wanted_pty = False

    def connection_made(self, chan: Any) -> None:
        self._chan = chan

    def pty_requested(self, term_type: str, term_size: Any, term_modes: Any) -> bool:
        self._conn.refuse("a terminal (pty)")
        self._wanted_pty = True
        return False

    def shell_requested(self) -> bool:
        self._conn.refuse("a shell")
        return False

    def subsystem_requested(self, subsystem: str) -> bool:
        self._conn.refuse(f"the subsystem {subsystem[:40]!r}")
        return False

    def exec_requested(self, command: str) -> bool:
        if self._wanted_pty:
            # OpenSSH's `ssh -tt` sends the command without waiting for the terminal's
            # answer, then gives up on the refusal: nothing must run behind its back.
            self._conn.refuse(f"the command {command[:MAX_COMMAND]!r} after a refused terminal")
            return False
        # Accepted here so that a refusal can say why, on stderr, with an exit status.
        self._command = command
        return True

    def session_started(self) -> None:
        self._conn.busy(True)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        grant = self._conn.grant
        assert grant is not None  # sessions only open after authentication
        try:
            status = await self._conn.endpoint.run(grant, self._conn.peer, self._command,
                                                   self._chan.write, self._chan.write_stderr)
        finally:
            self._conn.busy(False)
        self._chan.exit(int(status))

    def data_received(self, data: str, datatype: Any) -> None:
        pass  # stdin means nothing here

    def eof_received(self) -> bool:
        return True  # a client with no stdin (ssh -n, a script) still waits for the result

    def break_received(self, msec: int) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        # The client went away: stop waiting. What the command started goes on.
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _prohibited() -> asyncssh.ChannelOpenError:
    # What an OpenSSH client prints: "open failed: administratively prohibited: ...".
    return asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
                                     "hostagent forwards nothing")


class _Connection(asyncssh.SSHServer):
    """One client connection: public-key authentication, then sessions."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.peer = "?"
        self.prefix = "?"  # the network the peer's address counts in
        self.address = "?"
        self.grant: Grant | None = None
        self.admitted = False
        self.standing = EVICT_BURST  # its address's eviction budget when it came
        self.known = False  # from an address a key holder authenticated from
        self.vouched = False  # offered a listed key (not yet signed)
        self.counted: str | None = None  # the fingerprint this connection counts against
        self._conn: Any = None  # asyncssh's connection
        self._candidate: Grant | None = None
        self._decided: set[str] = set()
        self._session = False  # one per connection
        self._refusals = 0
        self._idle: asyncio.TimerHandle | None = None
        self._closing = False

    def _record(self, message: str, result: str, **fields: Any) -> None:
        if self.grant is not None:
            fields.setdefault("key", self.grant.comment)
            fields.setdefault("fingerprint", self.grant.fingerprint)
        self.endpoint.say(self.address, message, result=result, peer=self.peer, **fields)

    def _preauth(self, message: str, result: str) -> None:
        """A record before authentication: anyone can cause it, so it is rate-limited."""
        self.endpoint.preauth(message, result)

    def refuse(self, what: str, why: str = "hostagent only runs commands") -> None:
        """Journal a refused request; one too many closes the connection (a client
        that asks again and again for what it is refused only floods)."""
        self._refusals += 1
        if self._closing:
            return  # requests already on their way when the connection was closed
        self._record(f"refused {what} to {self.grant.comment if self.grant else '?'} at "
                     f"{self.peer}: {why}", "refused", priority=journal.Priority.WARNING)
        if self._refusals == MAX_REFUSALS:
            self.disconnect(f"{MAX_REFUSALS} requests refused")

    def close(self) -> None:
        """Drop the connection unanswered; its descriptor is back within a loop turn."""
        if self._conn is not None:
            self._conn.abort()

    def disconnect(self, why: str) -> None:
        """Say why and close, once asyncssh is done with the packet at hand."""
        if self._conn is None or self._closing:
            return
        self._closing = True
        self._record(f"closing the connection from {self.peer}: {why}", "disconnected")
        self.endpoint.gone(self)
        asyncio.get_running_loop().call_soon(self._disconnect_now, why)

    def _disconnect_now(self, why: str) -> None:
        if self._conn is not None:  # not lost meanwhile
            self._conn.disconnect(asyncssh.DISC_TOO_MANY_CONNECTIONS, f"hostagent: {why}")

    def busy(self, running: bool) -> None:
        """A command runs (no idle timeout) or has ended (the idle timeout runs)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not running and self._conn is not None:
            timeout = self.endpoint.idle_timeout
            self._idle = asyncio.get_running_loop().call_later(
                timeout, self.disconnect, f"no command for {timeout:g}s")

    def connection_made(self, conn: Any) -> None:
        self._conn = conn
        peer = conn.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.prefix = prefix(str(peer[0])) if peer else "?"
        self.address = str(peer[0]) if peer else "?"
        full = self.endpoint.admit(self)
        if full is not None:
            self._preauth(f"refused a connection from {self.peer}: {full}", "refused")
            self.close()
            return
        self.admitted = True
        self._preauth(f"connection from {self.peer}", "connected")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._conn = None
        if not self.admitted:
            return
        self.endpoint.gone(self)
        message = f"connection from {self.peer} closed" + (f": {exc}" if exc else "")
        if self.grant is None:
            self._preauth(message, "closed")
        else:
            self._record(message, "closed")

    def begin_auth(self, username: str) -> bool:
        return True

    def password_auth_supported(self) -> bool:
        return False

    def kbdint_auth_supported(self) -> bool:
        return False

    def host_based_auth_supported(self) -> bool:
        return False

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_ca_key(self, username: str, key: Any) -> bool:
        return False  # no certificates: each key is listed by itself

    def validate_public_key(self, username: str, key: Any) -> bool:
        # Called for a probe and again for the signed request; the last key accepted
        # before auth_completed is the one whose signature was verified.
        grant = self.endpoint.keys.find(key)
        fingerprint = key.get_fingerprint("sha256")
        if fingerprint not in self._decided:
            self._decided.add(fingerprint)
            if grant is None:
                self._preauth(f"refused an unknown key {fingerprint} from {self.peer} "
                              f"(user {username[:32]!r})" + (
                                  f"; every key is refused: {self.endpoint.keys.problem}"
                                  if self.endpoint.keys.problem else ""), "refused")
            else:
                self._record(f"key {grant.comment} offered from {self.peer}", "known",
                             key=grant.comment, fingerprint=fingerprint)
                self.endpoint.vouched(self)
        self._candidate = grant
        return grant is not None

    def auth_completed(self) -> None:
        self.grant = self._candidate
        assert self.grant is not None
        self._record(f"{self.grant.comment} authenticated from {self.peer}", "authenticated")
        over = self.endpoint.authenticated(self, self.grant.fingerprint)
        if over is not None:
            self.disconnect(over)
            return
        self.counted = self.grant.fingerprint
        self.endpoint.refund(self.address)
        self.busy(False)

    def session_requested(self) -> _Session:
        if self._session:
            self.refuse("a second session", "one session per connection, which runs one "
                        "command: connect again for another")
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
                "hostagent runs one command per connection: connect again for another")
        self._session = True
        return _Session(self)

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str,
                             orig_port: int) -> bool:
        self.refuse(f"a port forwarding to {clean(dest_host, 64)}:{dest_port}")
        raise _prohibited()

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        self.refuse(f"a remote port forwarding from {clean(listen_host, 64)}:{listen_port}")
        return False

    def unix_connection_requested(self, dest_path: str) -> bool:
        self.refuse("a Unix socket forwarding")
        raise _prohibited()

    def unix_server_requested(self, listen_path: str) -> bool:
        self.refuse("a remote Unix socket forwarding")
        return False

    def tun_requested(self, unit: int | None) -> bool:
        self.refuse("a tunnel")
        return False


async def serve(address: tuple[str, int], host_key: Path, authorized_keys: Path,
                verbs: Mapping[str, VerbHandler], *, lendees: tuple[str, ...] = (),
                max_connections: int = MAX_CONNECTIONS,
                max_unauthenticated: int = MAX_UNAUTHENTICATED,
                max_per_prefix: int = MAX_PER_PREFIX, max_per_key: int = MAX_PER_KEY,
                max_running: int = MAX_RUNNING, idle_timeout: float = IDLE_TIMEOUT,
                login_timeout: float = LOGIN_TIMEOUT) -> Any:
    """Listen for SSH clients; the asyncssh acceptor (close() it).

    `Transient` if the address cannot be listened on now (retry later); EndpointError
    if the host key cannot be used (a person must act). A missing or broken
    authorized-keys file does not stop it: every key is refused until it is fixed."""
    key = load_host_key(host_key)
    endpoint = Endpoint(verbs, authorized_keys, lendees=lendees,
                        max_connections=max_connections,
                        max_unauthenticated=max_unauthenticated,
                        max_per_prefix=max_per_prefix, max_per_key=max_per_key,
                        max_running=max_running, idle_timeout=idle_timeout)
    host, port = address
    try:
        server = await asyncssh.create_server(
            lambda: _Connection(endpoint), host or None, port,
            server_host_keys=[key], config=None, server_version="hostagent",
            public_key_auth=True, password_auth=False, kbdint_auth=False,
            host_based_auth=False, gss_host=None, known_client_hosts=None,
            authorized_client_keys=None, agent_forwarding=False, x11_forwarding=False,
            allow_scp=False, sftp_factory=None, line_editor=False, rdns_lookup=False,
            login_timeout=login_timeout, keepalive_interval=30, keepalive_count_max=4,
            # asyncio accepts up to `backlog` connections in one go before any of them
            # is looked at: the batch must stay small for the cap to bound descriptors.
            backlog=ACCEPT_BACKLOG)
    except OSError as e:
        raise Transient(f"cannot listen for SSH on {host or '*'}:{port}: "
                        f"{e.strerror or e}; retrying (change ssh.listen if the port is "
                        "another program's)") from e
    journal.record("ssh", f"SSH endpoint listening on {host or '*'}:{port}, host key "
                   f"{key.get_fingerprint('sha256')}, {len(endpoint.keys.grants)} authorized "
                   f"key(s) in {authorized_keys}", result="listening",
                   fingerprint=key.get_fingerprint("sha256"))
    return server
