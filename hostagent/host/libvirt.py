"""The libvirt adapter: lifecycle events through libvirtaio, every call in a worker thread.

Why threads: when the agent starts an owner VM, libvirtd runs that VM's `prepare
begin` hook synchronously, and the hook waits for *this* process to answer on the
hook socket. A libvirt call made on the event loop would block the loop that must
answer it: a deadlock. So the loop only ever awaits `asyncio.to_thread(...)`.

libvirt errors become our own small tree, raised `from` the original, here and
nowhere else::

    HostError              a libvirt operation failed
    ├── DomainNotFound     no such domain
    ├── Disconnected       libvirtd went away (the adapter reconnects by itself)
    └── HookRefused        a hook stopped a start: ours, deferring it (never retry it)

The lendee runs with the GPUs that are free (partial lending, DESIGN.md invariant 9):
`Libvirt.start_with` reads its persistent definition, leaves out the devices of the
GPUs to keep free (`hostagent.core.devices`) and runs the result with ``createXML`` on the
same name and UUID. libvirt then runs the persistent domain with that live definition
for this boot only: ``dominfo`` still says persistent, the inactive definition is
untouched, and once it stops the full definition is what remains. The persistent
definition is never edited: a crash in the middle would leave it stripped.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import enum
import json
import logging
import random
import re
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import libvirt
import libvirtaio

from hostagent.core import devices
from hostagent.core.config import Gpu
from hostagent.core.text import clean

log = logging.getLogger("hostagent.libvirt")
T = TypeVar("T")


class HostError(Exception):
    """A libvirt operation failed; the message says which and why."""


class DomainNotFound(HostError):
    pass


class Disconnected(HostError):
    """libvirtd went away; the adapter reconnects by itself."""


class HookRefused(HostError):
    """A hook (ours: the agent deferred the start) made libvirt refuse to start a VM.

    `sentence` is what the hook wrote on stderr, for the journal. Starting again only
    asks the same hook the same question: wait for what it waits for instead."""

    def __init__(self, message: str, *, sentence: str) -> None:
        super().__init__(message)
        self.sentence = sentence


# libvirt 9.0: "Hook script execution failed: internal error: Child process (LC_ALL=C
# ... /etc/libvirt/hooks/qemu gaming1 prepare begin -) unexpected exit status 1: <stderr>"
# libvirt's qemu_agent.c when the guest agent's socket closes mid-command.
_AGENT_EOF = "End of file from agent socket"
_HOOK_STDERR = re.compile(r"unexpected exit status \d+:\s*(.*)\Z", re.DOTALL)


def hook_sentence(message: str) -> str:
    """What the hook said, out of libvirt's message about its failure."""
    m = _HOOK_STDERR.search(message)
    return (m.group(1) if m else message).strip()


class Lifecycle(enum.StrEnum):
    STARTED = "started"
    STOPPED = "stopped"
    AGENT_CONNECTED = "agent-connected"  # qemu-ga opened its port: worth a ping now
    DEVICE_REMOVED = "device-removed"  # the guest let a device go: worth a look at its XML


@dataclass(frozen=True)
class ExecResult:
    exitcode: int
    stdout: str
    stderr: str


LifecycleCallback = Callable[[str, Lifecycle], None]
ReconnectCallback = Callable[[], None]

_event_impl_registered = False
# The persistent definition with its secrets: what the next plain start would run.
_INACTIVE_SECURE = libvirt.VIR_DOMAIN_XML_INACTIVE | libvirt.VIR_DOMAIN_XML_SECURE


def _register_event_impl() -> None:
    # libvirt accepts one event implementation per process, before any connection.
    global _event_impl_registered
    if not _event_impl_registered:
        libvirtaio.virEventRegisterAsyncIOImpl(loop=asyncio.get_running_loop())
        # libvirt prints every error on stderr by default; ours are raised and reported
        # where they matter (an agent that is not up yet is an expected answer).
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        _event_impl_registered = True


