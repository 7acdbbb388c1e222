"""Status says why an idle GPU is not lent (`hostagent.core.idle.not_lent`): one reason
per idle GPU, each with a name of its own and plain words, from the configuration, the
state and the time alone."""

from __future__ import annotations

import dataclasses
from typing import Any

from hostagent.core.config import Config, parse
from hostagent.core.idle import NotLent, not_lent
from hostagent.core.model import Intent, IntentSource, Phase, State
from hostagent.core.reserve import Reservation
from tests.configs import THREE_GPUS_TWO_OWNERS

NOW = 1_800_000_000.0

CONFIG = THREE_GPUS_TWO_OWNERS


def config(extra: str = "", **policy: Any) -> Config:
    text = CONFIG + extra
    if policy:
        text += "\n[policy]\n" + "".join(f"{k} = {v}\n" for k, v in policy.items())
    return parse(text)


def reasons(cfg: Config, state: State) -> dict[str, NotLent]:
    return {gpu: why.reason for gpu, why in not_lent(cfg, state, NOW).items()}


def test_each_reason_has_a_name_of_its_own() -> None:
    assert len({r.value for r in NotLent}) == len(NotLent)
    assert all(r.value == r.value.lower() and " " not in r.value for r in NotLent)


def test_a_lent_gpu_and_a_gpu_an_owner_plays_on_are_not_idle() -> None:
    state = State(phase=Phase.LENT, lent=frozenset({"gpu-b", "gpu-c"}),
                  running_owners=frozenset({"gaming1"}), agent_up=True)
    assert not_lent(config(), state, NOW) == {}


def test_on_hold_every_idle_gpu_says_so() -> None:
    why = not_lent(config(), State(hold=True), NOW)
    assert {g: w.reason for g, w in why.items()} == dict.fromkeys(
        ("gpu-a", "gpu-b", "gpu-c"), NotLent.HOLD)
    assert "hostagent lend" in why["gpu-a"].words


def test_below_min_gpus_names_the_setting_and_the_count() -> None:
    cfg = parse(CONFIG.replace('gpus = ["gpu-a", "gpu-b", "gpu-c"]\n',
                                'gpus = ["gpu-a", "gpu-b", "gpu-c"]\nmin_gpus = 2\n', 1))
    state = State(running_owners=frozenset({"gaming1", "gaming2"}))
    why = not_lent(cfg, state, NOW)
    assert list(why) == ["gpu-c"]
    assert why["gpu-c"].reason is NotLent.BELOW_MIN_GPUS
    assert "min_gpus = 2" in why["gpu-c"].words and "1 GPU" in why["gpu-c"].words


def test_partial_false_keeps_the_free_gpus_idle_while_an_owner_plays() -> None:
    why = not_lent(config(partial="false"), State(running_owners=frozenset({"gaming1"})), NOW)
    assert {g: w.reason for g, w in why.items()} == {"gpu-b": NotLent.PARTIAL_OFF,
                                                     "gpu-c": NotLent.PARTIAL_OFF}
    assert "partial = false" in why["gpu-b"].words and "gpu-a" in why["gpu-b"].words


def test_a_gpu_sharing_an_iommu_group_with_a_played_gpu_is_held_for_it() -> None:
    cfg = config()
    grouped = {label: dataclasses.replace(gpu, iommu_groups=("7",) if label in ("gpu-a", "gpu-c")
                                          else ("9",))
               for label, gpu in cfg.gpus.items()}
    cfg = dataclasses.replace(cfg, gpus=grouped)
    state = State(running_owners=frozenset({"gaming1"}), phase=Phase.LENT, agent_up=True,
                  lent=frozenset({"gpu-b"}))
    why = not_lent(cfg, state, NOW)
    assert why["gpu-c"].reason is NotLent.IOMMU_GROUP
    assert "gpu-a" in why["gpu-c"].words and "gaming1" in why["gpu-c"].words
    assert "gpu-b" not in why


