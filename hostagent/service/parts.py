"""What the agent gives its parts (`hostagent.service.executor`, `hostagent.service.verbs`,
`hostagent.service.recorder`) besides the configuration, the topology and the adapters.

- `View`: the agent's state, read-only. Only the agent writes it (`Agent.apply`).
- `Progress`: each transition, for callers waiting on one. The recorder and the executor
  publish; the verbs subscribe (the control socket, the SSH endpoint and the MQTT device
  all run them), a queue each.
- `Facts`: what the executor learns beyond the state (the last check in the guest, the
  stops libvirt reported, the starts under way), for the verbs and `status`.
- `Cluster`: the Kubernetes steps of a cycle, or `NoCluster`.

The parts change the state only through the `apply` they are given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from hostagent.core import clock
from hostagent.surfaces.control import Reply
from hostagent.core.model import Event, State
from hostagent.core.levers import Terms

if TYPE_CHECKING:  # the cluster's, which imports kubernetes-asyncio: only with [kubernetes]
    from hostagent.cluster.cycle import PodsReader

Apply = Callable[[Event], bool]  # the agent's: step the machine; False if stale
T = TypeVar("T")


class Shared(Generic[T]):
    """An attribute of the agent that its parts were given too: replacing it (the
    cluster once connected, a stand-in) replaces it in each of its `parts` that has it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, agent: object, owner: type) -> T:
        value: T = agent.__dict__[self.name]
        return value

    def __set__(self, agent: object, value: T) -> None:
        agent.__dict__[self.name] = value
        for part in agent.__dict__.get("parts", ()):
            if hasattr(part, self.name):
                setattr(part, self.name, value)


class View(Protocol):
    """The agent's state as its parts read it."""

    @property
    def state(self) -> State:
        """The machine's state now."""

    @property
    def phase_since(self) -> float:
        """When the lendee's phase began (`hostagent.core.clock` time)."""

    @property
    def save_failed(self) -> str | None:
        """Why the last state save failed, or None: saved."""


@dataclass
class Kept:
    """The agent's `View`, which only the agent writes."""

    state: State = field(default_factory=State)
    phase_since: float = field(default_factory=clock.now)
    save_failed: str | None = None


class Progress:
    """Transitions handed to every caller following them. No I/O: a queue each."""

    def __init__(self) -> None:
        self._followers: set[asyncio.Queue[Reply]] = set()

    def publish(self, event: str, message: str, fields: dict[str, Any]) -> None:
        update = {"event": event, "message": message, **fields}
        for queue in self._followers:
            queue.put_nowait(update)

    def answer(self, intent_id: str, ok: bool, message: str) -> None:
        """An intent ended: tell whoever follows it (a `play` waiting on it, if any)."""
        self.publish("intent", message, {"intent": intent_id, "to": "done" if ok else "failed"})

    @contextlib.contextmanager
    def following(self) -> Iterator[asyncio.Queue[Reply]]:
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._followers.add(queue)
        try:
            yield queue
        finally:
            self._followers.discard(queue)


@dataclass
class Facts:
    """What the executor learns beyond the state."""

    # The last in-guest check, for `status`: at (unix time), ok, summary.
    verified: dict[str, Any] | None = None
    # Set when libvirt reports a VM stopped: a shutdown waits on its VM's.
    stopped: dict[str, asyncio.Event] = field(default_factory=dict)
    # VMs libvirt is being asked to start now: a start that can no longer be withdrawn.
    starting: set[str] = field(default_factory=set)


