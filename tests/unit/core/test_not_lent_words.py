"""The exact words and fields of each reason `hostagent.core.idle.not_lent` gives (status
and MQTT show them as they are), and the order in which the reasons are asked."""

from __future__ import annotations

import dataclasses

import pytest

from hostagent.core.config import Config, parse
from hostagent.core.idle import NotLent, Why, as_dicts, not_lent
from hostagent.core.model import Intent, IntentSource, Phase, State
from hostagent.core.reserve import Reservation
from tests.configs import THREE_GPUS_TWO_OWNERS

NOW = 1_800_000_000.0

CONFIG = THREE_GPUS_TWO_OWNERS


def config(policy: str = "", extra: str = "") -> Config:
    return parse(CONFIG + extra + (f"\n[policy]\n{policy}\n" if policy else ""))


def asked(owner: str, id: str = "i1") -> Intent:
    return Intent(id=id, owner=owner, created_at=NOW - 3, source=IntentSource.HOOK)


def words(cfg: Config, state: State, now: float = NOW) -> dict[str, tuple[str, str, float | None]]:
    return {g: (w.reason.value, w.words, w.until) for g, w in not_lent(cfg, state, now).items()}


def lent(*gpus: str, **more: object) -> State:
    return State(phase=Phase.LENT, agent_up=True, lent=frozenset(gpus), **more)  # type: ignore[arg-type]


def test_a_gpu_the_lendee_does_not_borrow_is_named_with_the_setting() -> None:
    cfg = parse(CONFIG + '\n[gpus.gpu-z]\npci = "0000:1a:00.0"\n\n[owners.gaming3]\ngpus = ["gpu-z"]\n')
    assert words(cfg, lent("gpu-a", "gpu-b", "gpu-c")) == {
        "gpu-z": ("not-borrowed", "gpu-node does not borrow it (lendee.gpus)", None)}


def test_owners_on_their_way_keep_their_gpus_and_the_others_wait_for_all_of_them() -> None:
    state = State(intents=(asked("gaming2", "i2"), asked("gaming1"), asked("gaming2", "i3")))
    assert words(config(), state) == {
        "gpu-a": ("owner-starting", "kept for gaming1, which is starting", None),
        "gpu-b": ("owner-starting", "kept for gaming2, which is starting", None),
        "gpu-c": ("owner-starting",
                  "gaming2, gaming1 are starting: gpu-node waits until they run", None),
    }


def test_one_owner_starting_is_said_in_the_singular() -> None:
    state = lent("gpu-b", starting_owners=frozenset({"gaming1"}))
    assert words(config(), state) == {
        "gpu-a": ("owner-starting", "kept for gaming1, which is starting", None),
        "gpu-c": ("owner-starting", "gaming1 is starting: gpu-node waits until it runs", None),
    }


@pytest.mark.parametrize("phase", [Phase.OFF, Phase.LENT, Phase.BOOTING, Phase.JOINING])
def test_the_others_wait_for_an_owner_on_its_way_in_every_phase_it_waits_in(
        phase: Phase) -> None:
    state = State(phase=phase, intents=(asked("gaming1"),), lent=frozenset({"gpu-b"}))
    assert not_lent(config(), state, NOW)["gpu-c"] == Why(
        NotLent.OWNER_STARTING, "gaming1 is starting: gpu-node waits until it runs")


@pytest.mark.parametrize(("phase", "said"), [
    (Phase.DRAINING, "gpu-node is draining: it takes it at its next start"),
    (Phase.STOPPING, "gpu-node is stopping: it takes it at its next start"),
    (Phase.FAILED, "gpu-node is failed: boom"),
])
def test_a_lendee_going_away_or_failed_says_so_before_any_owner_on_its_way(
        phase: Phase, said: str) -> None:
    state = State(phase=phase, reason="boom", intents=(asked("gaming1"),),
                  lent=frozenset({"gpu-b"}))
    assert not_lent(config(), state, NOW)["gpu-c"] == Why(NotLent.LENDEE_BUSY, said)


def test_an_owner_needing_no_lendee_gpu_keeps_nobody_waiting() -> None:
    cfg = config(extra='\n[gpus.gpu-z]\npci = "0000:1a:00.0"\n\n[owners.gaming3]\ngpus = ["gpu-z"]\n')
    state = lent("gpu-a", "gpu-b", intents=(asked("gaming3"),))
    assert words(cfg, state)["gpu-c"] == (
        "regrow", "gpu-node runs without it and takes it at its next start (lent now)", None)


