"""Prometheus metrics and ``/healthz``, over a small HTTP server on the agent's loop.

Off unless ``[metrics] listen`` is set. Everything is fed from the one place the
agent's state changes (`Agent.apply` calls `Metrics.transition`), from the hook inbox
(`Metrics.hook_event`), and from two seams for adapters: `Metrics.verified` (a lend's
GPUs were checked) and `Metrics.node_gpu_pods` (how many pods on the lent node request
a GPU). The metrics live in a private registry, so nothing else in the process (or in
a test) adds to or reads from them by accident.

The metrics (Prometheus naming: ``hostagent_`` prefix, base units, ``_total`` counters):

    hostagent_lendee_phase{phase}                    1 for the lendee's current phase
    hostagent_gpu_holder{gpu,vm}                     1 if vm holds gpu (all 0: idle)
    hostagent_swaps_total{kind}                      lend: lent (GPUs verified);
                                                     reclaim: the lendee stopped for owners
    hostagent_failures_total{kind}                   see FAILURE_KINDS; gpu_lost: the
                                                     lent node lost GPUs while lent
    hostagent_phase_duration_seconds{phase}          histogram: time spent in a phase
    hostagent_swap_duration_seconds{kind}            histogram: lend = running → lent;
                                                     reclaim = draining → off
    hostagent_pending_intents                        owner start requests waiting
    hostagent_hook_events_total{op,sub}              libvirt hook calls received
    hostagent_last_verification_timestamp_seconds    last lend whose GPUs were verified
                                                     (absent: none since the agent started)
    hostagent_node_gpu_pods                          pods on the lent node that request
                                                     GPUs (absent until the cluster says)
    hostagent_lent_gpu_pod{gpu,namespace,pod}        DRA: 1 for each pod holding a lent
                                                     GPU, from its ResourceClaims
    hostagent_player_wait_seconds                    histogram: an owner's start request
                                                     to the owner running
    hostagent_build_info{version}                    1, with the running version
    hostagent_health_check_success{check}            1 if the check passed at this scrape

With several lendees (``[lendees.NAME]``) every metric but the hook's, the build's and
the health checks' has a ``lendee`` label, the lendee's name: one series per lendee
(`Metrics.several`). With one lendee there is no such label, as before.

The HTTP side is deliberately tiny (one request per connection, GET and HEAD, three
paths) because it runs on the loop that answers libvirt's hook: it must never block,
and must not drag in a web framework (prometheus-client serves only from threads of
its own, or through an ASGI/WSGI server). It shares the agent's descriptors with the
hook socket, so it is bounded: at most `MAX_CONNECTIONS` connections at once
(`MAX_PER_SOURCE` per address), each with `REQUEST_TIMEOUT` seconds to send its whole
request, headers included. Over a cap, a connection still sending its request makes
room for the newcomer: the oldest of the address that holds the most (its own, if it
is at its cap), so a handful of addresses sending requests slowly (a slowloris) close
their own connections and a scrape is always answered; with none to close, the
newcomer is closed. Either is counted in one log line per minute.

    /metrics   the metrics, text exposition format (health checks run first)
    /healthz   200 if every health check passes, else 503; the checks as JSON
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

import hostagent
from hostagent.core import machine
from hostagent.core.health import CheckFailed, CheckResult, Health
from hostagent.core.ratelimit import Summarised
from hostagent.core.model import (
    AgentTimeout,
    AttachFailed,
    DetachFailed,
    DrainFailed,
    Event,
    Observed,
    Phase,
    ReturnDone,
    ReturnFailed,
    ShutdownTimeout,
    StartFailed,
    State,
    Topology,
)

__all__ = ["FAILURE_KINDS", "Metrics", "serve"]

# The report that carries each failure, and its `kind` label.
FAILURE_KINDS: dict[type[Event], str] = {
    AgentTimeout: "guest_agent_timeout",  # the lendee's guest agent never answered
    DrainFailed: "drain",  # the node did not drain (and the policy is to abort)
    ShutdownTimeout: "shutdown_timeout",  # the lendee ignored its guest-agent shutdown
    ReturnFailed: "return",  # the node did not come back whole (Ready, GPUs, verification)
    StartFailed: "start",  # a VM (owner or lendee) could not be started
    AttachFailed: "hotplug",  # a hot-add did not end with the GPU lent
    DetachFailed: "hotplug",  # a hot-unplug gave way to the reclaim by restart
}

# The classic text format, which every Prometheus reads; every name here fits it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# From a sub-second step to a slow drain or a node that takes its time to be Ready.
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class _Optional:
    """A gauge that is absent until its value is known: 0 would be a claim."""

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.value: float | None = None

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterator[Metric]:
        if self.value is not None:
            yield GaugeMetricFamily(self.name, self.documentation, value=self.value)


class Metrics:
    """The agent's metrics, and what the health check of the last lend needs to know."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._phase = Gauge("hostagent_lendee_phase",
                            "1 for the phase the lendee is in, 0 for the others",
                            ["phase"], registry=r)
        self._holder = Gauge("hostagent_gpu_holder",
                             "1 if the VM holds the GPU; a GPU with no 1 is idle",
                             ["gpu", "vm"], registry=r)
        self._swaps = Counter("hostagent_swaps",
                              "Swaps completed: lend (lent, GPUs verified) or reclaim (the "
                              "lendee stopped to free GPUs)", ["kind"], registry=r)
        self._failures = Counter("hostagent_failures", "Failed steps, by kind",
                                 ["kind"], registry=r)
        self._phase_seconds = Histogram("hostagent_phase_duration_seconds",
                                        "Time the lendee spent in a phase, observed as it left",
                                        ["phase"], buckets=DURATION_BUCKETS, registry=r)
        self._swap_seconds = Histogram("hostagent_swap_duration_seconds",
                                       "Whole swaps: lend from running to lent, reclaim from "
                                       "draining to off", ["kind"], buckets=DURATION_BUCKETS,
                                       registry=r)
        self._intents = Gauge("hostagent_pending_intents",
                              "Owner start requests waiting for their GPUs", registry=r)
        self._hooks = Counter("hostagent_hook_events",
                              "libvirt hook calls received, by operation and sub-operation",
                              ["op", "sub"], registry=r)
        # Absent until known: 0 would say "verified in 1970", and an alert on its age
        # would fire at every start of the agent.
        self._verified = _Optional("hostagent_last_verification_timestamp_seconds",
                                   "When a lend's GPUs were last verified (unix time)")
        r.register(self._verified)
        self._player_wait = Histogram("hostagent_player_wait_seconds",
                                      "From an owner's start request to the owner running",
                                      buckets=DURATION_BUCKETS, registry=r)
        Gauge("hostagent_build_info", "1, labelled with the running hostagent's version",
              ["version"], registry=r).labels(hostagent.version()).set(1)
        self._checks = Gauge("hostagent_health_check_success",
                             "1 if the health check passed when last run, 0 if it failed",
                             ["check"], registry=r)
        self._gpu_pods = _Optional("hostagent_node_gpu_pods",
                                   "Pods on the lent node that request GPUs")
        r.register(self._gpu_pods)
        self._lent_gpu_pod = Gauge("hostagent_lent_gpu_pod",
                                   "1 for each pod that holds a lent GPU (DRA: from the "
                                   "ResourceClaims)", ["gpu", "namespace", "pod"],
                                   registry=r)
        # Every series exists from the start: a rate() needs the zero it starts from.
        for kind in ("lend", "reclaim"):
            self._swaps.labels(kind)
        for kind in (*FAILURE_KINDS.values(), "gpu_lost"):
            self._failures.labels(kind)
        self.phase: Phase = Phase.OFF
        # None: unknown (at start, and after a fresh read of libvirt).
        self.phase_since: float | None = None
        self.lend_started_at: float | None = None
        self.reclaim_started_at: float | None = None
        self.verified_at: float | None = None
        # The last lend that ended without a verification: when it started, and why.
        self.lend_failure: tuple[float, str] | None = None
        # Several lendees: every lendee's metrics by name, the first this one, rendered
        # together with a `lendee` label (`render`); None with one lendee.
        self.several: Mapping[str, Metrics] | None = None
        self._show(State())

    # ---- inputs ----------------------------------------------------------------------
    def transition(self, old: State, new: State, event: Event) -> None:
        """`event` moved the machine from `old` to `new` (called by `Agent.apply`)."""
        at = event.at
        if old.phase is not new.phase:
            # A fresh read of libvirt only says where the lendee is, not since when.
            if self.phase_since is not None and not isinstance(event, Observed):
                self._phase_seconds.labels(old.phase.value).observe(max(0.0, at - self.phase_since))
            self.phase_since = at
            self._phase_change(old.phase, new, at)
        for intent in old.intents:
            # Its request answered: the player's game runs (a failed start leaves it off).
            if intent not in new.intents and intent.owner in new.running_owners:
                self._player_wait.observe(max(0.0, at - intent.created_at))
        kind = FAILURE_KINDS.get(type(event))
        if kind is not None:
            self._failures.labels(kind).inc()
        if isinstance(event, ReturnDone):
            # Until the in-guest GPU check reports on its own, the node coming back with
            # every GPU allocatable (ReturnDone) is the verification.
            self.verified(at)
        self._show(new)

    def _phase_change(self, was: Phase, new: State, at: float) -> None:
        now = new.phase
        if now is Phase.BOOTING:
            self.lend_started_at = at
            self.reclaim_started_at = None
        elif now is Phase.DRAINING:
            self.reclaim_started_at = at
        elif now is Phase.LENT and was is Phase.JOINING:
            self._swaps.labels("lend").inc()
            if self.lend_started_at is not None:
                self._swap_seconds.labels("lend").observe(max(0.0, at - self.lend_started_at))
        elif now is Phase.OFF and was in (Phase.DRAINING, Phase.STOPPING):
            self._swaps.labels("reclaim").inc()
            if self.reclaim_started_at is not None:
                self._swap_seconds.labels("reclaim").observe(
                    max(0.0, at - self.reclaim_started_at))
            self.reclaim_started_at = None
        elif now is Phase.FAILED and was in (Phase.BOOTING, Phase.JOINING):
            self.lend_failure = (self.lend_started_at or at, new.reason or "it failed")

    def hook_event(self, op: str, sub: str) -> None:
        """libvirt ran the hook for `op` `sub` (e.g. "prepare" "begin")."""
        self._hooks.labels(op, sub).inc()

    def verified(self, at: float) -> None:
        """The lent node's GPUs were verified at `at` (unix time): what the cluster reports
        and what the driver in the guest sees agree. Call it when the check passes."""
        self.verified_at = max(at, self.verified_at or 0.0)
        self.lend_failure = None
        self._verified.value = self.verified_at

    def node_gpu_pods(self, count: int | None) -> None:
        """How many pods on the lendee's node request a GPU (in requests or limits), as the
        Kubernetes adapter last saw them; None when unknown (not lent, API unreachable).

        The "capacity without a consumer" signal: GPUs lent while this stays 0 are idle
        capacity a gamer could have had."""
        self._gpu_pods.value = count

    def lent_gpu_pods(self, holders: dict[str, str] | None) -> None:
        """DRA: which pods hold which lent GPU (label -> "ns/name", comma-separated);
        None or {} when none does or it is unknown. Namespace and name are labels apart,
        as kube-state-metrics has them, so that a query can join or group on them."""
        self._lent_gpu_pod.clear()
        for gpu, pods in (holders or {}).items():
            for pod in pods.split(","):
                namespace, _, name = pod.rpartition("/")
                self._lent_gpu_pod.labels(gpu, namespace, name).set(1)

    def gpu_lost(self) -> None:
        """The lent node lost GPUs it had (allocatable dropped below what was lent):
        counted in ``hostagent_failures_total{kind="gpu_lost"}``."""
        self._failures.labels("gpu_lost").inc()

    def health(self, results: list[CheckResult]) -> None:
        for result in results:
            self._checks.labels(result.check).set(1 if result.ok else 0)

    # ---- the state as gauges -----------------------------------------------------------
    def _show(self, state: State) -> None:
        self.phase = state.phase
        for phase in Phase:
            self._phase.labels(phase.value).set(1 if phase is state.phase else 0)
        for gpu, holder in machine.holders(state, self.topo).items():
            # Every VM that may hold it: its owners (several may share a card), the lendee.
            candidates = [o for o, gpus in self.topo.owners.items() if gpu in gpus]
            if gpu in self.topo.lendee_gpus:
                candidates.append(self.topo.lendee)
            for vm in candidates:
                self._holder.labels(gpu, vm).set(1 if vm == holder else 0)
        self._intents.set(len(state.intents))

    # ---- health ----------------------------------------------------------------------
    async def lend_verified(self) -> str:
        """Health probe: the last lend was verified, not merely Ready."""
        if self.lend_failure is not None:
            started, reason = self.lend_failure
            raise CheckFailed(f"the lend started at {_clock(started)} was not verified: {reason}")
        if self.phase is Phase.LENT and self.lend_started_at is None:
            # Lent before the agent started, and adopted: verified by the agent then.
            return "lent since before the agent started (adopted)"
        if self.phase is Phase.LENT and (
                self.verified_at is None
                or (self.lend_started_at is not None and self.verified_at < self.lend_started_at)):
            raise CheckFailed(f"lent since {_clock(self.lend_started_at or 0)} but its GPUs "
                              "were never verified")
        if self.verified_at is None:
            return "no lend since the agent started"
        return f"verified at {_clock(self.verified_at)}"

    def render(self) -> bytes:
        if self.several is None:
            return generate_latest(self.registry)
        together = CollectorRegistry(auto_describe=False)
        together.register(_Several(self.several))
        return generate_latest(together)