class Domains(Protocol):
    """What the agent's parts ask of libvirt. `Libvirt` is it; the tests' stand-ins
    implement it too (tests/fakes.py), so that a signature changed here fails their
    type check instead of letting them drift."""

    uri: str

    @property
    def connected(self) -> bool: ...

    async def connect(self, *, attempts: int | None = None) -> None: ...

    async def close(self) -> None: ...

    async def defined_domains(self) -> set[str]: ...

    async def running_domains(self) -> set[str]: ...

    async def is_running(self, name: str) -> bool: ...

    async def xml(self, name: str) -> str: ...

    async def inactive_xml(self, name: str) -> str: ...

    async def live_gpus(self, name: str, gpus: Mapping[str, Gpu]) -> frozenset[str]: ...

    async def start(self, name: str) -> None: ...

    async def start_with(self, name: str, *, drop: Collection[str],
                         gpus: Mapping[str, Gpu]) -> None: ...

    async def attach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None: ...

    async def detach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None: ...

    async def shutdown_via_agent(self, name: str) -> None: ...

    async def shutdown_via_acpi(self, name: str) -> None: ...

    async def destroy(self, name: str) -> None: ...

    async def freeze_filesystems(self, name: str, *, timeout: int = 10) -> int: ...

    async def thaw_filesystems(self, name: str, *, timeout: int = 10) -> int: ...

    async def agent_command(self, name: str, command: dict[str, Any], *,
                            timeout: int = 5) -> Any: ...

    async def ping_agent(self, name: str, *, timeout: int = 3) -> bool: ...

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult: ...

    async def screenshot(self, name: str, *, screen: int = 0) -> tuple[str, bytes]: ...