class Cluster(Protocol):
    """The Kubernetes steps of a cycle. Without a [kubernetes] section: `NoCluster`."""

    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None, terms: Terms | None = None,
                      accepted: Callable[[], None] | None = None,
                      emptied: Callable[[], None] | None = None) -> str | None:
        """Cordon and drain; None when done, or why the reclaim must be aborted. A
        `regrow`'s is aborted whenever its drain cannot finish: nobody waits for it.
        `until` (seconds from now): a reservation's, whose pods were told and get their
        full grace period, may drain that long if it is longer than timeouts.drain.
        `terms`: the pods' grace (`levers.terms`); `accepted`: called once every
        eviction is accepted; `emptied`: called when the drain ends with every evicted
        pod gone (not when the policy let it pass with pods left)."""

    async def cordon_ahead(self, why: str) -> bool:
        """Cordon the lent node ahead of an owner's usual hour, saying `why`; True if the
        cordon is ours."""

    async def uncordon_ahead(self, why: str) -> None:
        """Lift the cordon `cordon_ahead` set, if it is still that one."""

    async def give_back(self, lent: Collection[str], *,
                        restart_plugins: bool = False,
                        boot_id: Callable[[], Awaitable[str]] | None = None) -> str | None:
        """Wait for the kubelet of this boot, Ready and the `lent` GPUs, uncordon; None
        when done, or why the node stays cordoned. `restart_plugins`: after a
        hot-unplug, the GPU plugins' pods restart first (they enumerate GPUs when they
        start). `boot_id`: reads the guest's boot id, which the node's must equal
        before its status counts (invariant 14)."""

    async def vacate(self, owners: list[str], gpus: Collection[str],
                     pods: PodsReader, *, until: float | None = None,
                     grace_cap: float | None = None) -> str | None:
        """A hot-unplug: cordon, then evict only the pods using `gpus` (by DRA claim, else
        those `pods()` reads once the node is cordoned: UIDs from the kubelet's
        checkpoint, or None and why not); None once they are gone, or why the reclaim by
        restart must run instead. `until` as `reclaim`'s: a reservation's."""

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        """A hot-unplug, before the guest lets `gpus` go: the node's GPU plugins stopped
        (they hold every GPU open while they run); None, or why not."""

    async def grow(self, lent: Collection[str]) -> str | None:
        """A hot-add: wait until the node, lent all along, advertises the `lent` GPUs;
        None when it does, or why not."""

    async def plugins_pausable(self, *, timeout: float = 10) -> tuple[bool, str]:
        """Whether the node's GPU plugins can be kept off it through their deploy
        labels (what a hot-unplug needs under ``policy.hotplug = "auto"``), and why."""

    async def lendee_down(self, *, why: str) -> None:
        """Cordon (as ours) the node of a lendee that went down, whatever stopped it."""

    async def watch_lent(self, on_view: Callable[[Any], None] | None = None) -> None:
        """Follow the lent node until cancelled; `on_view` gets each change."""

    async def watch_cordon(self) -> None:
        """Follow the node of a lendee off or stuck until cancelled: our cordon's marker
        is dropped once someone is seen lifting it."""

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        """Ahead of a reserved reclaim: the time its eviction begins, ``when(the longest
        grace period of the GPU pods on the node)``, as the annotation
        ``<prefix>reclaim-at`` (RFC 3339) and an Event saying ``message(that time)`` on
        each of them; the time and the pods told (none when that failed: journaled)."""

    def status(self) -> dict[str, object] | None:
        """What `hostagent status` shows of the cluster."""

    async def adopt(self, lent: Collection[str]) -> str | None:
        """The agent starts with the lendee running `lent`: None if its node is in service
        as the last lend left it, else why not (the lend is verified again)."""

    async def flush_events(self) -> None:
        """Post the Kubernetes Events still queued (at exit)."""


class NoCluster:
    async def reclaim(self, owners: list[str], *, regrow: bool = False,
                      until: float | None = None, terms: Terms | None = None,
                      accepted: Callable[[], None] | None = None,
                      emptied: Callable[[], None] | None = None) -> str | None:
        return None  # no drain: nothing says the guest's work is done (no power-off)

    async def cordon_ahead(self, why: str) -> bool:
        return False

    async def uncordon_ahead(self, why: str) -> None:
        return None

    async def give_back(self, lent: Collection[str], *,
                        restart_plugins: bool = False,
                        boot_id: Callable[[], Awaitable[str]] | None = None) -> str | None:
        return None

    async def vacate(self, owners: list[str], gpus: Collection[str],
                     pods: PodsReader, *, until: float | None = None,
                     grace_cap: float | None = None) -> str | None:
        return None

    async def withdraw(self, gpus: Collection[str]) -> str | None:
        return None

    async def grow(self, lent: Collection[str]) -> str | None:
        return None

    async def plugins_pausable(self, *, timeout: float = 10) -> tuple[bool, str]:
        return False, "no cluster is configured: no GPU plugins to pause"

    async def lendee_down(self, *, why: str) -> None:
        return None

    async def watch_lent(self, on_view: Callable[[Any], None] | None = None) -> None:
        return None

    async def watch_cordon(self) -> None:
        return None

    async def notice(self, when: Callable[[float], float],
                     message: Callable[[str], str]) -> tuple[float, list[str]]:
        return when(0.0), []

    def status(self) -> dict[str, object] | None:
        return None

    async def adopt(self, lent: Collection[str]) -> str | None:
        return None

    async def flush_events(self) -> None:
        return None
