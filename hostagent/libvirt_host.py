"""The libvirt adapter: lifecycle events through libvirtaio, every call in a worker thread.

Why threads: when the agent starts an owner VM, libvirtd runs that VM's `prepare
begin` hook synchronously, and the hook waits for *this* process to answer on the
hook socket. A libvirt call made on the event loop would block the loop that must
answer it: a deadlock. So the loop only ever awaits `asyncio.to_thread(...)`.

libvirt errors become our own small tree (`HostError`, `DomainNotFound`,
`Disconnected`), raised `from` the original, here and nowhere else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import enum
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import libvirt
import libvirtaio

log = logging.getLogger("hostagent.libvirt")
T = TypeVar("T")


class HostError(Exception):
    """A libvirt operation failed; the message says which and why."""


class DomainNotFound(HostError):
    pass


class Disconnected(HostError):
    """libvirtd went away; the adapter reconnects by itself."""


class Lifecycle(enum.StrEnum):
    STARTED = "started"
    STOPPED = "stopped"
    AGENT_CONNECTED = "agent-connected"  # qemu-ga opened its port: worth a ping now


@dataclass(frozen=True)
class ExecResult:
    exitcode: int
    stdout: str
    stderr: str


LifecycleCallback = Callable[[str, Lifecycle], None]
ReconnectCallback = Callable[[], None]

_event_impl_registered = False


def _register_event_impl() -> None:
    # libvirt accepts one event implementation per process, before any connection.
    global _event_impl_registered
    if not _event_impl_registered:
        libvirtaio.virEventRegisterAsyncIOImpl(loop=asyncio.get_running_loop())
        # libvirt prints every error on stderr by default; ours are raised and reported
        # where they matter (an agent that is not up yet is an expected answer).
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        _event_impl_registered = True


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
            if code in (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_ERR_INTERNAL_ERROR,
                        libvirt.VIR_ERR_RPC) and not conn.isAlive():
                self._lost()
                raise Disconnected(f"{what}: lost libvirtd ({e.get_error_message()})") from e
            raise HostError(f"{what}: {e.get_error_message()}") from e

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
        return await self._call(f"XML of {name}", lambda c: str(c.lookupByName(name).XMLDesc()))

    # ---- actions ----------------------------------------------------------
    async def start(self, name: str) -> None:
        def create(c: Any) -> None:
            dom = c.lookupByName(name)
            if not dom.isActive():
                dom.create()
        await self._call(f"start {name}", create)

    async def shutdown_via_agent(self, name: str) -> None:
        """Ask the guest to power off through its agent (never ACPI, never destroy)."""
        await self._call(f"shut down {name} through its guest agent", lambda c: c.lookupByName(
            name).shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_GUEST_AGENT))

    async def shutdown_via_acpi(self, name: str) -> None:
        """Press the VM's ACPI power button (for a VM without a guest agent)."""
        await self._call(f"shut down {name} through ACPI", lambda c: c.lookupByName(
            name).shutdownFlags(libvirt.VIR_DOMAIN_SHUTDOWN_ACPI_POWER_BTN))

    async def destroy(self, name: str) -> None:
        await self._call(f"force off {name}", lambda c: c.lookupByName(name).destroy())

    async def agent_command(self, name: str, command: dict[str, Any], *,
                            timeout: int = 5) -> Any:
        import libvirt_qemu  # part of libvirt-python; loaded only where used

        def run(c: Any) -> Any:
            out = libvirt_qemu.qemuAgentCommand(c.lookupByName(name), json.dumps(command),
                                                timeout, 0)
            return json.loads(out).get("return")
        return await self._call(f"guest agent of {name}: {command['execute']}", run)

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
        started = await self.agent_command(name, {"execute": "guest-exec", "arguments": {
            "path": path, "arg": args, "capture-output": True}})
        status = {"execute": "guest-exec-status", "arguments": {"pid": started["pid"]}}
        deadline = time.monotonic() + timeout
        while True:
            ret = await self.agent_command(name, status)
            if ret.get("exited"):
                return ExecResult(int(ret.get("exitcode", -1)), _text(ret.get("out-data", "")),
                                  _text(ret.get("err-data", "")))
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


def _text(b64: str) -> str:
    return base64.b64decode(b64).decode(errors="replace")


def read_domain_xmls(uri: str, names: list[str] | None = None) -> dict[str, str]:
    """name → XML of the named domains (every defined one if None), read-only.

    For the one-shot commands (`hostagent lint`, `config init`), not for the agent: a
    plain blocking connection, no events. Raises HostError.
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
        return {d.name(): str(d.XMLDesc()) for d in doms}
    except libvirt.libvirtError as e:
        raise HostError(f"reading domains at {uri}: {e.get_error_message()}") from e
    finally:
        conn.close()