class Libvirt:
    def __init__(self, uri: str, *, on_lifecycle: LifecycleCallback,
                 on_reconnect: ReconnectCallback) -> None:
        self.uri = uri
        self._on_lifecycle = on_lifecycle
        self._on_reconnect = on_reconnect
        self._conn: Any = None
        self._connected = asyncio.Event()
        self._reconnecting: asyncio.Task[None] | None = None

    # ---- connection -------------------------------------------------------
    async def connect(self, *, attempts: int | None = None) -> None:
        """Open the connection, retrying with backoff (libvirtd may start after us)."""
        _register_event_impl()
        delay = 0.2
        tried = 0
        while True:
            tried += 1
            try:
                conn = await asyncio.to_thread(libvirt.open, self.uri)
                break
            except libvirt.libvirtError as e:
                if attempts is not None and tried >= attempts:
                    raise Disconnected(f"cannot connect to libvirt at {self.uri}: "
                                       f"{e.get_error_message()}") from e
                log.warning("cannot connect to libvirt at %s (%s); retrying in %.1fs",
                            self.uri, e.get_error_message(), delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 10.0)
        conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                    self._lifecycle, None)
        conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_AGENT_LIFECYCLE,
                                    self._agent_lifecycle, None)
        conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_DEVICE_REMOVED,
                                    self._device_removed, None)
        conn.registerCloseCallback(self._closed, None)
        # Keepalive lets us notice a hung or killed libvirtd without a failing call.
        conn.setKeepAlive(5, 3)
        self._conn = conn
        self._connected.set()

    def _lifecycle(self, _conn: Any, dom: Any, event: int, _detail: int, _opaque: Any) -> None:
        kind = {libvirt.VIR_DOMAIN_EVENT_STARTED: Lifecycle.STARTED,
                libvirt.VIR_DOMAIN_EVENT_STOPPED: Lifecycle.STOPPED}.get(event)
        if kind is not None:
            self._on_lifecycle(dom.name(), kind)

    def _agent_lifecycle(self, _conn: Any, dom: Any, state: int, _reason: int,
                         _opaque: Any) -> None:
        if state == libvirt.VIR_CONNECT_DOMAIN_EVENT_AGENT_LIFECYCLE_STATE_CONNECTED:
            self._on_lifecycle(dom.name(), Lifecycle.AGENT_CONNECTED)

    def _device_removed(self, _conn: Any, dom: Any, _alias: str, _opaque: Any) -> None:
        self._on_lifecycle(dom.name(), Lifecycle.DEVICE_REMOVED)

    def _closed(self, _conn: Any, reason: int, _opaque: Any) -> None:
        log.warning("lost the connection to libvirtd (reason %d); reconnecting", reason)
        self._lost()

    def _lost(self) -> None:
        self._connected.clear()
        self._conn = None
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        await self.connect()
        log.warning("reconnected to libvirtd at %s", self.uri)
        self._on_reconnect()

    async def close(self) -> None:
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.unregisterCloseCallback()
            except libvirt.libvirtError:
                pass
            await asyncio.to_thread(conn.close)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def _call(self, what: str, fn: Callable[[Any], T], *, wait: float = 30) -> T:
        """Run fn(conn) in a worker thread, mapping libvirt errors to ours."""
        try:
            await asyncio.wait_for(self._connected.wait(), wait)
        except TimeoutError as e:
            raise Disconnected(f"{what}: libvirtd is not connected") from e
        conn = self._conn
        try:
            return await asyncio.to_thread(fn, conn)
        except libvirt.libvirtError as e:
            code = e.get_error_code()
            if code == libvirt.VIR_ERR_NO_DOMAIN:
                raise DomainNotFound(f"{what}: {e.get_error_message()}") from e
            if code == libvirt.VIR_ERR_HOOK_SCRIPT_FAILED:
                sentence = hook_sentence(e.get_error_message())
                raise HookRefused(f"{what}: refused by the hook: {sentence}",
                                  sentence=sentence) from e
            if code in (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_ERR_INTERNAL_ERROR,
                        libvirt.VIR_ERR_RPC) and not conn.isAlive():
                self._lost()
                raise Disconnected(f"{what}: lost libvirtd ({e.get_error_message()})") from e
            # The guest agent's errors carry the guest's words.
            raise HostError(f"{what}: {clean(e.get_error_message())}") from e

    # ---- queries ----------------------------------------------------------
    async def defined_domains(self) -> set[str]:
        return await self._call("list domains", lambda c: {d.name() for d in c.listAllDomains()})

    async def running_domains(self) -> set[str]:
        return await self._call("list running domains", lambda c: {
            d.name() for d in c.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)})

    async def is_running(self, name: str) -> bool:
        return await self._call(f"state of {name}",
                                lambda c: bool(c.lookupByName(name).isActive()))

    async def xml(self, name: str) -> str:
        """The domain's XML: the live definition while it runs, else the persistent one."""
        return await self._call(f"XML of {name}", lambda c: str(c.lookupByName(name).XMLDesc()))

    async def inactive_xml(self, name: str) -> str:
        """The persistent definition, as the next plain start would use it (secrets
        included: it may be handed to ``createXML``)."""
        return await self._call(f"persistent XML of {name}", lambda c: str(
            c.lookupByName(name).XMLDesc(_INACTIVE_SECURE)))

    async def live_gpus(self, name: str, gpus: Mapping[str, Gpu]) -> frozenset[str]:
        """Labels of `gpus` the running domain holds now; empty when it is not running."""
        def read(c: Any) -> str | None:
            xml = str(c.lookupByName(name).XMLDesc())
            # A running domain's XML carries its id; a stopped one's is the persistent
            # definition, which lists every GPU and says nothing of what runs.
            return xml if ET.fromstring(xml).get("id") is not None else None
        xml = await self._call(f"live XML of {name}", read)
        if xml is None:
            return frozenset()
        try:
            return devices.gpus_in(xml, gpus)
        except devices.XmlError as e:
            raise HostError(f"live XML of {name}: {e}") from e

    # ---- actions ----------------------------------------------------------
    async def start(self, name: str) -> None:
        def create(c: Any) -> None:
            dom = c.lookupByName(name)
            if not dom.isActive():
                dom.create()
        await self._call(f"start {name}", create)

    async def start_with(self, name: str, *, drop: Collection[str],
                         gpus: Mapping[str, Gpu]) -> None:
        """Start `name` without the devices of the GPUs labelled `drop` (all their PCI
        functions, and what is aliased to them: `hostagent.core.devices`), for this boot only.

        With nothing to drop it is a plain start. Otherwise the persistent definition
        is read (inactive, secrets included), stripped and run with ``createXML`` on
        the same name and UUID; the persistent definition itself is never changed.
        Already running: nothing to do. Raises HookRefused when a hook defers the start,
        HostError (naming the GPU) when the definition lacks a GPU to drop.
        """
        if not drop:
            await self.start(name)
            return
        left_out = ", ".join(sorted(drop))

        def create(c: Any) -> None:
            dom = c.lookupByName(name)
            if dom.isActive():
                return
            try:
                xml = devices.without(str(dom.XMLDesc(_INACTIVE_SECURE)), drop, gpus)
            except (devices.XmlError, devices.GpuNotInXml, KeyError) as e:
                # Not a libvirtError: _call lets it through as it is.
                raise HostError(f"start {name} without {left_out}: {e}") from e
            c.createXML(xml, 0)
        await self._call(f"start {name} without {left_out}", create)

    async def attach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None:
        """Attach the devices of the GPUs `labels` to the running `name`, live only: as
        its persistent definition has them (`devices.elements_of`), each into the
        root port that definition gives it, which the live definition left empty. The
        persistent definition is not touched. Raises HostError."""
        await self._change_live(name, labels, gpus, attach=True)

    async def detach_live(self, name: str, labels: Collection[str],
                          gpus: Mapping[str, Gpu]) -> None:
        """Ask for the devices of the GPUs `labels` to leave the running `name`, live
        only, each as its live definition has it. The guest must let each go: libvirt
        waits a few seconds for that, then returns with the removal still pending
        (`Lifecycle.DEVICE_REMOVED` and the live XML say when it is done). The
        persistent definition is not touched. Raises HostError."""
        await self._change_live(name, labels, gpus, attach=False)

    async def _change_live(self, name: str, labels: Collection[str],
                           gpus: Mapping[str, Gpu], *, attach: bool) -> None:
        what = (f"{'attach' if attach else 'detach'} {', '.join(sorted(labels))} "
                f"{'to' if attach else 'from'} {name} live")

        def change(c: Any) -> None:
            dom = c.lookupByName(name)
            if not dom.isActive():
                raise libvirt.libvirtError(f"{name} is not running")
            # What to attach is in the persistent definition; what to detach, the live one.
            xml = dom.XMLDesc(_INACTIVE_SECURE) if attach else dom.XMLDesc()
            try:
                parts = devices.elements_of(str(xml), labels, gpus)
            except (devices.XmlError, devices.GpuNotInXml, KeyError) as e:
                raise HostError(f"{what}: {e}") from e
            move = dom.attachDeviceFlags if attach else dom.detachDeviceFlags
            for part in parts:
                move(part, libvirt.VIR_DOMAIN_AFFECT_LIVE)
        await self._call(what, change)

    async def shutdown_via_agent(self, name: str) -> None:
        """Ask the guest to power off through its agent (never ACPI, never destroy).

        A guest that powers off at once closes the agent's socket before its reply:
        libvirt reports that end while the domain still runs (the stop event follows).
        The shutdown was delivered, so that is no error (nor a reason for ACPI)."""
        def shutdown(c: Any) -> None:
            try:
                c.lookupByName(name).shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT)
            except libvirt.libvirtError as e:
                if _AGENT_EOF not in str(e.get_error_message() or e):
                    raise
                log.debug("%s's guest agent went away answering the shutdown: delivered", name)
        await self._call(f"shut down {name} through its guest agent", shutdown)

    async def shutdown_via_acpi(self, name: str) -> None:
        """Press the VM's ACPI power button (for a VM without a guest agent)."""
        await self._call(f"shut down {name} through ACPI", lambda c: c.lookupByName(
            name).shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN))

    async def destroy(self, name: str) -> None:
        await self._call(f"force off {name}", lambda c: c.lookupByName(name).destroy())

    async def freeze_filesystems(self, name: str, *, timeout: int = 10) -> int:
        """Flush and freeze every filesystem of the guest through its agent
        (virDomainFSFreeze, guest-fsfreeze-freeze): how many it froze. libvirt's agent
        calls wait for the agent without end unless the domain's response timeout is
        set (its default is "block"), so it is set to `timeout` first: for this run of
        the domain, which only agent calls without their own bound (this one, the thaw)
        follow; a shutdown keeps libvirt's own 60 s."""
        def freeze(c: Any) -> int:
            dom = c.lookupByName(name)
            _agent_timeout(dom, timeout)
            return int(dom.fsFreeze(None, 0))
        return await self._bounded(f"freeze the filesystems of {name}", freeze, timeout)

    async def thaw_filesystems(self, name: str, *, timeout: int = 10) -> int:
        """Thaw what `freeze_filesystems` froze (virDomainFSThaw): how many it thawed."""
        def thaw(c: Any) -> int:
            dom = c.lookupByName(name)
            _agent_timeout(dom, timeout)
            return int(dom.fsThaw(None, 0))
        return await self._bounded(f"thaw the filesystems of {name}", thaw, timeout)

    # Beyond libvirt's own bound: its guest-sync before the command has one of its own.
    bound_slack = 5.0

    async def _bounded(self, what: str, fn: Callable[[Any], T], timeout: int) -> T:
        """`_call`, with a bound of its own beside libvirt's (a worker thread cannot be
        cancelled; the loop stops waiting for it)."""
        bound = timeout + self.bound_slack
        try:
            return await asyncio.wait_for(self._call(what, fn), bound)
        except TimeoutError as e:
            raise HostError(f"{what}: no answer within {bound:g} s") from e

    async def agent_command(self, name: str, command: dict[str, Any], *,
                            timeout: int = 5) -> Any:
        """The ``return`` of a guest-agent command. The guest is not trusted (the lendee
        runs arbitrary pods): a reply that is not a JSON object is a HostError."""
        import libvirt_qemu  # part of libvirt-python; loaded only where used

        what = f"guest agent of {name}: {command['execute']}"
        out = await self._call(what, lambda c: libvirt_qemu.qemuAgentCommand(
            c.lookupByName(name), json.dumps(command), timeout, 0))
        try:
            reply = json.loads(out)
        except (TypeError, ValueError, RecursionError) as e:
            raise HostError(f"{what}: the reply is not JSON ({_short(e)})") from e
        if not isinstance(reply, dict):
            raise HostError(f"{what}: the reply is not a JSON object: {_short(reply)}")
        return reply.get("return")

    async def ping_agent(self, name: str, *, timeout: int = 3) -> bool:
        """True once the guest agent answers guest-ping."""
        try:
            await self.agent_command(name, {"execute": "guest-ping"}, timeout=timeout)
            return True
        except DomainNotFound:
            raise
        except HostError:
            return False

    async def guest_exec(self, name: str, path: str, args: list[str], *,
                         timeout: float = 30) -> ExecResult:
        """Run `path` in the guest and wait for it; HostError for whatever goes wrong,
        a malformed reply from the guest included."""
        what = f"guest agent of {name}: {path}"
        started = await self.agent_command(name, {"execute": "guest-exec", "arguments": {
            "path": path, "arg": args, "capture-output": True}})
        pid = started.get("pid") if isinstance(started, dict) else None
        if type(pid) is not int:
            raise HostError(f"{what}: guest-exec answered without a process id: "
                            f"{_short(started)}")
        status = {"execute": "guest-exec-status", "arguments": {"pid": pid}}
        deadline = time.monotonic() + timeout
        while True:
            ret = await self.agent_command(name, status)
            if not isinstance(ret, dict):
                raise HostError(f"{what}: guest-exec-status answered {_short(ret)}")
            if ret.get("exited") is True:
                exitcode = ret.get("exitcode", -1)  # absent: killed by a signal
                if type(exitcode) is not int or not -2**31 <= exitcode < 2**31:
                    raise HostError(f"{what}: the exit code is not a 32-bit integer: "
                                    f"{_short(exitcode)}")
                return ExecResult(exitcode, _text(ret.get("out-data", ""), what),
                                  _text(ret.get("err-data", ""), what))
            if time.monotonic() > deadline:
                raise HostError(f"{path} in {name} did not finish within {timeout:g}s")
            await asyncio.sleep(0.2)

    async def screenshot(self, name: str, *, screen: int = 0) -> tuple[str, bytes]:
        """The VM's screen as (MIME type, image bytes), in the format QEMU gives (PPM)."""
        def take(c: Any) -> tuple[str, bytes]:
            stream = c.newStream(0)
            try:
                mime = c.lookupByName(name).screenshot(stream, screen, 0)
                chunks = []
                while True:
                    chunk = stream.recv(1 << 18)
                    if not isinstance(chunk, bytes) or not chunk:
                        break
                    chunks.append(chunk)
                stream.finish()
            except libvirt.libvirtError:
                with contextlib.suppress(libvirt.libvirtError):
                    stream.abort()
                raise
            return str(mime), b"".join(chunks)
        return await self._call(f"screenshot of {name}", take)


