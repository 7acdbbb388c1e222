"""The connection to the API server and the translation of its errors.

Library errors are translated here, once, into the tree the package's docstring draws
(``raise … from e``). Each request is retried with backoff and jitter until its
step's deadline (`Client._call`); a 401 is retried once with credentials read afresh.
A reply that is not what it must be (`_parsed`) is retried like an unreachable server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import (
    Awaitable,
    Callable,
    Sequence,
)
from dataclasses import dataclass
from functools import partial
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp

from hostagent.cluster import lazy  # noqa: F401  (before kubernetes_asyncio: see its docstring)
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.client.rest import RESTResponse

from hostagent.core.config import Kubernetes as KubernetesConfig
from hostagent.core.text import clean


log = logging.getLogger("hostagent.cluster.kube")


T = TypeVar("T")


MERGE_PATCH = "application/merge-patch+json"


# --- errors ----------------------------------------------------------------------------


class KubeError(Exception):
    """Something about the cluster that hostagent could not do; the message says what."""


class KubeConfigError(KubeError):
    """The kubeconfig is missing, unreadable or unusable: the agent cannot start."""


class NodeNotFound(KubeError):
    """The node named in the configuration is not in the cluster."""


class KubeUnavailable(KubeError):
    """The API server did not answer usefully before the deadline.

    `last` is the last error seen; empty when nothing failed and time simply ran out.
    """

    def __init__(self, message: str, *, last: str = "") -> None:
        super().__init__(message)
        self.last = last


class KubeRequestError(KubeError):
    """The API server refused a request; `status` is the HTTP code, `reason` the Status reason."""

    def __init__(
        self, message: str, *, status: int, reason: str, causes: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.causes = tuple(causes)


class KubeAuthError(KubeError):
    """401 or 403: not an outage. Retrying will not help and nothing may be skipped
    because of it: the caller must stop and say so. `status` is the HTTP code."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class NodeNotReady(KubeError):
    """The node did not become Ready before the deadline."""


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True, kw_only=True)
class NodeCheck:
    """`Kube.check_node`'s answer."""

    node: str
    exists: bool
    ready: bool = False
    unschedulable: bool = False
    detail: str = ""

    def __str__(self) -> str:
        if not self.exists:
            return (f"node {self.node} is not in the cluster; it registers when the "
                    "lendee's kubelet starts")
        state = "Ready" if self.ready else f"not Ready ({self.detail or 'no Ready condition'})"
        return f"node {self.node} is {state}" + (", cordoned" if self.unschedulable else "")


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How long to wait between tries, in seconds; tests shrink these."""

    request_timeout: float = 30.0  # one HTTP request
    api_timeout: float = 60.0  # cordon, uncordon, annotate, check_node, unless given one
    backoff_min: float = 0.5  # first retry after an unreachable API or a 5xx
    backoff_max: float = 15.0
    evict_retry: float = 5.0  # kubectl drain retries a 429 every 5 s
    delete_poll: float = 1.0  # kubectl drain checks each second whether a pod is gone
    # (here also woken at once by a watch on the node's pods: see Kube.drain)
    watch_timeout: float = 60.0  # ask the server to end each watch; we re-read and resume


# --- reading API objects ---------------------------------------------------------------


def _annotations(node: Any) -> dict[str, str]:
    return dict(node.metadata.annotations or {})


def _unschedulable(node: Any) -> bool:
    return bool(node.spec is not None and node.spec.unschedulable)


def _ready(node: Any) -> Any | None:
    conditions = node.status.conditions if node.status is not None else None
    return next((c for c in conditions or [] if c.type == "Ready"), None)


def _is_ready(node: Any) -> bool:
    condition = _ready(node)
    return condition is not None and condition.status == "True"


def _gpus(node: Any, resource: str) -> int:
    allocatable = (node.status.allocatable if node.status is not None else None) or {}
    try:
        return int(allocatable.get(resource, "0"))
    except ValueError:
        return 0  # extended resources are whole numbers; anything else counts for nothing


def _status_of(e: ApiException) -> tuple[str, str, list[str]]:
    """(reason, message, cause messages) from the Status body of an error answer.

    The body is whatever the server (or a proxy before it) sent: each field is taken
    only where it has the type a Status gives it, and ignored otherwise."""
    try:
        body = json.loads(e.body or b"{}")
    except (ValueError, TypeError, RecursionError):
        body = None
    body = body if isinstance(body, dict) else {}
    details = body.get("details")
    causes = details.get("causes") if isinstance(details, dict) else None
    fallback = e.reason if isinstance(e.reason, str) else ""
    return (
        clean(_string(body.get("reason")) or fallback, 200),
        clean(_string(body.get("message")) or fallback),
        [clean(_string(c.get("message"))) for c in causes[:20] if isinstance(c, dict)]
        if isinstance(causes, list) else [],
    )


def _string(value: object) -> str:
    return value if isinstance(value, str) else ""


class _Unreadable(Exception):
    """A reply of a shape the client or the adapter cannot read."""


# What the client's parsing raises on a reply of the wrong shape: a list where an
# object belongs, a required field missing, a body that is not JSON or not UTF-8.
_PARSING = (ValueError, TypeError, AttributeError, KeyError, RecursionError)


async def _parsed(request: Callable[[], Awaitable[T]], readable: Callable[[Any], bool]) -> T:
    """`request()`'s object; _Unreadable when it cannot be read."""
    try:
        result = await request()
    except (ApiException, aiohttp.ClientError, OSError):
        raise
    except _PARSING as e:
        # An error answer whose body is not UTF-8 fails inside the client's own handler
        # of that answer: the answer still stands.
        if isinstance(e.__context__, ApiException):
            raise e.__context__ from None
        raise _Unreadable(f"a reply that could not be read ({type(e).__name__}: "
                          f"{clean(e, 200)})") from e
    try:
        ok = readable(result)
    except _PARSING:
        ok = False
    if not ok:
        raise _Unreadable(f"a reply that is not what was asked for ({type(result).__name__})")
    return result


