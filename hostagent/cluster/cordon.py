"""The cordon, and the marker on the Node that says hostagent set it.

An administrator's cordon is never lifted: `uncordon` lifts only a cordon whose marker
is ours, and `watch_cordon` drops the marker once someone else is seen lifting it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import (
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any


from hostagent.host import journal
from hostagent.cluster.client import (
    KubeRequestError,
    KubeUnavailable,
    NodeNotFound,
    _annotations,
    _timestamp,
    _unschedulable,
)
from hostagent.cluster.watches import Watches

log = logging.getLogger("hostagent.cluster.kube")


MARKER_VALUE = "hostagent"


def cordon_marker(prefix: str) -> str:
    """The annotation that says hostagent cordoned the node, e.g. hostagent.io/cordoned-by."""
    return f"{prefix}cordoned-by"


def _cordoned_at(prefix: str) -> str:
    return f"{prefix}cordoned-at"


@dataclass(frozen=True)
class CordonResult:
    """What `cordon` found and did. Keep `cordoned_by_us` in the state file too."""

    node: str
    cordoned_by_us: bool  # our marker is on the node: `uncordon` will lift the cordon
    was_cordoned: bool  # the node was already unschedulable before this call

    @property
    def by_someone_else(self) -> bool:
        return self.was_cordoned and not self.cordoned_by_us


@dataclass(frozen=True)
class Taint:
    """A node taint; two taints are the same taint when key and effect match, as in kubectl."""

    key: str
    effect: str = "NoSchedule"
    value: str = ""

    def body(self) -> dict[str, str]:
        return {
            "key": self.key,
            "effect": self.effect,
            **({"value": self.value} if self.value else {}),
        }


class Cordons(Watches):
    """The node's cordon and our marker on it."""

    async def cordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
        remove_taints: Sequence[Taint] = (),
    ) -> CordonResult:
        """Make `node` unschedulable and mark it as ours, unless someone else already did.

        `annotations`, `labels` and `remove_taints` (as `annotate` takes them) go in the
        same write: a reclaim's cordon and its marks are one round trip, not two."""
        marker = cordon_marker(marker_prefix)
        found: list[CordonResult] = []
        marks = annotations is not None or labels or remove_taints

        def change(current: Any) -> dict[str, Any] | None:
            cordoned = _unschedulable(current)
            ours = _annotations(current).get(marker) == MARKER_VALUE
            # Already cordoned without our marker: an administrator's, to be left alone.
            found[:] = [
                CordonResult(node, cordoned_by_us=ours or not cordoned, was_cordoned=cordoned)
            ]
            body = self._marks(current, annotations or {}, labels, (), remove_taints) \
                if marks else None
            if cordoned:
                return body
            body = body or {"metadata": {}}
            body["metadata"]["annotations"] = {
                **body["metadata"].get("annotations", {}),
                marker: MARKER_VALUE, _cordoned_at(marker_prefix): _timestamp()}
            body.setdefault("spec", {})["unschedulable"] = True
            return body

        await self._update_node(node, change, self._deadline(timeout))
        result = found[0]
        if result.by_someone_else:
            journal.record(
                "cordon",
                f"{node} was already cordoned by someone else; hostagent will leave it cordoned",
                result="cordoned-by-someone-else",
                node=node,
                priority=journal.Priority.NOTICE,
            )
        elif not result.was_cordoned:
            journal.record("cordon", f"cordoned {node}", result="ok", node=node)
        return result

    async def uncordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
        add_taints: Sequence[Taint] = (),
    ) -> bool:
        """Lift the cordon if our marker says we set it; True if we did. Never lifts another's.

        `annotations`, `labels` and `add_taints` (as `annotate` takes them) go in the
        same write, whoever's the cordon: a return's marks and its uncordon land
        together, so no pod is ever scheduled on the node without its taints."""
        marker = cordon_marker(marker_prefix)
        lifted: list[bool] = []
        marks = annotations is not None or labels or add_taints

        def change(current: Any) -> dict[str, Any] | None:
            ours = _annotations(current).get(marker) == MARKER_VALUE
            # Our marker on a schedulable node: someone lifted our cordon, and whatever
            # cordon comes next is theirs. The marker goes; nothing is lifted.
            stale[:] = [ours and not _unschedulable(current)]
            lifted[:] = [ours and not stale[0]]
            body = self._marks(current, annotations or {}, labels, add_taints, ()) \
                if marks else None
            if not ours:
                return body
            body = body or {"metadata": {}}
            body["metadata"]["annotations"] = {
                **body["metadata"].get("annotations", {}),
                marker: None, _cordoned_at(marker_prefix): None}
            if lifted[0]:
                body.setdefault("spec", {})["unschedulable"] = None
            return body

        stale: list[bool] = []
        await self._update_node(node, change, self._deadline(timeout))
        if lifted[0]:
            journal.record("uncordon", f"uncordoned {node}", result="ok", node=node)
        elif stale[0]:
            self._record_lifted(node)
        else:
            journal.record(
                "uncordon",
                f"left {node} as it is: hostagent did not cordon it",
                result="not-ours",
                node=node,
                priority=journal.Priority.NOTICE,
            )
        return lifted[0]

    async def forget_cordon(
        self, node: str, *, marker_prefix: str, timeout: float | None = None
    ) -> bool:
        """Drop our cordon marker if `node` is schedulable: someone lifted our cordon
        (``kubectl uncordon``), so a cordon set after that is theirs and must never be
        lifted by us. True if the marker was dropped."""
        marker = cordon_marker(marker_prefix)
        dropped: list[bool] = []

        def change(current: Any) -> dict[str, Any] | None:
            dropped[:] = [_annotations(current).get(marker) == MARKER_VALUE
                          and not _unschedulable(current)]
            if not dropped[0]:
                return None
            return {"metadata": {"annotations": {marker: None,
                                                 _cordoned_at(marker_prefix): None}}}

        await self._update_node(node, change, self._deadline(timeout))
        if dropped[0]:
            self._record_lifted(node)
        return dropped[0]

    @staticmethod
    def _record_lifted(node: str) -> None:
        journal.record("uncordon", f"{node} was uncordoned by someone else since hostagent "
                       "cordoned it: hostagent's marker is dropped, and a cordon set from now "
                       "on is left alone", result="not-ours", node=node,
                       priority=journal.Priority.NOTICE)

    async def watch_cordon(self, node: str, *, marker_prefix: str) -> None:
        """Follow `node` until cancelled, dropping our cordon marker each time the node is
        seen schedulable with it (see `forget_cordon`). Raises KubeAuthError."""
        marker = cordon_marker(marker_prefix)
        lifted = asyncio.Event()

        def see(obj: Any) -> None:
            if (obj is not None and _annotations(obj).get(marker) == MARKER_VALUE
                    and not _unschedulable(obj)):
                lifted.set()

        follower = asyncio.create_task(self._follow(
            "list_node", f"metadata.name={node}", lambda items: see(items[0] if items else None),
            lambda kind, obj: see(None if kind == "DELETED" else obj)))
        wait: asyncio.Future[Any] | None = None
        try:
            while True:
                wait = asyncio.ensure_future(lifted.wait())
                await asyncio.wait({wait, follower}, return_when=asyncio.FIRST_COMPLETED)
                if follower.done():
                    follower.result()  # raises what ended it
                    return
                lifted.clear()
                try:
                    await self.forget_cordon(node, marker_prefix=marker_prefix)
                except (NodeNotFound, KubeUnavailable, KubeRequestError) as e:
                    log.info("could not drop the cordon marker of %s yet: %s", node, e)
        finally:
            if wait is not None:
                wait.cancel()
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    async def unmark(
        self, node: str, *, marker_prefix: str, label: str | None, taints: Sequence[Taint],
        dry_run: bool = False, timeout: float | None = None,
    ) -> list[str]:
        """Take off `node` exactly what hostagent puts on it, in one write: every
        annotation under `marker_prefix`, the borrowed `label` where it says "true",
        `taints`, and the cordon if our marker says we set it (an administrator's stays).
        What was (or, with `dry_run`, would be) removed, one line each."""
        marker = cordon_marker(marker_prefix)
        removed: list[str] = []

        def change(current: Any) -> dict[str, Any] | None:
            annotations = _annotations(current)
            labels = dict(current.metadata.labels or {})
            present = [
                self._api_client.sanitize_for_serialization(t)
                for t in (current.spec.taints if current.spec else None) or []]
            ours = {(t.key, t.effect) for t in taints}
            kept = [t for t in present if (t.get("key"), t.get("effect")) not in ours]
            mine = sorted(k for k in annotations if k.startswith(marker_prefix))
            removed[:] = [f"annotation {k}={annotations[k]}" for k in mine]
            body: dict[str, Any] = {"metadata": {"annotations": dict.fromkeys(mine)}}
            if label and labels.get(label) == "true":
                removed.append(f"label {label}=true")
                body["metadata"]["labels"] = {label: None}
            removed.extend(f"taint {t['key']}:{t['effect']}" for t in present if t not in kept)
            if len(kept) != len(present):
                body.setdefault("spec", {})["taints"] = kept or None
            if annotations.get(marker) == MARKER_VALUE and _unschedulable(current):
                removed.append("its cordon (set by hostagent)")
                body.setdefault("spec", {})["unschedulable"] = None
            return None if dry_run or not removed else body

        await self._update_node(node, change, self._deadline(timeout))
        if removed and not dry_run:
            journal.record("unmark", f"took hostagent's marks off {node}: " + ", ".join(removed),
                           result="ok", node=node)
        return removed

    async def annotate(
        self,
        node: str,
        annotations: Mapping[str, str | None],
        *,
        labels: Mapping[str, str | None] | None = None,
        add_taints: Sequence[Taint] = (),
        remove_taints: Sequence[Taint] = (),
        timeout: float | None = None,
    ) -> None:
        """Set annotations and labels (None removes one) and add or remove taints, in
        one write.

        Taints are a list the API replaces whole, and the node lifecycle controller keeps
        its own in it: they are read, changed and written back, never overwritten.
        """

        def change(current: Any) -> dict[str, Any] | None:
            return self._marks(current, annotations, labels, add_taints, remove_taints)

        await self._update_node(node, change, self._deadline(timeout))

    def _marks(self, current: Any, annotations: Mapping[str, str | None],
               labels: Mapping[str, str | None] | None, add_taints: Sequence[Taint],
               remove_taints: Sequence[Taint]) -> dict[str, Any]:
        """The merge patch of `annotate` for the node as read (`current`)."""
        body: dict[str, Any] = {"metadata": {"annotations": dict(annotations)}}
        if labels:
            body["metadata"]["labels"] = dict(labels)
        if add_taints or remove_taints:
            spec = current.spec
            taints = [
                self._api_client.sanitize_for_serialization(t)
                for t in (spec.taints if spec else None) or []
            ]
            drop = {(t.key, t.effect) for t in (*add_taints, *remove_taints)}
            wanted = [t for t in taints if (t.get("key"), t.get("effect")) not in drop]
            wanted += [t.body() for t in add_taints]
            if wanted != taints:
                body["spec"] = {"taints": wanted or None}
        return body