def _agent_timeout(dom: Any, seconds: int) -> None:
    """Bound the domain's agent calls to `seconds` (virDomainAgentSetResponseTimeout,
    libvirt 5.10); a driver without it (libvirt's test driver) leaves `_bounded`'s."""
    try:
        dom.agentSetResponseTimeout(seconds, 0)
    except libvirt.libvirtError as e:
        if e.get_error_code() != libvirt.VIR_ERR_NO_SUPPORT:
            raise


def _text(b64: object, what: str) -> str:
    if not isinstance(b64, str):
        raise HostError(f"{what}: the output is not a base64 string: {_short(b64)}")
    try:
        return base64.b64decode(b64, validate=True).decode(errors="replace")
    except (binascii.Error, ValueError) as e:
        raise HostError(f"{what}: the output is not valid base64 ({e})") from e


def _short(value: object) -> str:
    """A guest's reply, cut short for a message (it may be huge)."""
    return clean(repr(value) if not isinstance(value, BaseException) else value, 120)


@dataclass(frozen=True)
class DefinedDomain:
    """What the one-shot commands read of a domain."""

    xml: str  # the persistent definition (a transient domain's live one)
    autostart: bool  # libvirt starts it when libvirtd starts


def read_domains(uri: str, names: list[str] | None = None) -> dict[str, DefinedDomain]:
    """name → definition of the named domains (every defined one if None), read-only.

    For the one-shot commands (`hostagent lint`, `config init`), not for the agent: a
    plain blocking connection, no events. The persistent definition, not the live one:
    the lendee may be running with only some of its GPUs. Raises HostError.
    """
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)  # raised, not printed
    try:
        conn = libvirt.openReadOnly(uri)
    except libvirt.libvirtError as e:
        raise HostError(f"cannot connect to libvirt at {uri}: {e.get_error_message()}") from e
    try:
        if names is None:
            doms = conn.listAllDomains()
        else:
            doms = []
            for name in names:
                try:
                    doms.append(conn.lookupByName(name))
                except libvirt.libvirtError as e:
                    raise DomainNotFound(f"{name}: {e.get_error_message()}") from e
        return {d.name(): DefinedDomain(
            xml=str(d.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)),
            autostart=bool(d.isPersistent() and d.autostart())) for d in doms}
    except libvirt.libvirtError as e:
        raise HostError(f"reading domains at {uri}: {e.get_error_message()}") from e
    finally:
        conn.close()


def read_domain_xmls(uri: str, names: list[str] | None = None) -> dict[str, str]:
    """name → persistent XML of the named domains (every defined one if None); as
    `read_domains`. Raises HostError."""
    return {name: d.xml for name, d in read_domains(uri, names).items()}