def test_a_gpu_whose_group_another_vm_holds_names_that_vm() -> None:
    why = not_lent(config(), State(held={"gpu-c": "usb-vm"}, phase=Phase.LENT, agent_up=True,
                                   lent=frozenset({"gpu-a", "gpu-b"})), NOW)
    assert why["gpu-c"].reason is NotLent.IOMMU_GROUP
    assert "usb-vm" in why["gpu-c"].words


def test_in_the_relend_delay_the_time_it_ends_is_said() -> None:
    why = not_lent(config(relend_delay='"30s"'), State(relend_at=NOW + 12), NOW)
    assert {w.reason for w in why.values()} == {NotLent.RELEND_DELAY}
    assert "relend_delay (30 s" in why["gpu-a"].words and why["gpu-a"].until == NOW + 12
    # The words do not count down: MQTT publishes a state when it changes.
    assert not_lent(config(relend_delay='"30s"'), State(relend_at=NOW + 12), NOW + 5) == why


def test_a_reservation_keeps_its_owners_gpu_and_says_whose() -> None:
    held = Reservation(vm="gaming2", at=NOW + 600, by="mqtt", made=NOW - 60, holding=True)
    state = State(phase=Phase.LENT, agent_up=True, lent=frozenset({"gpu-a", "gpu-c"}),
                  reservations=(held,))
    why = not_lent(config(), state, NOW)
    assert list(why) == ["gpu-b"]
    assert why["gpu-b"].reason is NotLent.RESERVATION
    assert "gaming2" in why["gpu-b"].words and "mqtt" in why["gpu-b"].words
    assert why["gpu-b"].until == NOW + 600
    late = not_lent(config(), state, NOW + 601)["gpu-b"]
    assert late.reason is NotLent.RESERVATION and late.until is None
    assert "not used yet" in late.words


def test_an_owner_on_its_way_keeps_its_gpu_and_the_others_wait_for_it() -> None:
    asked = Intent(id="i1", owner="gaming1", created_at=NOW - 3, source=IntentSource.HOOK)
    why = reasons(config(), State(intents=(asked,)))
    assert why == {"gpu-a": NotLent.OWNER_STARTING, "gpu-b": NotLent.OWNER_STARTING,
                   "gpu-c": NotLent.OWNER_STARTING}


def test_a_failed_lendee_start_says_its_reason() -> None:
    why = not_lent(config(), State(reason="Failed to get write lock"), NOW)
    assert why["gpu-a"].reason is NotLent.START_FAILED
    assert "Failed to get write lock" in why["gpu-a"].words


def test_a_running_lendee_without_a_freed_gpu_says_when_it_takes_it() -> None:
    state = State(phase=Phase.LENT, agent_up=True, lent=frozenset({"gpu-b", "gpu-c"}),
                  regrow_waiting=True)
    assert reasons(config(), state) == {"gpu-a": NotLent.REGROW}
    state = dataclasses.replace(state, regrow_waiting=False)
    why = not_lent(config(regrow='"never"'), state, NOW)
    assert why["gpu-a"].reason is NotLent.REGROW and 'regrow = "never"' in why["gpu-a"].words


def test_a_gpu_the_lendee_does_not_borrow_says_so() -> None:
    text = CONFIG + '\n[gpus.gpu-z]\npci = "0000:1a:00.0"\n\n[owners.gaming3]\ngpus = ["gpu-z"]\n'
    state = State(phase=Phase.LENT, agent_up=True, lent=frozenset({"gpu-a", "gpu-b", "gpu-c"}))
    assert reasons(parse(text), state) == {"gpu-z": NotLent.NOT_BORROWED}


def test_a_reclaim_under_way_says_the_lendee_is_going() -> None:
    state = State(phase=Phase.DRAINING, lent=frozenset({"gpu-b"}), reclaiming=True)
    assert reasons(config(), state) == {"gpu-a": NotLent.LENDEE_BUSY,
                                        "gpu-c": NotLent.LENDEE_BUSY}
