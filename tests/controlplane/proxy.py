"""A fault proxy in front of the real kube-apiserver: what a client sees of an API
server that refuses connections, answers 500 or 429, answers slowly, drops a watch,
leaves one half-open, or answers a watch 410 Gone, while everything else is the real
server's own answer.

    async with FaultProxy(plane.credential("agent", "system:serviceaccount:...")) as proxy:
        proxy.write_kubeconfig(tmp_path / "kc")      # what the client under test reads
        proxy.fail("/nodes/", code=429, times=2)     # the next two requests to a node
        proxy.down_for(3)                            # an API server that restarts
    with serve_in_thread(kubeconfig) as proxy:       # for synchronous (lab) tests
        proxy.call(proxy.proxy.down_for, 4)

It terminates TLS with the API server's own serving certificate (the lab's CA signs it
for 127.0.0.1, so clients verify it as they would the server's) and forwards every
request over TLS as one credential (a kubeconfig of `ControlPlane.credential`, its
client certificate; or a ServiceAccount's token in it): the client keeps exactly that
user's RBAC, whatever it presents itself. Clients must present a certificate of the
same CA (`write_kubeconfig` gives them the admin's: the proxy, not it, decides who
they are upstream). Answers, watches included, are
forwarded chunk by chunk as they come. Bounded: `max_connections` open at once, request
bodies of at most 1 MiB (aiohttp's bound on a request it reads), the last `max_log`
requests kept.

The fault interface is the one the earlier stand-in's tests used: `down`, `up`,
`down_for`, `fail`, `slow`, `clear_faults`, `requests_to`, `requests_at`; and for
watches `watching`, `drop_watches`, `hold_watches`, `expire`. HTTP/1.1 only (ALPN says
so, and Go's clients agree), and no upgraded connections (exec, attach, port-forward),
which hostagent never opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import threading
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import aiohttp
from aiohttp import web

__all__ = ["FaultProxy", "ThreadedProxy", "serve_in_thread"]

T = TypeVar("T")
# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
# The reasons and messages kube-apiserver writes for these codes
# (k8s.io/apimachinery/pkg/api/errors: NewInternalError, NewTooManyRequests,
# NewServiceUnavailable, NewTimeoutError; the 502 is what client-go prints for a proxy's).
_ANSWERS = {
    401: ("Unauthorized", "Unauthorized"),
    403: ("Forbidden", "forbidden: injected by the fault proxy"),
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: injected by the fault proxy"),
    502: ("", 'an error on the server ("") has prevented the request from succeeding'),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "Timeout: request did not complete within the allotted timeout"),
}


def status(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A metav1.Status as the API server writes one."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": message, "reason": reason,
                            "code": code}
    if details:
        body["details"] = details
    return body


@dataclass
class Fault:
    """Requests whose path (without query) matches `path` and whose method is `method`
    (None: any) wait `delay` seconds, then are answered `code` (None: forwarded; for
    watches only, 410: an ERROR event, 0: never answered), for the next `times` (None: until cleared)."""

    path: re.Pattern[str]
    method: str | None
    code: int | None
    delay: float
    times: int | None

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and bool(self.path.search(path))


@dataclass(eq=False)
class _Watch:
    """One watch being forwarded."""

    path: str
    response: web.StreamResponse
    transport: asyncio.Transport | None
    held: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class _Accepted(asyncio.Protocol):
    """A connection as accepted: kept in `accepted` (so that an outage can cut it even
    before its TLS handshake is over, which asyncio's own TLS server cannot reach), then
    upgraded to TLS and handed to the web server's protocol."""

    def __init__(self, accepted: weakref.WeakSet[asyncio.Transport],
                 context: ssl.SSLContext, web_server: web.Server) -> None:
        self.accepted, self.context, self.web_server = accepted, context, web_server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.accepted.add(transport)
        transport.pause_reading()  # start_tls takes over what the client sends
        self.task = asyncio.get_running_loop().create_task(self._upgrade(transport))

    async def _upgrade(self, transport: asyncio.Transport) -> None:
        handler = self.web_server()
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, handler, self.context, server_side=True, ssl_handshake_timeout=10)
        except Exception:  # cut mid-handshake, or no TLS client: its connection goes
            transport.abort()
            return
        if tls is None:  # closed during the handshake
            transport.abort()
            return
        handler.connection_made(tls)


