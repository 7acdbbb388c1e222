"""Bad replies from the API server, fuzzed: whatever it answers, the adapter raises one of
its own errors (or gets on with it), never a Python error out of the client's parsing.

The server here answers each request with a generated HTTP status and body: Status
bodies whose fields have the wrong types (the `details` or `causes` of a real one are
objects), Nodes and pod lists with lists where objects belong, bodies that are not JSON.
The real kubernetes-asyncio client talks to it over HTTP, on a loop of its own thread,
as in test_fuzz_protocols.py; every example is one adapter call. Watches get events of
the wrong shape too: the node is listed again, and followed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.host import journal
from hostagent.core.config import DrainTimeoutAction
from hostagent.cluster.kube import Kube, KubeError, KubeRequestError, Taint, Timing
from tests.unit.kube_scaffold import plain_kubeconfig
from tests.unit.fuzz_scaffold import _text, _value

EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "3_000")) // 3  # HTTP round trips
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
FAST = Timing(request_timeout=5.0, api_timeout=10.0, backoff_min=0.0005, backoff_max=0.001,
              evict_retry=0.0005, delete_poll=0.0005, watch_timeout=1.0)
NOT_FOUND = (404, json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "reason": "NotFound", "message": "not found", "code": 404}))
# The list that ends a wait on the slices: it comes only after every generated reply was
# answered, and the follower takes each answer in before it asks again.
NO_SLICES = (200, json.dumps({"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                              "metadata": {"resourceVersion": "1"}, "items": []}))
Reply = tuple[int, str | bytes]


class Server:
    """Answers each request with the next of `replies`; when none is left, 404, or
    `ending` to a request that is not a watch (and then `ended` is set)."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.ending: Reply | None = None
        self.ended = False
        self.runner: web.ServerRunner | None = None
        self.url = ""

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        await request.read()
        if self.replies:
            status, body = self.replies.popleft()
        elif self.ending is not None and request.query.get("watch", "").lower() != "true":
            (status, body), self.ended = self.ending, True
        else:
            status, body = NOT_FOUND
        return web.Response(status=status, body=body if isinstance(body, bytes)
                            else body.encode("utf-8", "surrogatepass"),
                            content_type="application/json")

    async def start(self) -> None:
        self.runner = web.ServerRunner(web.Server(self.handle))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"


class Live:
    """The server and a `Kube` connected to it, on an event loop that runs in a thread."""

    def __init__(self, directory: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-kube")
        self.thread.start()
        self.server = Server()
        self.run(self.server.start())
        kubeconfig = plain_kubeconfig(directory / "kubeconfig", self.server.url)
        self.kube: Kube = self.run(Kube.connect(kubeconfig, timing=FAST))

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def close(self) -> None:
        self.run(self.kube.close())
        assert self.server.runner is not None
        self.run(self.server.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    sink = journal.use_sink(journal.ListSink())
    logging.getLogger("hostagent.cluster.kube").propagate = False  # thousands of retries, expected
    with tempfile.TemporaryDirectory(prefix="fz-kube-") as d:
        served = Live(Path(d))
        try:
            yield served
        finally:
            served.close()
            journal.use_sink(sink)
            logging.getLogger("hostagent.cluster.kube").propagate = True


def call(live: Live, op: str, replies: list[Reply]) -> object:
    """The adapter's answer to one call while the server answers `replies`: its result,
    or the KubeError it raised. Anything else escapes."""
    live.server.replies = deque(replies)
    live.server.ending, live.server.ended = (NO_SLICES if op == "slices" else None), False
    kube = live.kube
    calls: dict[str, Callable[[], Coroutine[Any, Any, object]]] = {
        "check": lambda: kube.check_node("n"),
        "cordon": lambda: kube.cordon("n", marker_prefix="hostagent.io/"),
        "uncordon": lambda: kube.uncordon("n", marker_prefix="hostagent.io/"),
        "taint": lambda: kube.annotate("n", {"a": "b"},
                                       add_taints=[Taint("k", "v", "NoSchedule")]),
        "event": lambda: kube.post_event("n", reason="Test", message="fuzz"),
        "drain": lambda: kube.drain("n", timeout=5, emptydir_ok=True, unmanaged_ok=True,
                                    on_timeout=DrainTimeoutAction.PROCEED),
        "dra": lambda: kube.gpu_api_of("n", driver="gpu.nvidia.com", resource="nvidia.com/gpu"),
        # Until the follower has taken in every reply (it lists again after each failure,
        # and the list after the last is NO_SLICES): a fixed timeout waited it out.
        "slices": lambda: kube.wait_devices("n", driver="gpu.nvidia.com",
                                            done=lambda _: live.server.ended, timeout=10),
    }
    try:
        return live.run(calls[op]())
    except KubeError as e:
        return e


# --- the Status body of an error -------------------------------------------------------


@pytest.mark.parametrize("details", [
    "a string", ["a", "list"], 3, {"causes": "a string"}, {"causes": {"message": "x"}},
    {"causes": [{"message": "\x1b]52;c;cm0gLXJmIC8K\x07"}]},
    {"causes": ["a string", 3, None, {"message": ["not", "a", "string"]}]},
])
def test_a_status_of_any_shape_is_a_request_error(live: Live, details: object) -> None:
    """A real Status has objects in `details` and `causes`; any other shape is still the
    server's answer: a refusal with its message, not an AttributeError."""
    body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Invalid",
                       "message": "the node is invalid\x1b[2J", "code": 422, "details": details})
    e = call(live, "check", [(422, body)])
    assert isinstance(e, KubeRequestError), e
    assert e.status == 422 and e.reason == "Invalid" and "the node is invalid" in str(e)
    assert str(e).isprintable()  # the server's words, cleaned as they come in
    assert all(isinstance(c, str) and c.isprintable() for c in e.causes)


