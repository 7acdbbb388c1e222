"""The hook's sentences where they list several GPUs or VMs (an owner of two cards, two
games waiting), written out whole: whoever ran ``virsh start`` reads them."""

from __future__ import annotations

from hostagent.core.machine import FOLLOW, verdict
from hostagent.core.model import Intent, IntentSource, Phase, State, Topology
from tests.unit.machine_scaffold import built

LENDEE = "gpu-node"
# big owns two of the lendee's GPUs; gaming1 and gaming2 one each; gpu-d is nobody's.
TOPO = Topology(
    lendee=LENDEE,
    lendee_gpus=frozenset({"gpu-a", "gpu-b", "gpu-c", "gpu-d"}),
    owners={"big": frozenset({"gpu-a", "gpu-b"}), "gaming1": frozenset({"gpu-c"}),
            "gaming2": frozenset({"gpu-d"})},
)
ALL = frozenset({"gpu-a", "gpu-b", "gpu-c", "gpu-d"})


def waiting(*owners: str) -> tuple[Intent, ...]:
    return tuple(Intent(id=f"i-{o}", owner=o, created_at=1.0, source=IntentSource.HOOK)
                 for o in owners)


def test_an_owner_of_two_gpus_hears_both() -> None:
    lent = built(Phase.LENT, lent=ALL)
    assert verdict(lent, "big", topo=TOPO) == ("defer", (
        "gpu-node holds gpu-a, gpu-b; hostagent is draining it and shutting it down to free "
        f"them, and big will start by itself then ({FOLLOW})"))
    short = built(Phase.LENT, lent=frozenset({"gpu-d"}))
    assert verdict(short, "big", topo=TOPO) == ("proceed", "gpu-node runs without gpu-a, gpu-b")


def test_a_live_unplug_of_exactly_the_owners_gpus_is_said() -> None:
    # What the owner claims is being detached already: no drain, no shutdown.
    taking = built(Phase.LENT, lent=ALL, detaching=frozenset({"gpu-a", "gpu-b"}))
    assert verdict(taking, "big", topo=TOPO) == ("defer", (
        "hostagent is taking gpu-a, gpu-b from gpu-node while it runs (or, failing that, "
        f"shutting it down), and big will start by itself then ({FOLLOW})"))
    # Only one of its two: the rest needs the drain.
    part = built(Phase.LENT, lent=ALL, detaching=frozenset({"gpu-a"}))
    assert verdict(part, "big", topo=TOPO)[1].startswith("gpu-node holds gpu-a, gpu-b; ")


def test_the_lendee_started_by_hand_hears_every_gpu_and_game() -> None:
    starting = built(Phase.OFF, lendee_starting=True, lent=frozenset({"gpu-d"}))
    assert verdict(starting, LENDEE, topo=TOPO, gpus=ALL) == ("defer", (
        "hostagent is starting gpu-node without gpu-a, gpu-b, gpu-c right now; it lends "
        f"gpu-node the rest by itself when they are free ({FOLLOW})"))
    handed: State = built(Phase.OFF, intents=waiting("big", "gaming1"))
    assert verdict(handed, LENDEE, topo=TOPO) == ("defer", (
        "gpu-node's GPUs are being handed to big, gaming1; hostagent lends them again by "
        f"itself when that is over ({FOLLOW})"))