# The agent's own, not a lendee's: rendered once, from the first lendee's metrics.
_OF_THE_AGENT = ("hostagent_hook_events", "hostagent_build_info",
                 "hostagent_health_check_success")


class _Several:
    """Every lendee's metric families as one, each sample labelled with its lendee."""

    def __init__(self, members: Mapping[str, Metrics]) -> None:
        self.members = members

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        first = next(iter(self.members))
        for name, member in self.members.items():
            for family in member.registry.collect():
                agents = family.name in _OF_THE_AGENT
                if agents and name != first:
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit)
                merged.samples += [
                    s if agents else s._replace(labels={"lendee": name, **s.labels})
                    for s in family.samples]
        yield from families.values()


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


# ---- HTTP ----------------------------------------------------------------------------

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 503: "Service Unavailable"}
_INDEX = b"hostagent: /metrics (Prometheus), /healthz (200 when every check passes)\n"
REQUEST_TIMEOUT = 2.0  # to send the request line and headers: a scraper sends them at once
MAX_CONNECTIONS = 16  # a Prometheus scrapes with one; a few people may curl /healthz
MAX_PER_SOURCE = 4
ACCEPT_BACKLOG = 8  # the listen queue, and asyncio's batch of accepts
_REFUSALS_INTERVAL = 60.0
_MAX_HEADERS = 100


