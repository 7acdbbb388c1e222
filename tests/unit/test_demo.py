"""`make demo`'s own check (tests/lab/demo.py `untouched`): gaming1's start must leave
the other lendee alone. Its pods restarted (a new pod, or the same name started again),
its node cordoned or its machine moved fails the demo; as they were, it passes."""

from __future__ import annotations

from typing import Any

import pytest

from tests.lab import demo
from tests.lab.helpers import OTHER

BEFORE = {"inference": ("inference-1", "2026-12-05T15:14:34Z"),
          "queue": ("queue-1", "2026-12-05T15:14:34Z")}


class Cluster:
    def __init__(self, pods: dict[str, tuple[str, str]], cordoned: bool = False) -> None:
        self.pods, self.cordoned = pods, cordoned

    def running_on(self, app: str, node: str) -> dict[str, Any]:
        assert node == OTHER
        name, started = self.pods[app]
        return {"metadata": {"name": name}, "status": {"startTime": started}}

    def node(self, name: str) -> dict[str, Any]:
        assert name == OTHER
        return {"spec": {"unschedulable": True} if self.cordoned else {}}


class Journal:
    def __init__(self, phases: int) -> None:
        self.phases = phases

    def records(self, **match: str) -> list[dict[str, str]]:
        assert match == {"event": "phase", "vm": OTHER}
        return [{"MESSAGE": f"phase {n}"} for n in range(self.phases)]


def check(cluster: Cluster, phases: int = 3) -> None:
    demo.untouched(Journal(phases), cluster, BEFORE, 3)  # type: ignore[arg-type]


def test_the_same_pods_started_when_they_were_pass() -> None:
    check(Cluster(dict(BEFORE)))


@pytest.mark.parametrize("pods", [
    {**BEFORE, "queue": ("queue-2", "2026-12-05T15:15:01Z")},  # replaced by a new pod
    {**BEFORE, "inference": ("inference-1", "2026-12-05T15:15:01Z")},  # started again
])
def test_a_restarted_pod_fails_the_demo(pods: dict[str, tuple[str, str]]) -> None:
    with pytest.raises(demo.NoticedError, match="its pods were restarted"):
        check(Cluster(pods))


def test_a_cordoned_node_or_a_moved_machine_fails_the_demo() -> None:
    with pytest.raises(demo.NoticedError, match="its node was cordoned"):
        check(Cluster(dict(BEFORE), cordoned=True))
    with pytest.raises(demo.NoticedError, match="its machine moved"):
        check(Cluster(dict(BEFORE)), phases=4)