def _malformed(e: BaseException) -> bool:
    """A watch event that could not be read: the client's parsing errors, and the bare
    Exception kubernetes-asyncio raises for an event without a type or an object."""
    return isinstance(e, _PARSING) or type(e) is Exception


def _listed(reply: Any) -> bool:
    return getattr(reply, "metadata", None) is not None and isinstance(
        getattr(reply, "items", None), list)


def _node(reply: Any) -> bool:
    return isinstance(reply, k8s.V1Node) and reply.metadata is not None


def _pod(reply: Any) -> bool:  # named: its eviction and reads go by name
    return (isinstance(reply, k8s.V1Pod) and reply.metadata is not None
            and isinstance(reply.metadata.name, str) and isinstance(reply.metadata.namespace, str))


def _pods(reply: Any) -> bool:
    return isinstance(reply, k8s.V1PodList) and all(_pod(p) for p in reply.items)


def _transient(e: ApiException) -> bool:
    status = e.status or 0
    return status >= 500 or status == 429


def _eviction_transient(e: ApiException) -> bool:
    # 429 is a budget saying no, handled by the drain; a 500 about budgets is a
    # misconfiguration no retry fixes. Other 5xx are the API server's trouble.
    if (e.status or 0) < 500:
        return False
    _, message, _ = _status_of(e)
    return "PodDisruptionBudget" not in message


def _describe(e: BaseException) -> str:
    if isinstance(e, ApiException):
        reason, message, _ = _status_of(e)
        return f"{e.status} {reason}: {message}" if message else f"{e.status} {reason}"
    return clean(e) or type(e).__name__


def _timestamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _default_kubeconfig() -> Path:
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(first) if first else Path.home() / ".kube" / "config"