async def serve(address: tuple[str, int], metrics: Metrics, health: Health, *,
                log: logging.Logger, max_connections: int = MAX_CONNECTIONS,
                max_per_source: int = MAX_PER_SOURCE,
                request_timeout: float = REQUEST_TIMEOUT) -> asyncio.Server:
    """Serve /metrics and /healthz on `address` (host "" = every address).

    Raises OSError if it cannot listen (the port is taken, the address is not local):
    worth retrying later, the configuration may well be right.
    """
    sources: dict[str, int] = {}  # address → connections being served
    reading: dict[asyncio.StreamWriter, str] = {}  # still sending their request, oldest first

    def refused_record(message: str, count: int, reasons: dict[str, int]) -> None:
        log.warning("metrics: %s", message)

    refusals = Summarised(refused_record, interval=_REFUSALS_INTERVAL)

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if peer else "?"
        full = sources.get(source, 0) >= max_per_source
        if full or sum(sources.values()) >= max_connections:
            victim = _victim(reading, source, own=full)
            if victim is None:
                refusals(f"refused a connection from {source}: too many at once", "too many")
                writer.transport.abort()  # its descriptor is back at once
                return
            refusals(f"closed a connection from {reading[victim]} still sending its request, "
                     f"for one from {source}", "slow")
            gone(victim)
            victim.transport.abort()
        sources[source] = sources.get(source, 0) + 1
        held[writer] = source
        reading[writer] = source
        try:
            try:
                request = await asyncio.wait_for(_read_request(reader), request_timeout)
                reading.pop(writer, None)  # asked: answered, not closed to make room
            except TimeoutError:
                status, ctype, body, head = 408, "text/plain", b"request timeout\n", False
            except ValueError as e:
                status, ctype, body, head = 400, "text/plain", f"{e}\n".encode(), False
            else:
                if request is None:
                    return  # connected and closed without asking anything
                method, path = request
                head = method == "HEAD"
                status, ctype, body = await _respond(method, path, metrics, health)
            writer.write(_response(status, ctype, body, head=head))
            # A client that never reads its answer must not keep its slot.
            await asyncio.wait_for(writer.drain(), request_timeout)
        except ConnectionError:
            pass
        except TimeoutError:
            writer.transport.abort()  # close() would wait for the unread answer to leave
        except Exception:
            log.exception("metrics: failed to answer a request")
        finally:
            gone(writer)
            writer.close()

    def gone(writer: asyncio.StreamWriter) -> None:
        """Forget a connection's slot, once (closed to make room, or finished)."""
        source = held.pop(writer, None)
        if source is None:
            return
        reading.pop(writer, None)
        sources[source] -= 1
        if not sources[source]:
            del sources[source]

    held: dict[asyncio.StreamWriter, str] = {}  # every counted connection → its address

    host, port = address
    # asyncio accepts up to `backlog` connections in one go before any of them is looked
    # at: a small batch keeps the cap a bound on descriptors.
    return await asyncio.start_server(connection, host or None, port, backlog=ACCEPT_BACKLOG)