def _is_watch(request: web.BaseRequest) -> bool:
    return (request.method == "GET"
            and request.query.get("watch", "") in ("1", "t", "T", "true", "True", "TRUE"))


def _kubeconfig(path: Path) -> dict[str, str]:
    """server, CA, and client certificate and key (or a ServiceAccount's token) of a
    kubeconfig as ControlPlane writes them."""
    config = json.loads(path.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    return {"server": cluster["server"], "ca": cluster["certificate-authority"],
            "cert": user.get("client-certificate", ""), "key": user.get("client-key", ""),
            "token": user.get("token", "")}


class FaultProxy:
    """The proxy on 127.0.0.1 (port 0: any free port, kept across `down` and `up`),
    forwarding as the user of `kubeconfig`."""

    def __init__(self, kubeconfig: Path, *, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = 64, max_log: int = 100_000) -> None:
        self.credential = _kubeconfig(kubeconfig)
        self.upstream = self.credential["server"].rstrip("/")
        self.host = host
        self.port = port
        self.max_connections = max_connections
        # (method, path with query, wall-clock time of arrival), oldest first
        self.requests: deque[tuple[str, str, float]] = deque(maxlen=max_log)
        # (method, path with query, arrival, when its answer was out, status) of each
        # request answered (watches once they end): what benchmarks time a step's end by
        self.answers: deque[tuple[str, str, float, float, int]] = deque(maxlen=max_log)
        self._faults: list[Fault] = []
        self._watches: set[_Watch] = set()
        self._web: web.Server | None = None
        self._listener: asyncio.Server | None = None
        self._session: aiohttp.ClientSession | None = None
        self._outages: set[asyncio.Task[None]] = set()
        # Every accepted connection, from before its TLS handshake: down() cuts them all.
        self._accepted: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()
        self._released = asyncio.Event()  # set and replaced by clear_faults: held answers go

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def accepted_from(self, peer: tuple[str, int]) -> bool:
        """Whether a connection from `peer` (its client's address) is open as accepted,
        its TLS handshake over or not."""
        return any(t.get_extra_info("peername") == peer for t in list(self._accepted))

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig for the proxy: the lab's CA, and a client certificate of it."""
        c = dict(self.credential)
        if not c["cert"]:
            pki = Path(c["ca"]).parent
            c["cert"], c["key"] = str(pki / "admin.crt"), str(pki / "admin.key")
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url,
                                                       "certificate-authority": c["ca"]}}],
            "users": [{"name": "proxy", "user": {"client-certificate": c["cert"],
                                                 "client-key": c["key"]}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
        }, indent=2))
        path.chmod(0o600)
        return path

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        c = self.credential
        upstream = ssl.create_default_context(cafile=c["ca"])
        if c["cert"]:
            upstream.load_cert_chain(c["cert"], c["key"])
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=upstream, limit=self.max_connections),
            # A watch lasts as long as the server keeps it (its timeoutSeconds).
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        await self.up()
        return self

    async def stop(self) -> None:
        for task in list(self._outages):
            task.cancel()
        await asyncio.gather(*self._outages, return_exceptions=True)
        await self.down()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _serving(self) -> ssl.SSLContext:
        # The API server's own certificate and key, beside the CA in the lab's pki.
        pki = Path(self.credential["ca"]).parent
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.credential["ca"])
        context.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(["http/1.1"])
        return context

    # --- faults --------------------------------------------------------------------------

    async def up(self) -> None:
        """Listen again, on the same port."""
        if self._listener is not None:
            return
        self._web = web.Server(self._handle, handler_cancellation=True)
        serving, web_server = self._serving(), self._web
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: _Accepted(self._accepted, serving, web_server), self.host, self.port,
            backlog=self.max_connections)
        self.port = self._listener.sockets[0].getsockname()[1]

    async def down(self) -> None:
        """Refuse connections and cut the open ones, watches included, as a server that
        dies does (its clients see connections reset)."""
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        listener.close()
        for transport in list(self._accepted):  # mid-handshake ones too
            transport.abort()
        assert self._web is not None
        await self._web.shutdown(0.5)
        await listener.wait_closed()

    def down_for(self, seconds: float) -> asyncio.Task[None]:
        """An outage of `seconds`, started now, in the background."""

        async def outage() -> None:
            await self.down()
            await asyncio.sleep(seconds)
            await self.up()

        task = asyncio.get_running_loop().create_task(outage())
        self._outages.add(task)
        task.add_done_callback(self._outages.discard)
        return task

    def fail(self, path: str = ".", *, code: int = 500, times: int | None = 1,
             method: str | None = None) -> None:
        """Answer `code`, with the Status body the API server writes for it (429 with
        Retry-After: 1), to the next `times` requests whose path matches `path`."""
        self._faults.append(Fault(re.compile(path), method, code, 0.0, times))

    def slow(self, path: str = ".", *, delay: float, times: int | None = None,
             method: str | None = None) -> None:
        """Delay matching requests by `delay` seconds before forwarding them."""
        self._faults.append(Fault(re.compile(path), method, None, delay, times))

    def expire(self, path: str = ".", *, times: int | None = 1) -> None:
        """Answer the next `times` watches matching `path` as the watch cache answers a
        resourceVersion older than it holds: 200, one ERROR event with 410 Expired, end."""
        self._faults.append(Fault(re.compile(path), "GET", 410, 0.0, times))

    def watching(self, path: str = ".") -> int:
        """How many watches whose path matches `path` are open."""
        return sum(1 for w in self._watches if re.search(path, w.path))

    def drop_watches(self, path: str = ".", *, clean: bool = False) -> int:
        """Cut the open watches matching `path`: reset, as by a server or a network
        that dies (or `clean`: ended as the server ends a watch whose time is up).
        How many were cut."""
        cut = [w for w in self._watches if re.search(path, w.path)]
        for w in cut:
            if clean:
                w.ended.set()
            elif w.transport is not None:
                w.transport.abort()
        return len(cut)

    def hold_watches(self, path: str = ".") -> int:
        """Half-open: the open watches matching `path` get nothing more, not even their
        end, and new watches matching it no answer, until `clear_faults` (which then
        resets the held connections, as a keepalive that finally fails). How many open
        watches were held."""
        held = [w for w in self._watches if re.search(path, w.path)]
        for w in held:
            w.held = True
        self._faults.append(Fault(re.compile(path), None, 0, 0.0, None))
        return len(held)

    def clear_faults(self) -> None:
        self._faults.clear()
        for w in self._watches:
            if w.held and w.transport is not None:
                w.transport.abort()
        self._released.set()
        self._released = asyncio.Event()

    def requests_to(self, method: str, path: str) -> list[str]:
        """Paths (with query) of the requests seen so far with this method and path regex."""
        return [p for _, p in self.requests_at(method, path)]

    def requests_at(self, method: str, path: str) -> list[tuple[float, str]]:
        """(arrival time as time.time(), path with query) of the requests seen so far with
        this method and path regex: what benchmarks time a drain by."""
        return [(t, p) for m, p, t in list(self.requests) if m == method and re.search(path, p)]

    # --- HTTP ----------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        arrived = time.time()
        response = await self._answer(request, arrived)
        self.answers.append((request.method, request.path_qs, arrived, time.time(),
                             response.status))
        return response

    async def _answer(self, request: web.BaseRequest, arrived: float) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs, arrived))
        if len(self._web.connections if self._web else ()) > self.max_connections:
            return _json(status(429, "TooManyRequests", "too many connections to the fault "
                                "proxy"), 429, {"Retry-After": "1"})
        watch = _is_watch(request)
        for fault in list(self._faults):
            if not fault.matches(request.method, request.path) or (
                    fault.code in (0, 410) and not watch):
                continue
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.code == 0:
                await self._reset(request.transport)
            if fault.code == 410:
                return await self._expired(request)
            if fault.code is not None:
                reason, message = _ANSWERS.get(fault.code, ("", f"injected error {fault.code}"))
                body = (status(fault.code, reason, message, retryAfterSeconds=1)
                        if fault.code == 429 else status(fault.code, reason, message))
                return _json(body, fault.code,
                             {"Retry-After": "1"} if fault.code == 429 else None)
        return await self._forward(request)

    async def _reset(self, transport: asyncio.Transport | None) -> NoReturn:
        """Nothing more until `clear_faults`, then a reset; the handler is cancelled
        sooner if the client gives up."""
        await self._released.wait()
        if transport is not None:
            transport.abort()
        await asyncio.Future()  # cancelled with the connection
        raise AssertionError("unreachable")

    async def _expired(self, request: web.BaseRequest) -> web.StreamResponse:
        # The watch cache's answer (storage/cacher: newErrWatcher of NewResourceExpired).
        asked = request.query.get("resourceVersion", "0")
        event = {"type": "ERROR", "object": status(
            410, "Expired", f"too old resource version: {asked} ({asked}1)")}
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(json.dumps(event).encode() + b"\n")
        await response.write_eof()
        return response

    async def _forward(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in _HOP and k.lower() != "authorization"}
        if self.credential["token"]:
            headers["Authorization"] = f"Bearer {self.credential['token']}"
        body = await request.read() if request.can_read_body else None
        try:
            upstream = await self._session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body,
                allow_redirects=False)
        except aiohttp.ClientError as e:
            # What a client sees of a proxy whose upstream is gone (client-go: a 502).
            reason, message = _ANSWERS[502]
            return _json(status(502, reason, f"{message}: {e}"[:500]), 502)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP:
                    response.headers.add(k, v)
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            else:
                response.enable_chunked_encoding()
            await response.prepare(request)
            if not _is_watch(request) or upstream.status != 200:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
            watch = _Watch(request.path, response, request.transport)
            self._watches.add(watch)
            try:
                await self._stream(upstream, watch)
            finally:
                self._watches.discard(watch)
            return response

    async def _stream(self, upstream: aiohttp.ClientResponse, watch: _Watch) -> None:
        """Each chunk of the watch as it comes, until its end, a clean drop, or (held)
        never."""
        chunks = upstream.content.iter_any().__aiter__()
        ended = asyncio.ensure_future(watch.ended.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(anext(chunks, b""))
                # Its end, if the watch is cut while it waits, is nobody's news.
                nxt.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.wait([nxt, ended], return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await nxt
                    break
                chunk = nxt.result()
                if not chunk:
                    break
                if not watch.held:
                    await watch.response.write(chunk)
            if watch.held:
                await self._reset(watch.transport)
            await watch.response.write_eof()
        finally:
            ended.cancel()


def _json(body: dict[str, Any], code: int, headers: dict[str, str] | None = None
          ) -> web.Response:
    return web.Response(status=code, body=json.dumps(body).encode(),
                        content_type="application/json", headers=headers)


class ThreadedProxy:
    """A `FaultProxy` on a loop of its own thread; `call` runs code there and waits."""

    def __init__(self, proxy: FaultProxy, loop: asyncio.AbstractEventLoop) -> None:
        self.proxy = proxy
        self._loop = loop

    @property
    def url(self) -> str:
        return self.proxy.url

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the proxy's loop, e.g. ``call(proxy.proxy.fail, ...)``."""

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def run(self, coroutine: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result()

    def write_kubeconfig(self, path: Path) -> Path:
        return self.proxy.write_kubeconfig(path)


@contextlib.contextmanager
def serve_in_thread(kubeconfig: Path, **kwargs: Any) -> Iterator[ThreadedProxy]:
    """A running proxy for synchronous code; `kwargs` go to `FaultProxy`."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
    thread.start()

    async def make() -> FaultProxy:
        return await FaultProxy(kubeconfig, **kwargs).start()

    try:
        proxy = asyncio.run_coroutine_threadsafe(make(), loop).result()
        try:
            yield ThreadedProxy(proxy, loop)
        finally:
            asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
