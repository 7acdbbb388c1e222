"""The topology's checks and views (`hostagent.core.model.Topology`) where the machine's
tests do not look: IOMMU groups that overlap named, the owners and names frozen, a GPU
named by its label when it has no name, owners unknown owning nothing; and
`still_wanted` for a hot-add or hot-unplug queued earlier."""

from __future__ import annotations

import pytest

from hostagent.core.model import AttachGpus, DetachGpus, Phase, Topology, still_wanted
from tests.unit.partial_world import TOPO, A, B, C, S, gpus


def test_gpus_in_two_iommu_groups_are_named() -> None:
    with pytest.raises(ValueError) as info:
        Topology(lendee="n", lendee_gpus=gpus(A, B, C), owners={},
                 groups=(gpus(A, B), gpus(C), gpus(A, B, C)))
    assert str(info.value) == "gpu-a, gpu-b, gpu-c in two IOMMU groups"


def test_owners_and_names_cannot_be_edited_behind_the_machines_back() -> None:
    owners = {"gaming1": gpus(A)}
    names = {A: "gpu-a (RTX 4090)"}
    topo = Topology(lendee="n", lendee_gpus=gpus(A, B), owners=owners, names=names)
    owners["gaming2"] = gpus(B)
    names[B] = "gpu-b"
    assert (dict(topo.owners), dict(topo.names)) == ({"gaming1": gpus(A)},
                                                     {A: "gpu-a (RTX 4090)"})
    with pytest.raises(TypeError):
        topo.owners["gaming3"] = gpus(B)  # type: ignore[index]
    with pytest.raises(TypeError):
        topo.names[B] = "x"  # type: ignore[index]


def test_gpus_are_named_sorted_by_label_and_by_it_when_they_have_no_name() -> None:
    topo = Topology(lendee="n", lendee_gpus=gpus(A, B), owners={},
                    names={B: "gpu-b (RTX 3050, 0000:02:00.0)"})
    assert topo.gpu_names([B, A]) == "gpu-a, gpu-b (RTX 3050, 0000:02:00.0)"


def test_the_gpus_of_owners_unknown_owners_owning_none() -> None:
    assert TOPO.gpus_of(["gaming1", "nobody", "gaming2"]) == gpus(A, B)
    assert TOPO.gpus_of(["nobody"]) == frozenset()


def test_a_queued_hot_add_or_hot_unplug_is_wanted_only_as_it_was_asked() -> None:
    state = S(Phase.LENT, lent=gpus(A, B, C), attaching=gpus(A))
    t = state.ticket
    assert still_wanted(state, AttachGpus(ticket=t, gpus=gpus(A)), topo=TOPO)
    assert not still_wanted(state, AttachGpus(ticket=t + 1, gpus=gpus(A)), topo=TOPO)
    assert not still_wanted(state, AttachGpus(ticket=t, gpus=gpus(B)), topo=TOPO)
    assert not still_wanted(state, DetachGpus(ticket=t, gpus=gpus(A)), topo=TOPO)
    state = S(Phase.LENT, lent=gpus(A, B, C), detaching=gpus(B))
    assert still_wanted(state, DetachGpus(ticket=t, gpus=gpus(B)), topo=TOPO)
    assert not still_wanted(state, DetachGpus(ticket=t + 1, gpus=gpus(B)), topo=TOPO)
    assert not still_wanted(state, DetachGpus(ticket=t, gpus=gpus(A)), topo=TOPO)
    assert not still_wanted(state, AttachGpus(ticket=t, gpus=gpus(B)), topo=TOPO)