class Client:
    """A connection to the cluster: its credentials and its requests, with retries."""

    def __init__(
        self,
        api_client: Any,
        *,
        timing: Timing | None = None,
        server: str = "",
        reload: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self._api_client = api_client
        self._core = k8s.CoreV1Api(api_client)
        self._resource = k8s.ResourceV1Api(api_client)
        self._apps = k8s.AppsV1Api(api_client)
        self.timing = timing or Timing()
        self.server = server or str(getattr(api_client.configuration, "host", ""))
        # Reads the credentials again (a fresh kubernetes-asyncio Configuration): after
        # a 401, the kubeconfig's client certificate may have been rotated (k3s does it
        # yearly) or an exec plugin's token may have expired.
        self._reload = reload
        self._retired: list[Any] = []  # clients replaced by a reload, closed with ours

    @classmethod
    async def connect(cls, kubeconfig: Path | None = None, *, timing: Timing | None = None) -> Self:
        """Read `kubeconfig`; without one, the in-cluster service account or the default
        kubeconfig ($KUBECONFIG, ~/.kube/config). Raises KubeConfigError."""

        async def load() -> Any:
            configuration = k8s.Configuration()
            if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                try:
                    k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
                except Exception as e:  # the library raises several kinds; all mean "unusable"
                    raise KubeConfigError(f"in-cluster Kubernetes configuration: {e}") from e
                return configuration
            path = kubeconfig if kubeconfig is not None else _default_kubeconfig()
            _check_readable(path, given=kubeconfig is not None)
            try:
                await k8s_config.load_kube_config(
                    config_file=str(path), client_configuration=configuration, persist_config=False
                )
            except Exception as e:  # yaml, ConfigException, KeyError...: all mean "unusable"
                raise KubeConfigError(f"kubeconfig {path}: not usable: {e}") from e
            return configuration

        configuration = await load()
        return cls(k8s.ApiClient(configuration), timing=timing, server=configuration.host or "",
                   reload=load)

    @classmethod
    async def from_config(cls, settings: KubernetesConfig, *, timing: Timing | None = None) -> Self:
        return await cls.connect(settings.kubeconfig, timing=timing)

    async def close(self) -> None:
        for client in [*self._retired, self._api_client]:
            await client.close()
        self._retired.clear()

    async def _refresh_credentials(self) -> bool:
        """Read the credentials again and use them from now on; False if they cannot be."""
        if self._reload is None:
            return False
        try:
            configuration = await self._reload()
        except KubeConfigError as e:
            log.warning("could not read the Kubernetes credentials again: %s", e)
            return False
        self._retired.append(self._api_client)
        self._api_client = k8s.ApiClient(configuration)
        self._core = k8s.CoreV1Api(self._api_client)
        self._resource = k8s.ResourceV1Api(self._api_client)
        self._apps = k8s.AppsV1Api(self._api_client)
        log.info("read the Kubernetes credentials again after a 401 from %s", self.server)
        return True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests, with retries ----------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _deadline(self, timeout: float | None) -> float:
        return self._now() + (self.timing.api_timeout if timeout is None else timeout)

    def _watch_bound(self, seconds: float) -> float:
        """How long a watch the server was asked to end after `seconds` may stay open
        before it is taken for a half-open connection (see `Timing`)."""
        return seconds + self.timing.request_timeout

    def _backoff(self, attempt: int) -> float:
        # The exponent is bounded: 2.0**1024 overflows, and a request that fails at once
        # reaches that many attempts within a long deadline.
        ceiling = min(self.timing.backoff_max, self.timing.backoff_min * 2.0**min(attempt, 60))
        return ceiling / 2 + random.uniform(0, ceiling / 2)  # jitter: no retries in lockstep

    async def _call(
        self,
        what: str,
        request: Callable[[], Awaitable[T]],
        deadline: float,
        *,
        transient: Callable[[ApiException], bool] = _transient,
        readable: Callable[[Any], bool] = lambda _: True,
    ) -> T:
        """`request()`, retried while the API is unreachable or answers 5xx, until `deadline`.

        A reply the client cannot parse, or whose object `readable` refuses, counts as
        no answer (retried like a 5xx): the server, or a proxy before it, is not one
        whose word can be taken."""
        attempt = 0
        last = ""
        refreshed = False
        while True:
            remaining = deadline - self._now()
            if remaining <= 0:
                raise KubeUnavailable(
                    f"could not {what}: the API server at {self.server} did not answer in time"
                    + (f" (last: {last})" if last else ""),
                    last=last,
                )
            limit = min(remaining, self.timing.request_timeout)
            try:
                async with asyncio.timeout(limit):
                    return await _parsed(request, readable)
            except _Unreadable as e:
                last = str(e)
            except ApiException as e:
                if e.status == 401 and not refreshed:
                    refreshed = True
                    if await self._refresh_credentials():
                        continue  # once, at once, with what the kubeconfig says now
                if e.status in (401, 403):
                    _, message, _ = _status_of(e)
                    what_failed = ("the API server does not accept hostagent's credentials"
                                   if e.status == 401 else "hostagent's credentials lack a right")
                    raise KubeAuthError(
                        f"could not {what}: {what_failed} ({e.status} {message}); fix the "
                        "kubeconfig, or apply the RBAC that ships with hostagent "
                        "(deploy/rbac.yaml: every right it needs, and no more)",
                        status=e.status,
                    ) from e
                if not transient(e):
                    reason, message, causes = _status_of(e)
                    raise KubeRequestError(
                        f"could not {what}: {message}",
                        status=e.status or 0,
                        reason=reason,
                        causes=causes,
                    ) from e
                last = _describe(e)
            except TimeoutError as e:
                if limit >= self.timing.request_timeout:
                    last = _describe(e)  # one cut short by the deadline is no failure
            except (aiohttp.ClientError, OSError) as e:
                last = _describe(e)
            delay = self._backoff(attempt)
            if attempt == 0 and last:
                log.warning("could not %s (%s); retrying", what, last)
            attempt += 1
            await asyncio.sleep(max(0.0, min(delay, deadline - self._now())))

    async def _read_node(self, node: str, deadline: float) -> Any:
        try:
            return await self._call(
                f"read node {node}", lambda: self._core.read_node(node), deadline,
                readable=_node,
            )
        except KubeRequestError as e:
            if e.status == 404:
                raise NodeNotFound(
                    f"node {node} does not exist in the cluster at {self.server}; "
                    "set lendee.node to a name `kubectl get nodes` lists"
                ) from e
            raise

    async def _update_node(
        self, node: str, change: Callable[[Any], dict[str, Any] | None], deadline: float
    ) -> None:
        """Read, change, write with the read's resourceVersion; again if someone wrote between."""
        while True:
            current = await self._read_node(node, deadline)
            body = change(current)
            if body is None:
                return
            body.setdefault("metadata", {})["resourceVersion"] = current.metadata.resource_version
            try:
                await self._call(
                    f"update node {node}", partial(self._patch_node, node, body), deadline
                )
                return
            except KubeRequestError as e:
                if e.status != 409:
                    raise

    async def _patch_node(self, node: str, body: dict[str, Any]) -> None:
        # A merge patch: null deletes a key. The stubs omit _content_type, which the
        # generated method takes; without it a dict goes as a strategic merge patch.
        # The node it answers is not read into the client's model (tens of ms of a
        # reclaim's path on a small CPU, for an object nobody uses): its status alone.
        reply: aiohttp.ClientResponse = await self._core.patch_node(  # type: ignore[call-arg, assignment]
            node, body, _content_type=MERGE_PATCH, _preload_content=False)
        async with reply:
            data = await reply.read()
        if not 200 <= reply.status <= 299:
            # As the client raises it when it reads the answer itself.
            raise ApiException(http_resp=RESTResponse(reply, data))  # type: ignore[arg-type]

    # --- the node ------------------------------------------------------------------------

    async def check_node(self, node: str, *, timeout: float | None = None) -> NodeCheck:
        """What the cluster says of `node` now: one real request.

        A node that is not there is an answer, not an error: a node deleted while its VM
        was off registers again when the lendee's kubelet starts. Raises
        KubeUnavailable and KubeAuthError."""
        try:
            current = await self._read_node(node, self._deadline(timeout))
        except NodeNotFound as e:
            return NodeCheck(node=node, exists=False, detail=str(e))
        condition = _ready(current)
        return NodeCheck(node=node, exists=True, ready=_is_ready(current),
                         unschedulable=_unschedulable(current),
                         detail=clean(condition.reason, 200) if condition is not None and
                         condition.reason else "")


def _raise_auth_error(group: ExceptionGroup[Exception]) -> None:
    """A KubeAuthError from a task of a group, as itself: callers catch it by type."""
    for e in group.exceptions:
        if isinstance(e, KubeAuthError):
            raise e from None
        if isinstance(e, ExceptionGroup):
            _raise_auth_error(e)


def _check_readable(path: Path, *, given: bool) -> None:
    where = "kubernetes.kubeconfig" if given else "the default kubeconfig"
    fix = (
        "set kubernetes.kubeconfig to the cluster's kubeconfig "
        "(a k3s server writes /etc/rancher/k3s/k3s.yaml), or remove the [kubernetes] section"
    )
    try:
        with path.open("rb"):
            pass
    except FileNotFoundError:
        raise KubeConfigError(f"{where} {path}: no such file; {fix}") from None
    except IsADirectoryError:
        raise KubeConfigError(f"{where} {path}: is a directory, not a file; {fix}") from None
    except PermissionError:
        raise KubeConfigError(
            f"{where} {path}: permission denied; make it readable by the user hostagent runs as"
        ) from None
    except OSError as e:
        raise KubeConfigError(f"{where} {path}: cannot read it: {e.strerror}") from None
