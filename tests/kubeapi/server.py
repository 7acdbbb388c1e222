"""The stand-in's HTTP side: kube-apiserver's paths, Status bodies, chunked watches, faults.

A test runs it on its own loop (``async with StandIn() as api``), on a thread of its own
(`serve_in_thread`, for synchronous lab tests), or as a process (``python -m
tests.kubeapi``). Faults are switched from Python (`StandIn.fail`, `slow`, `down`) or,
for the process, through ``/stand-in/...`` paths the real API server does not have.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from tests.kubeapi import discovery
from tests.kubeapi.cluster import Cluster
from tests.kubeapi.rules import RESOURCES, ApiError, Obj, Resource, bad_request, internal_error

T = TypeVar("T")

_PATH = re.compile(
    r"/(?:api/(?P<core>v1)|apis/(?P<group>[a-z0-9.]+)/(?P<version>v[0-9a-z]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[a-z]+))?)?"
)
_BY_PATH = {(r.group, r.version, r.plural): r for r in RESOURCES}
_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool
_FAULT_ANSWERS = {
    401: ("Unauthorized", "Unauthorized"),
    403: ("Forbidden", 'nodes "gpu-node" is forbidden: User "system:node:hostagent" cannot '
          'patch resource "nodes" in API group "" at the cluster scope'),
    429: ("TooManyRequests", "too many requests, please try again later"),
    500: ("InternalError", "Internal error occurred: injected by the stand-in"),
    502: ("", 'an error on the server ("") has prevented the request from succeeding'),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "the server was unable to return a response in the time allotted"),
}


@dataclass
class Fault:
    """Requests whose path matches `path` (a regex) and `method` (None: any) are
    delayed by `delay` seconds, then answered `code` (None: answered normally), for the
    next `times` matching requests (None: until cleared)."""

    path: re.Pattern[str]
    method: str | None
    code: int | None
    delay: float
    times: int | None

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and bool(self.path.search(path))


def _method_not_allowed() -> ApiError:
    return ApiError(
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource",
        {},
    )


def _page_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _json(body: Obj, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


class StandIn:
    """The stand-in API server on 127.0.0.1 (port 0: any free port).

    `token`: if set, requests must carry ``Authorization: Bearer <token>``.
    `watch_timeout`: how long a watch without ``timeoutSeconds`` lasts (the real server
    picks 30 to 60 minutes). `state_file`: objects are read from it at start (if it
    exists) and written to it after every change, so a restarted process keeps them.
    Cluster knobs (termination_scale, replacement_node, ...) go to `Cluster`.
    """

    def __init__(
        self,
        cluster: Cluster | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        watch_timeout: float = 1800.0,
        state_file: Path | None = None,
        **cluster_knobs: Any,
    ) -> None:
        self.cluster = cluster if cluster is not None else Cluster(**cluster_knobs)
        self.host = host
        self.port = port
        self.token = token
        self.watch_timeout = watch_timeout
        self.state_file = state_file
        # (method, path with query, wall-clock time of arrival), oldest first
        self.requests: list[tuple[str, str, float]] = []
        self._faults: list[Fault] = []
        self._web: web.Server | None = None
        self._listener: asyncio.Server | None = None
        self._outages: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    async def start(self) -> StandIn:
        if self.state_file is not None and self.state_file.exists():
            self.cluster.load(json.loads(self.state_file.read_text()))
            self.cluster.resume_timers()
        if self.state_file is not None:
            self.cluster.on_commit = self._save
            self._save()
        await self.up()
        return self

    async def stop(self) -> None:
        for task in list(self._outages):
            task.cancel()
        await asyncio.gather(*self._outages, return_exceptions=True)
        await self.down()
        self.cluster.close()

    async def __aenter__(self) -> StandIn:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _save(self) -> None:
        assert self.state_file is not None
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(self.cluster.dump(), indent=1))
        os.replace(tmp, self.state_file)

    # --- faults --------------------------------------------------------------------------

    async def up(self) -> None:
        """Listen again, on the same port."""
        if self._listener is not None:
            return
        self._web = web.Server(self._handle, handler_cancellation=True)
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(self._web, self.host, self.port)
        self.port = self._listener.sockets[0].getsockname()[1]

    async def down(self) -> None:
        """Refuse connections and cut the open ones, watches included, as a dead server would."""
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        listener.close()
        # A connection accepted just before is made a moment later: cut it too, or its
        # transport is left to the garbage collector.
        await asyncio.sleep(0.05)
        self.cluster.close_watches()
        assert self._web is not None
        for handler in self._web.connections:
            if handler.transport is not None:
                handler.transport.abort()
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

    def fail(
        self, path: str = ".", *, code: int = 500, times: int | None = 1, method: str | None = None
    ) -> None:
        """Answer `code` to the next `times` requests whose path matches `path`."""
        self._faults.append(Fault(re.compile(path), method, code, 0.0, times))

    def slow(
        self, path: str = ".", *, delay: float, times: int | None = None, method: str | None = None
    ) -> None:
        """Delay matching requests by `delay` seconds before answering them."""
        self._faults.append(Fault(re.compile(path), method, None, delay, times))

    def clear_faults(self) -> None:
        self._faults.clear()

    def requests_to(self, method: str, path: str) -> list[str]:
        """Paths (with query) of the requests seen so far with this method and path regex."""
        return [p for _, p in self.requests_at(method, path)]

    def requests_at(self, method: str, path: str) -> list[tuple[float, str]]:
        """(arrival time as time.time(), path with query) of the requests seen so far with
        this method and path regex: what benchmarks time a drain by."""
        return [(t, p) for m, p, t in self.requests if m == method and re.search(path, p)]

    # --- HTTP ----------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path.startswith("/stand-in/"):
            return await self._control(request)
        self.requests.append((request.method, request.path_qs, time.time()))
        try:
            await self._apply_faults(request.method, request.path)
            if (
                self.token is not None
                and request.headers.get("Authorization") != f"Bearer {self.token}"
            ):
                return _json(
                    {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": "Unauthorized", "reason": "Unauthorized", "code": 401},
                    401,
                )  # fmt: skip
            return await self._route(request)
        except ApiError as e:
            return _json(e.status(), e.code, e.headers)

    async def _apply_faults(self, method: str, path: str) -> None:
        for fault in list(self._faults):
            if not fault.matches(method, path):
                continue
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.code is not None:
                if fault.code == 500:
                    raise internal_error("injected by the stand-in")
                reason, message = _FAULT_ANSWERS.get(
                    fault.code, ("", f"injected error {fault.code}")
                )
                headers = {"Retry-After": "1"} if fault.code == 429 else None
                raise ApiError(fault.code, reason, message, {}, headers)

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path == "/version":
            return _json(
                {
                    "major": "1",
                    "minor": "30",
                    "gitVersion": "v1.30.0-stand-in",
                    "platform": "linux/amd64",
                }
            )
        if request.path in ("/healthz", "/readyz", "/livez"):
            return web.Response(text="ok")
        found = self._discovery(request.path)
        if found is not None:
            if request.method != "GET":
                raise _method_not_allowed()
            return _json(found)
        m = _PATH.fullmatch(request.path)
        if m is None:
            raise _page_not_found()
        group, version = ("", m["core"]) if m["core"] else (m["group"], m["version"])
        resource = _BY_PATH.get((group, version, m["plural"]))
        namespace, name, sub = m["ns"], m["name"], m["sub"]
        if resource is None or (namespace is not None and not resource.namespaced):
            raise _page_not_found()
        method, query = request.method, request.query
        if name is None:
            if method == "GET" and query.get("watch") in _TRUE:
                return await self._watch(request, resource, namespace)
            if method == "GET":
                listed = self.cluster.list(
                    resource,
                    namespace,
                    field_selector=query.get("fieldSelector", ""),
                    label_selector=query.get("labelSelector", ""),
                )
                if discovery.wants_table(request.headers.get("Accept", "")):
                    return _json(discovery.table(
                        resource, listed["items"], listed["metadata"]["resourceVersion"],
                        query.get("includeObject", "Metadata")))
                return _json(listed)
            if method == "POST" and (namespace is not None or not resource.namespaced):
                return _json(self.cluster.create(resource, namespace, await _body(request)), 201)
            raise _method_not_allowed()
        if sub not in (None, "status", "eviction") or (
            sub == "eviction" and resource.plural != "pods"
        ):
            raise _page_not_found()
        if sub == "eviction":
            if method != "POST":
                raise _method_not_allowed()
            assert namespace is not None
            return _json(self.cluster.evict(namespace, name, await _body(request)), 201)
        if method == "GET":
            obj = self.cluster.get(resource, namespace, name)
            if sub is None and discovery.wants_table(request.headers.get("Accept", "")):
                return _json(discovery.table(resource, [obj], obj["metadata"]["resourceVersion"],
                                             query.get("includeObject", "Metadata")))
            return _json(obj)
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "")
            body = await request.read()
            return _json(
                self.cluster.patch(resource, namespace, name, content_type, body, subresource=sub)
            )
        if method == "PUT":
            return _json(
                self.cluster.replace(
                    resource, namespace, name, await _body(request), subresource=sub
                )
            )
        if method == "DELETE" and sub is None:
            options = await _body(request) if request.can_read_body else {}
            if "gracePeriodSeconds" in query:
                options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
            return _json(self.cluster.delete(resource, namespace, name, options))
        raise _method_not_allowed()

    def _discovery(self, path: str) -> Obj | None:
        """Discovery documents (legacy form: see tests.kubeapi.discovery)."""
        path = path.rstrip("/") or "/"
        if path == "/api":
            return discovery.api_versions(f"{self.host}:{self.port}")
        if path == "/apis":
            return discovery.api_group_list()
        if path == "/api/v1":
            return discovery.api_resource_list("", "v1")
        parts = path.split("/")
        if len(parts) == 3 and parts[1] == "apis":
            return discovery.api_group(parts[2])
        if len(parts) == 4 and parts[1] == "apis":
            return discovery.api_resource_list(parts[2], parts[3])
        return None

    async def _watch(
        self, request: web.BaseRequest, resource: Resource, namespace: str | None
    ) -> web.StreamResponse:
        query = request.query
        watcher = self.cluster.watch(
            resource,
            namespace,
            field_selector=query.get("fieldSelector", ""),
            label_selector=query.get("labelSelector", ""),
            resource_version=query.get("resourceVersion", ""),
        )
        try:
            timeout = float(query.get("timeoutSeconds") or self.watch_timeout)
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while (event := await watcher.queue.get()) is not None:
                        await response.write(json.dumps(event).encode() + b"\n")
        finally:
            self.cluster.unwatch(watcher)
        if self.is_up:
            await response.write_eof()
        return response

    async def _control(self, request: web.BaseRequest) -> web.StreamResponse:
        """Fault switches for a stand-in running as a process."""
        body = await _body(request) if request.can_read_body else {}
        if request.path == "/stand-in/faults" and request.method == "POST":
            if body.get("code") is not None:
                self.fail(body.get("path", "."), code=int(body["code"]), times=body.get("times", 1),
                          method=body.get("method"))  # fmt: skip
            if body.get("delay"):
                self.slow(body.get("path", "."), delay=float(body["delay"]), times=body.get("times"),
                          method=body.get("method"))  # fmt: skip
            return _json({"faults": len(self._faults)}, 201)
        if request.path == "/stand-in/faults" and request.method == "DELETE":
            self.clear_faults()
            return _json({"faults": 0})
        if request.path == "/stand-in/down" and request.method == "POST":
            # Answered first: the outage starts once this reply is on its way.
            asyncio.get_running_loop().call_later(
                0.05, self.down_for, float(body.get("seconds", 1))
            )
            return _json({"down_for": body.get("seconds", 1)}, 202)
        raise _page_not_found()


async def _body(request: web.BaseRequest) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as e:
        raise bad_request(f"error decoding the request body: {e}") from None


def write_kubeconfig(path: Path, url: str, *, token: str | None = None) -> Path:
    """A kubeconfig for the stand-in: plain HTTP, and a bearer token if one is given."""
    user = f"    token: {json.dumps(token)}\n" if token else "    {}\n"
    path.write_text(
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        "- name: stand-in\n"
        "  cluster:\n"
        f"    server: {url}\n"
        "contexts:\n"
        "- name: stand-in\n"
        "  context:\n"
        "    cluster: stand-in\n"
        "    user: stand-in\n"
        "current-context: stand-in\n"
        "users:\n"
        "- name: stand-in\n"
        "  user:\n" + user
    )
    return path


class ThreadedStandIn:
    """A `StandIn` on a loop of its own thread; `call` runs code there and waits."""

    def __init__(self, standin: StandIn, loop: asyncio.AbstractEventLoop) -> None:
        self.standin = standin
        self._loop = loop

    @property
    def url(self) -> str:
        return self.standin.url

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the stand-in's loop, e.g. ``call(cluster.add_pod, ...)``."""

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def run(self, coroutine: Awaitable[T]) -> T:
        async def wrap() -> T:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result()

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        return write_kubeconfig(path, self.url, token=token or self.standin.token)


@contextlib.contextmanager
def serve_in_thread(**kwargs: Any) -> Iterator[ThreadedStandIn]:
    """A running stand-in for synchronous code; `kwargs` go to `StandIn`."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kubeapi-stand-in", daemon=True)
    thread.start()

    async def make() -> StandIn:
        return await StandIn(**kwargs).start()

    try:
        standin = asyncio.run_coroutine_threadsafe(make(), loop).result()
        try:
            yield ThreadedStandIn(standin, loop)
        finally:
            asyncio.run_coroutine_threadsafe(standin.stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