def test_a_reservation_says_whose_how_to_free_it_and_until_when() -> None:
    held = Reservation(vm="gaming2", at=NOW + 600, by="mqtt", made=NOW - 60, holding=True)
    state = lent("gpu-a", "gpu-c", reservations=(held,))
    assert words(config(), state) == {"gpu-b": (
        "reservation", "kept for gaming2, reserved by mqtt (`hostagent reserve gaming2 --cancel` "
        "frees it)", NOW + 600)}
    # At its very time it has come: no time left to say.
    assert words(config(), state, NOW + 600) == {"gpu-b": (
        "reservation", "kept for gaming2, reserved by mqtt: its time has come and it is not "
        "used yet; lent again when it expires or is cancelled", None)}


def test_a_reservation_that_does_not_hold_keeps_nothing() -> None:
    loose = Reservation(vm="gaming2", at=NOW + 600, by="mqtt", made=NOW - 60, holding=False)
    state = lent("gpu-a", "gpu-c", reservations=(loose,))
    assert words(config(), state)["gpu-b"][0] == "regrow"


def test_the_first_of_two_reservations_on_one_gpu_by_name_is_said() -> None:
    cfg = config(extra='\n[owners.gaming0]\ngpus = ["gpu-b"]\n')
    rs = tuple(Reservation(vm=vm, at=NOW + 600, by=vm + "-by", made=NOW - 60, holding=True)
               for vm in ("gaming2", "gaming0"))
    why = not_lent(cfg, lent("gpu-a", "gpu-c", reservations=rs), NOW)["gpu-b"]
    assert why.words.startswith("kept for gaming0, reserved by gaming0-by ")


def test_a_gpu_whose_group_another_vm_holds_names_it_twice() -> None:
    state = lent("gpu-a", "gpu-b", held={"gpu-c": "usb-vm"})
    assert words(config(), state) == {"gpu-c": (
        "iommu-group", "usb-vm holds another device of its IOMMU group; lent once usb-vm stops",
        None)}


def test_a_gpu_sharing_a_group_with_an_owners_gpus_names_them_and_the_owner() -> None:
    cfg = config(extra='\n[owners.gaming3]\ngpus = ["gpu-a", "gpu-b"]\n')
    grouped = {label: dataclasses.replace(gpu, iommu_groups=("7",))
               for label, gpu in cfg.gpus.items()}
    cfg = dataclasses.replace(cfg, gpus=grouped)
    state = State(running_owners=frozenset({"gaming3"}))
    assert words(cfg, state) == {"gpu-c": (
        "iommu-group", "shares its IOMMU group with gpu-a, gpu-b, which gaming3 takes: VFIO "
        "gives a group to one VM at a time", None)}


def test_partial_off_names_what_is_taken_in_the_singular_and_the_plural() -> None:
    cfg = config("partial = false")
    assert words(cfg, State(running_owners=frozenset({"gaming1", "gaming2"}))) == {"gpu-c": (
        "partial-off", "policy.partial = false: gpu-node runs with all its GPUs or none, and "
        "gpu-a, gpu-b are taken", None)}
    assert words(cfg, State(running_owners=frozenset({"gaming1"})))["gpu-c"] == (
        "partial-off", "policy.partial = false: gpu-node runs with all its GPUs or none, and "
        "gpu-a is taken", None)


def test_partial_off_counts_a_gpu_held_by_another_vm_as_taken() -> None:
    state = State(held={"gpu-c": "usb-vm"})
    assert words(config("partial = false"), state)["gpu-a"] == (
        "partial-off", "policy.partial = false: gpu-node runs with all its GPUs or none, and "
        "gpu-c is taken", None)


def test_partial_on_lends_the_rest_while_an_owner_plays() -> None:
    assert words(config(), State(running_owners=frozenset({"gaming1"})))["gpu-c"] == (
        "lending", "gpu-node is about to start with it", None)


def test_a_hold_is_said_with_how_to_end_it() -> None:
    assert words(config(), State(hold=True))["gpu-a"] == (
        "hold", "lending is on hold (`hostagent lend` lends again)", None)


def test_below_min_gpus_counts_the_free_gpus_in_the_singular_and_the_plural() -> None:
    cfg = parse(CONFIG.replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]\n',
                               'gpus = ["gpu-a", "gpu-b", "gpu-c"]\nmin_gpus = 3\n', 1))
    assert words(cfg, State(running_owners=frozenset({"gaming1"})))["gpu-b"] == (
        "below-min-gpus", "2 GPUs free, fewer than lendee.min_gpus = 3", None)
    assert words(cfg, State(running_owners=frozenset({"gaming1", "gaming2"})))["gpu-c"] == (
        "below-min-gpus", "1 GPU free, fewer than lendee.min_gpus = 3", None)
    # As many free as it needs: lent.
    assert words(cfg, State())["gpu-c"][0] == "lending"