# --- any reply ---------------------------------------------------------------------------

STATUSES = (200, 200, 200, 201, 400, 404, 409, 422, 429, 500, 503)


def _shaped(rng: random.Random) -> Any:
    """An API object with some fields of the wrong type: Status, Node, or a pod list."""
    meta = {"name": "n", "resourceVersion": "1", "annotations": {"hostagent.io/cordoned-by":
                                                                  "hostagent"}}
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u",
                        "ownerReferences": [{"kind": "ReplicaSet", "controller": True,
                                             "name": "r", "uid": "r", "apiVersion": "v1"}]},
           "spec": {"volumes": [{"name": "v", "emptyDir": {}}], "containers": []},
           "status": {"phase": "Running"}}
    obj = rng.choice([
        {"kind": "Status", "status": "Failure", "reason": "Invalid", "message": "m",
         "code": 422, "details": {"causes": [{"message": "c", "field": "f"}]}},
        {"kind": "Node", "metadata": meta, "spec": {"unschedulable": True, "taints": [
            {"key": "k", "effect": "NoSchedule"}]}, "status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            "allocatable": {"nvidia.com/gpu": "2"}}},
        {"kind": "PodList", "metadata": {"resourceVersion": "1"}, "items": [pod, pod]},
        {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "1"}, "items": [
            {"metadata": {"name": "s", "uid": "u"}, "spec": {
                "driver": "gpu.nvidia.com", "nodeName": "n",
                "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {
                    "uuid": {"string": "GPU-0"}, "index": {"int": 0}}}]}}]},
    ])
    for _ in range(rng.randrange(1, 4)):  # retype a field, at some depth
        target = obj
        while isinstance(target, dict) and target and rng.random() < 0.6:
            key = rng.choice(sorted(target))
            if not isinstance(target[key], dict | list) or rng.random() < 0.3:
                target[key] = _value(rng)
                break
            target = target[key] if isinstance(target[key], dict) else (
                target[key][0] if target[key] and isinstance(target[key][0], dict) else target)
            if not isinstance(target, dict):
                break
    return obj


def _reply(rng: random.Random) -> Reply:
    status = rng.choice(STATUSES)
    match rng.randrange(6):
        case 0:
            return status, rng.randbytes(rng.randrange(40))
        case 1:
            return status, json.dumps(_value(rng), allow_nan=True, ensure_ascii=False)
        case 2:
            return status, _text(rng)
        case _:
            return status, json.dumps(_shaped(rng), allow_nan=True, ensure_ascii=False)


@st.composite
def exchanges(draw: st.DrawFn) -> tuple[str, list[Reply]]:
    op = draw(st.sampled_from(["check", "cordon", "uncordon", "taint", "event", "drain", "dra",
                               "slices"]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    return op, [_reply(rng) for _ in range(rng.randrange(1, 5))]


@fuzz
@given(exchanges())
def test_any_reply_is_an_answer_or_a_kube_error(live: Live,
                                                exchange: tuple[str, list[Reply]]) -> None:
    op, replies = exchange
    answer = call(live, op, replies)  # a non-Kube error escapes and fails the example
    if isinstance(answer, KubeError):  # it is printed: the server's words, cleaned
        assert str(answer).isprintable(), answer


def test_the_backoff_stays_bounded_however_many_attempts(live: Live) -> None:
    """A request that fails at once (a pod list whose pods have no name cannot even be
    evicted) tries thousands of times within a drain's deadline."""
    for attempt in (0, 10, 1100, 10**6):
        assert 0 <= live.kube._backoff(attempt) <= FAST.backoff_max


# --- watches ---------------------------------------------------------------------------

BAD_EVENTS = ['{"type": "MODIFIED", "object": []}', '{"object": {}}', "not JSON", "[1]",
              '{"type": "ERROR", "object": {"code": 500}}', '{"type": "MODIFIED"}',
              '{"type": "MODIFIED", "object": {"metadata": []}}',
              '{"type": "ADDED", "object": {"kind": "Node", "status": {"conditions": 3}}}']


class Watched:
    """Lists one node and no pods; every watch sends `event`, then ends."""

    def __init__(self, event: str) -> None:
        self.event = event.encode()
        self.watches = 0
        self.server = Server()
        self.server.handle = self.handle  # type: ignore[method-assign]

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.query.get("watch"):
            self.watches += 1
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(self.event + b"\n")
            return response
        items = [] if "pods" in request.path else [
            {"metadata": {"name": "n", "uid": "u", "resourceVersion": "1"},
             "status": {"conditions": [{"type": "Ready", "status": "False"}]}}]
        return web.json_response({"metadata": {"resourceVersion": "1"}, "items": items})


@pytest.mark.parametrize("event", BAD_EVENTS)
async def test_a_watch_event_of_any_shape_is_followed_by_a_fresh_list(
        tmp_path: Path, event: str) -> None:
    """A watch event the client cannot read ended the watch with a Python error, and the
    agent with it; the node is listed again instead, and the waiting ends as it would."""
    watched = Watched(event)
    await watched.server.start()
    try:
        kubeconfig = plain_kubeconfig(tmp_path / "kubeconfig", watched.server.url)
        async with await Kube.connect(kubeconfig, timing=FAST) as kube:
            views: list[Any] = []
            follow = asyncio.create_task(kube.watch_node("n", resources=["nvidia.com/gpu"],
                                                         on_change=views.append))
            with pytest.raises(KubeError):
                await kube.wait_ready("n", timeout=1)
            assert not follow.done(), follow
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            assert views and views[0].exists and not views[0].ready
            assert watched.watches >= 3  # each watch followed by a list and a new watch
    finally:
        assert watched.server.runner is not None
        await watched.server.runner.cleanup()
