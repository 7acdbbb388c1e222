"""The fault proxy in front of the real kube-apiserver: it forwards as its credential
(that user's RBAC, whatever the client presents), streams watches as they come, and
injects what it is asked to: error answers with the server's Status bodies, delays, an
outage, and dropped, half-open and expired watches."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.controlplane import ControlPlane
from tests.controlplane.proxy import FaultProxy, serve_in_thread
from tests.waiting import until

NAMES = itertools.count()


@pytest.fixture
async def proxy(plane: ControlPlane) -> AsyncIterator[FaultProxy]:
    async with FaultProxy(plane.admin) as p:
        yield p


@pytest.fixture
async def http(proxy: FaultProxy, tmp_path: Path) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of the proxy with the certificates of the kubeconfig it writes."""
    config = json.loads(proxy.write_kubeconfig(tmp_path / "kc").read_text())
    context = ssl.create_default_context(
        cafile=config["clusters"][0]["cluster"]["certificate-authority"])
    user = config["users"][0]["user"]
    context.load_cert_chain(user["client-certificate"], user["client-key"])
    async with aiohttp.ClientSession(proxy.url, connector=aiohttp.TCPConnector(
            ssl=context), timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def configmap(plane: ControlPlane, namespace: str, name: str) -> None:
    await asyncio.to_thread(plane.kubectl, "create", "configmap", name, "-n", namespace)


@pytest.fixture
async def namespace(plane: ControlPlane) -> AsyncIterator[str]:
    name = f"proxy-{next(NAMES)}"  # one each: a deleted namespace takes a while to go
    await asyncio.to_thread(plane.kubectl, "create", "namespace", name)
    try:
        yield name
    finally:
        await asyncio.to_thread(plane.kubectl, "delete", "namespace", name, "--wait=false")


async def test_it_forwards_as_its_credential_and_only_as_it(
        plane: ControlPlane, tmp_path: Path) -> None:
    nobody = plane.credential("nobody", "nobody")
    async with FaultProxy(nobody) as proxy:
        kc = proxy.write_kubeconfig(tmp_path / "kc")  # the admin's certificate to the proxy
        out = await asyncio.to_thread(plane.kubectl, "get", "nodes", kubeconfig=kc,
                                      check=False)
        assert out.returncode != 0
        assert 'User "nobody" cannot list resource "nodes"' in out.stderr
    async with FaultProxy(plane.admin) as proxy:
        kc = proxy.write_kubeconfig(tmp_path / "kc")
        out = await asyncio.to_thread(plane.kubectl, "get", "--raw", "/version", kubeconfig=kc)
        assert json.loads(out.stdout)["gitVersion"] == plane.version()
        assert proxy.requests_to("GET", "^/version$") == ["/version"]


async def test_a_client_without_the_labs_certificate_is_refused(
        proxy: FaultProxy, plane: ControlPlane) -> None:
    context = ssl.create_default_context(cafile=str(plane.pki / "ca.crt"))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            await session.get(proxy.url + "/version", ssl=context)
    assert proxy.requests == type(proxy.requests)()


async def test_faults_answer_as_the_server_does(proxy: FaultProxy,
                                                http: aiohttp.ClientSession) -> None:
    proxy.fail("^/api/v1/nodes$", code=429, times=1, method="GET")
    async with http.get("/api/v1/nodes") as r:
        body = await r.json()
        assert (r.status, r.headers["Retry-After"]) == (429, "1")
        assert (body["kind"], body["reason"], body["code"]) == ("Status", "TooManyRequests",
                                                                429)
    async with http.get("/api/v1/nodes") as r:  # times=1: the real answer again
        assert r.status == 200 and (await r.json())["kind"] == "NodeList"
    proxy.fail("/nodes", code=500, times=None)
    for _ in range(2):
        async with http.get("/api/v1/nodes/x") as r:
            assert (r.status, (await r.json())["reason"]) == (500, "InternalError")
    proxy.clear_faults()
    async with http.get("/api/v1/nodes/x") as r:  # the real server's 404
        assert (r.status, (await r.json())["reason"]) == (404, "NotFound")
    proxy.slow("/nodes", delay=0.3, times=1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.get("/api/v1/nodes") as r:
        assert r.status == 200
    assert loop.time() - started >= 0.3
    assert len(proxy.requests_to("GET", "^/api/v1/nodes")) == 6


async def test_down_refuses_and_up_listens_on_the_same_port(
        proxy: FaultProxy, http: aiohttp.ClientSession) -> None:
    port = proxy.port
    await proxy.down()
    with pytest.raises(aiohttp.ClientConnectionError):
        await http.get("/version")
    await proxy.down_for(0.1)  # an outage that ends by itself
    assert proxy.is_up and proxy.port == port
    async with http.get("/version") as r:
        assert r.status == 200


async def test_down_cuts_a_connection_still_in_its_tls_handshake(proxy: FaultProxy) -> None:
    # A server that dies resets every connection, one that has not said hello too (left
    # open, it outlived the outage and, once the test's loop closed, failed a later test
    # with an unclosed transport).
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    mine = writer.get_extra_info("sockname")
    await until(lambda: proxy.accepted_from(mine), "the connection accepted (no ClientHello)")
    await proxy.down()
    try:
        assert await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionResetError:
        pass  # cut: as good as closed
    finally:
        writer.close()


async def events(response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for line in response.content:
        yield json.loads(line)


async def watch(http: aiohttp.ClientSession, namespace: str, name: str, **query: str
                ) -> aiohttp.ClientResponse:
    """A watch of configmap `name` (not the namespace's kube-root-ca.crt, which the
    controller-manager adds to every new namespace)."""
    return await http.get(f"/api/v1/namespaces/{namespace}/configmaps",
                          params={"watch": "1", "fieldSelector": f"metadata.name={name}",
                                  **query},
                          timeout=aiohttp.ClientTimeout(total=None, sock_read=10))


async def test_a_watch_comes_event_by_event_and_can_be_dropped(
        plane: ControlPlane, proxy: FaultProxy, http: aiohttp.ClientSession,
        namespace: str) -> None:
    r = await watch(http, namespace, "one")
    async with r:
        stream = events(r)
        await configmap(plane, namespace, "one")
        event = await anext(stream)  # while the watch is still open
        assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "one")
        assert proxy.drop_watches("/configmaps") == 1
        with pytest.raises(aiohttp.ClientError):
            await anext(stream)


async def test_a_half_open_watch_gets_nothing_until_cleared(
        plane: ControlPlane, proxy: FaultProxy, http: aiohttp.ClientSession,
        namespace: str) -> None:
    r = await watch(http, namespace, "two")
    async with r:
        assert proxy.hold_watches("/configmaps") == 1
        await configmap(plane, namespace, "two")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1):
                await r.content.readline()
        proxy.clear_faults()  # the held connection is reset at last
        with pytest.raises(aiohttp.ClientError):
            await r.content.readline()


async def test_an_old_resource_version_is_gone(
        proxy: FaultProxy, http: aiohttp.ClientSession, namespace: str) -> None:
    # The real server answers a resourceVersion etcd has compacted so (every 5 minutes):
    # the proxy's answer is the same without the wait.
    proxy.expire("/configmaps")
    r = await watch(http, namespace, "three")
    async with r:
        stream = events(r)
        event = await anext(stream)
        assert (event["type"], event["object"]["reason"]) == ("ERROR", "Expired")
        with pytest.raises(StopAsyncIteration):
            await anext(stream)


def test_in_a_thread_for_synchronous_code(plane: ControlPlane, tmp_path: Path) -> None:
    with serve_in_thread(plane.admin) as proxy:
        kc = proxy.write_kubeconfig(tmp_path / "kc")
        proxy.call(proxy.proxy.fail, "/version", code=503)
        out = plane.kubectl("get", "--raw", "/version", kubeconfig=kc, check=False)
        assert out.returncode != 0
        assert proxy.call(proxy.proxy.requests_to, "GET", "/version") == ["/version"]