def test_off_the_relend_delay_comes_before_a_failed_start_and_says_its_end() -> None:
    state = State(relend_at=NOW + 1.5, reason="boom")
    assert words(config('relend_delay = "90s"'), state)["gpu-a"] == (
        "relend-delay", "lent once policy.relend_delay (90 s after the last game) has passed",
        NOW + 1.5)


def test_a_failed_start_says_its_reason_and_how_to_try_again() -> None:
    assert words(config(), State(reason="boom"))["gpu-a"] == (
        "start-failed", "gpu-node's last start failed: boom (`hostagent lend` tries again)", None)


def test_running_the_relend_delay_comes_before_a_waiting_regrow() -> None:
    state = lent("gpu-b", "gpu-c", relend_at=NOW + 1.5, regrow_waiting=True)
    assert words(config('relend_delay = "90s"'), state)["gpu-a"] == (
        "relend-delay", "lent once policy.relend_delay (90 s after the last game) has passed",
        NOW + 1.5)


def test_a_waiting_regrow_says_what_it_waits_for() -> None:
    state = lent("gpu-b", "gpu-c", regrow_waiting=True, hotadd_failed=True)
    assert words(config(), state)["gpu-a"] == (
        "regrow", 'gpu-node takes it once no pod on its node uses a GPU (policy.regrow = '
        '"when-idle")', None)


@pytest.mark.parametrize(("policy", "kubernetes", "more", "how"), [
    ("", False, {}, "lent now"),
    ("", True, {}, "lent now"),
    ('regrow = "when-idle"', False, {}, "lent now"),
    ('regrow = "when-idle"', True, {}, "lent now"),
    ('regrow = "never"', False, {}, 'policy.regrow = "never"'),
    ('regrow = "never"', True, {}, 'policy.regrow = "never"'),
    ('regrow = "never"', False, {"hotadd_failed": True}, "a hot-add failed since it started"),
    ("", True, {"hotadd_failed": True}, "a hot-add failed since it started"),
    ("", False, {"phase": Phase.BOOTING}, "booting now"),
])
def test_a_running_lendee_says_why_it_runs_without_a_free_gpu(
        policy: str, kubernetes: bool, more: dict[str, object], how: str) -> None:
    cfg = config(policy, "\n[kubernetes]\n" if kubernetes else "")
    state = dataclasses.replace(lent("gpu-b", "gpu-c"), **more)  # type: ignore[arg-type]
    assert words(cfg, state)["gpu-a"] == (
        "regrow", f"gpu-node runs without it and takes it at its next start ({how})", None)


def test_the_gpus_in_use_are_absent_and_the_rest_sorted_by_label() -> None:
    cfg = config(extra='\n[gpus.gpu-0]\npci = "0000:1a:00.0"\n\n[owners.gaming0]\ngpus = ["gpu-0"]\n')
    assert list(not_lent(cfg, State(), NOW)) == ["gpu-0", "gpu-a", "gpu-b", "gpu-c"]
    assert list(not_lent(cfg, lent("gpu-b"), NOW)) == ["gpu-0", "gpu-a", "gpu-c"]
    assert list(not_lent(cfg, State(running_owners=frozenset({"gaming1"})), NOW)) == [
        "gpu-0", "gpu-b", "gpu-c"]


def test_as_dicts_gives_each_reason_by_its_name_words_and_end() -> None:
    whys = {"gpu-a": Why(NotLent.RELEND_DELAY, "soon", until=NOW),
            "gpu-b": Why(NotLent.HOLD, "held")}
    assert as_dicts(whys) == {
        "gpu-a": {"reason": "relend-delay", "words": "soon", "until": NOW},
        "gpu-b": {"reason": "hold", "words": "held", "until": None},
    }


def test_a_vm_that_is_no_owner_running_asking_or_reserving_keeps_nothing() -> None:
    """An owner since removed from the configuration may still run, have a persisted
    request or a reservation: it claims no GPU, and the reasons are read past it."""
    gone = Reservation(vm="removed", at=NOW + 600, by="mqtt", made=NOW - 60, holding=True)
    state = lent("gpu-b", "gpu-c", running_owners=frozenset({"removed"}),
                 intents=(asked("removed"),), reservations=(gone,))
    assert words(config(), state) == {"gpu-a": (
        "regrow", "gpu-node runs without it and takes it at its next start (lent now)", None)}