def _victim(reading: dict[asyncio.StreamWriter, str], source: str, *,
            own: bool) -> asyncio.StreamWriter | None:
    """The connection still sending its request to close for a newcomer from `source`:
    the oldest of `source`'s own if `own` (it is at its cap), else the oldest of the
    address with the most of them; None if there is none."""
    if own:
        return next((w for w, s in reading.items() if s == source), None)
    if not reading:
        return None
    most = collections.Counter(reading.values()).most_common(1)[0][0]
    return next(w for w, s in reading.items() if s == most)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """(method, path) of one HTTP/1.x request; its headers are read and ignored."""
    try:
        line = await reader.readline()
    except asyncio.LimitOverrunError as e:
        raise ValueError("request line too long") from e
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1.x request")
    for _ in range(_MAX_HEADERS):
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
    else:
        raise ValueError("too many header lines")
    method, target = parts[0], parts[1]
    return method, target.split("?", 1)[0]


async def _respond(method: str, path: str, metrics: Metrics,
                   health: Health) -> tuple[int, str, bytes]:
    if method not in ("GET", "HEAD"):
        return 405, "text/plain", b"only GET and HEAD\n"
    if path == "/metrics":
        metrics.health(await health.check())
        return 200, CONTENT_TYPE, metrics.render()
    if path == "/healthz":
        results = await health.check()
        metrics.health(results)
        ok = all(r.ok for r in results)
        body: dict[str, Any] = {"ok": ok, "version": hostagent.version(),
                                "checks": [r.as_dict() for r in results]}
        return (200 if ok else 503), "application/json", (json.dumps(body) + "\n").encode()
    if path == "/":
        return 200, "text/plain", _INDEX
    return 404, "text/plain", b"not found: try /metrics or /healthz\n"


def _response(status: int, ctype: str, body: bytes, *, head: bool = False) -> bytes:
    headers = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {ctype}",
               f"Content-Length: {len(body)}", "Connection: close"]
    if status == 405:
        headers.append("Allow: GET, HEAD")
    return ("\r\n".join(headers) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)
