"""The agent end to end: real libvirtd, real hook, real guests, real journald."""

from __future__ import annotations

import difflib
import signal
import threading
import time

import pytest

from tests.lab.lab import DEFERRED, Lab
from tests.waiting import wait_until

pytestmark = pytest.mark.lab

DEFER = "hostagent is draining it and shutting it down to free them"


def lent(lab: Lab, timeout: float = 60) -> None:
    """Wait until the lendee is lent (a new LENT record after the last one seen)."""
    before = len(lab.records(event="phase", to="lent"))
    lab.wait_records(before + 1, timeout, event="phase", to="lent")


def wait_lent(lab: Lab, timeout: float = 60) -> None:
    lab.wait_record(timeout, event="phase", to="lent")



def persistent(lab: Lab) -> str:
    return lab.virsh("dumpxml", "--inactive", "--security-info", "gpu-node").stdout


def same(a: str, b: str) -> bool:
    """The same definition, line for line; libvirt may reorder controllers when it
    formats a definition again after a start (it did so for the first plain start)."""
    if sorted(a.splitlines()) != sorted(b.splitlines()):
        print("".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True))))
        return False
    return True


def holders(lab: Lab) -> dict[str, str | None]:
    return {g["gpu"]: g["holder"] for g in lab.status()["gpus"]}


def test_full_cycle_gaming1_plays_while_gpu_node_keeps_the_rest(lab: Lab) -> None:
    """virsh start gaming1: deferred, reclaimed (drain, agent shutdown), gaming1 starts,
    and gpu-node starts again at once with gpu-b and gpu-c, verified in the guest; the
    game ends and gpu-node regrows to all three (policy.regrow: without Kubernetes,
    after relend_delay). QEMU's lock on each lab GPU's disk proves no GPU is held twice;
    gpu-node's persistent definition never changes."""
    definition = persistent(lab)
    lab.start_agent()
    wait_lent(lab)
    assert lab.state("gpu-node") == "running"
    assert holders(lab) == {"gpu-a": "gpu-node", "gpu-b": "gpu-node", "gpu-c": "gpu-node"}

    refused = lab.ask("gaming1")
    assert refused.returncode != 0
    assert DEFER in refused.stderr and "gaming1 will start by itself" in refused.stderr
    assert "journalctl -u hostagent -f" in refused.stderr
    lab.wait_game("gaming1")
    lent(lab)
    # It powered off through its guest agent, not by destroy, then came back smaller.
    assert "lab guest: shutdown" in lab.console("gpu-node")
    st = lab.status()
    assert st["lendee"]["lent"] == ["gpu-b", "gpu-c"]
    assert {g["gpu"]: g["holder"] for g in st["gpus"]} == {
        "gpu-a": "gaming1", "gpu-b": "gpu-node", "gpu-c": "gpu-node"}
    assert st["verified"]["ok"] and "GPU-a0a0a0a0" not in st["verified"]["summary"]
    live = lab.virsh("dumpxml", "gpu-node").stdout
    assert "gpu-a.img" not in live and "gpu-b.img" in live and "gpu-c.img" in live
    assert lab.virsh("dominfo", "gpu-node").stdout.count("Persistent:     yes") == 1
    assert same(persistent(lab), definition)
    assert st["intents"] == []

    lab.wait_agent("gaming1")
    lab.virsh("shutdown", "--mode", "agent", "gaming1")
    lent(lab, timeout=90)
    assert holders(lab) == {"gpu-a": "gpu-node", "gpu-b": "gpu-node", "gpu-c": "gpu-node"}
    assert "gpu-a.img" in lab.virsh("dumpxml", "gpu-node").stdout
    assert same(persistent(lab), definition)
    assert lab.phases() == ["off>booting", "booting>joining", "joining>lent", "lent>draining",
                            "draining>stopping", "stopping>off", "off>booting",
                            "booting>joining", "joining>lent", "lent>draining",
                            "draining>stopping", "stopping>off", "off>booting",
                            "booting>joining", "joining>lent"]
    regrow = lab.records(event="phase", to="draining")[-1]
    assert "is free again and policy.regrow = always" in regrow["MESSAGE"]
    # One structured record per transition, with stable fields and a duration.
    for rec in lab.records(event="phase"):
        assert rec["SYSLOG_IDENTIFIER"] == "hostagent"
        assert rec["HOSTAGENT_VM"] == "gpu-node"
        assert int(rec["HOSTAGENT_DURATION_MS"]) >= 0
        assert rec["HOSTAGENT_RESULT"] == "ok"
    intent = lab.records(event="intent", to="pending")
    assert len(intent) == 1 and intent[0]["HOSTAGENT_VM"] == "gaming1"
    assert "gaming1 will start by itself" in intent[0]["MESSAGE"]
    assert len(lab.records(event="intent", to="done")) == 1


def test_gaming2_mid_game_leaves_gpu_c_and_a_second_owner_is_refused(lab: Lab) -> None:
    """gaming2 starts while gaming1 plays: gpu-node is reclaimed again and comes back with
    gpu-c alone. gaming-win, gpu-a's other owner, is refused at once with one sentence
    while gaming1 holds the card: no reclaim, no wait."""
    lab.start_agent()
    wait_lent(lab)
    lab.play("gaming1")
    lent(lab)
    phases = len(lab.phases())
    refused = lab.ask("gaming-win")
    assert refused.returncode != 0
    assert "gpu-a is in use by gaming1" in refused.stderr
    assert lab.state("gaming-win") == "shut off"
    assert len(lab.phases()) == phases  # nothing moved for it
    assert lab.records(event="refuse")[0]["HOSTAGENT_VM"] == "gaming-win"

    lab.play("gaming2")
    lent(lab)
    assert lab.status()["lendee"]["lent"] == ["gpu-c"]
    # gpu-node comes back with the GPU no game holds (its boot takes a while).
    wait_until(lambda: holders(lab) == {"gpu-a": "gaming1", "gpu-b": "gaming2",
                                        "gpu-c": "gpu-node"}, "gpu-node lent gpu-c", timeout=180)


def test_all_or_nothing_keeps_the_lendee_off_while_a_game_plays(lab: Lab) -> None:
    """policy.partial = false: the behaviour before partial lending, kept as a policy."""
    lab.partial = False
    lab.start_agent()
    wait_lent(lab)
    lab.play("gaming1")
    # Once the agent has taken gaming1's start, gpu-node stays off with no timer left
    # that could start it: only another VM's event could.
    lab.wait_record(event="owner", vm="gaming1", to="running")
    status = lab.status()
    assert (status["lendee"]["phase"], status["relend_in_s"]) == ("off", None)
    assert {g["gpu"]: (g["not_lent"] or {}).get("reason") for g in status["gpus"]} == {
        "gpu-a": None, "gpu-b": "partial-off", "gpu-c": "partial-off"}
    assert lab.state("gpu-node") == "shut off"
    assert holders(lab) == {"gpu-a": "gaming1", "gpu-b": None, "gpu-c": None}
    lab.wait_agent("gaming1")
    lab.virsh("shutdown", "--mode", "agent", "gaming1")
    lent(lab)
    assert holders(lab) == {"gpu-a": "gpu-node", "gpu-b": "gpu-node", "gpu-c": "gpu-node"}


def test_owner_started_while_the_lendee_boots_waits_for_its_agent(lab: Lab) -> None:
    lab.define("gpu-node", agent_delay=8)
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    refused = lab.ask("gaming1")
    assert refused.returncode != 0
    lab.wait_game("gaming1")
    console = lab.console("gpu-node")
    # The guest agent came up first, then the shutdown went through it: never a
    # shutdown sent into a VM whose agent was not answering, never a destroy.
    assert console.index("starting qemu-ga") < console.index("lab guest: shutdown")
    assert not lab.records(event="phase", to="failed")


def test_two_owners_within_100ms_share_one_reclaim(lab: Lab) -> None:
    lab.start_agent()
    wait_lent(lab)
    results = {}

    def start(vm: str) -> None:
        results[vm] = lab.ask(vm)

    threads = [threading.Thread(target=start, args=(vm,)) for vm in ("gaming1", "gaming2")]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the second press 50 ms after the first: the scenario's spacing
    for t in threads:
        t.join()
    assert all(r.returncode != 0 for r in results.values())
    lab.wait_game("gaming1")
    lab.wait_game("gaming2")
    assert lab.phases().count("lent>draining") == 1
    assert lab.phases().count("stopping>off") == 1
    assert len(lab.wait_records(2, event="intent", to="done")) == 2


def test_owner_restarted_within_relend_delay_does_not_boot_the_lendee(lab: Lab) -> None:
    lab.write_config(relend_delay="20s")
    lab.start_agent()
    wait_lent(lab)
    lab.play("gaming1")
    lab.virsh("destroy", "gaming1")
    lab.wait_record(event="owner", to="off")
    lab.virsh("start", "gaming1")  # within the delay: gpu-node runs without gpu-a
    assert lab.state("gaming1") == "running"
    # The first lend and the one with what gaming1 leaves (its record may come late) ...
    lab.wait_records(2, event="phase", to="booting")
    # ... and no regrow for a reboot: once the agent has taken gaming1's second start,
    # the relend timer is gone and no boot followed.
    lab.wait_records(2, event="owner", vm="gaming1", to="running")
    assert lab.status()["relend_in_s"] is None
    assert lab.phases().count("off>booting") == 2


def test_lendee_started_by_hand_mid_game_is_deferred(lab: Lab) -> None:
    lab.partial = False  # with partial lending it is already running with the rest
    lab.start_agent()
    wait_lent(lab)
    lab.play("gaming1")
    refused = lab.virsh("start", "gpu-node", check=False)
    assert refused.returncode != 0
    assert "gpu-node's GPUs are in use by gaming1" in refused.stderr
    assert lab.state("gaming1") == "running"
    assert lab.state("gpu-node") == "shut off"


def test_agent_killed_mid_reclaim_finishes_after_restart(lab: Lab) -> None:
    # A slow guest agent keeps the reclaim in STOPPING long enough to kill us there.
    lab.define("gpu-node", agent_delay=10)
    definition = persistent(lab)
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    refused = lab.ask("gaming1")
    assert refused.returncode != 0
    lab.wait_record(event="phase", to="stopping")
    lab.stop_agent(signal.SIGKILL)
    saved = (lab.root / "var-lib-hostagent" / "state.toml").read_text()
    assert 'owner = "gaming1"' in saved  # persisted before the hook heard "defer"
    assert lab.state("gpu-node") == "running"
    lab.start_agent()
    lab.wait_game("gaming1")
    lent(lab, timeout=90)  # back with what gaming1 leaves
    assert lab.status()["lendee"]["lent"] == ["gpu-b", "gpu-c"]
    assert "lab guest: shutdown" in lab.console("gpu-node")
    assert len(lab.wait_records(1, event="intent", to="done")) == 1
    # Killed mid-cycle, restarted with a live definition: the persistent one is intact.
    assert same(persistent(lab), definition)


def reconnects(lab: Lab) -> int:
    """How often the agent said in its log that it connected to libvirtd again."""
    return sum("reconnected to libvirtd" in m for m in lab.log_lines())


def test_libvirtd_restart_mid_game_reconnects_and_lends_back(lab: Lab) -> None:
    lab.start_agent()
    wait_lent(lab)
    lab.play("gaming1")
    before = reconnects(lab)
    lab.restart_libvirtd()
    assert lab.state("gaming1") == "running"  # reconnect begin did not fail
    lab.wait_agent("gaming1")
    # The agent hears gaming1's stop only once it has connected to libvirtd again.
    wait_until(lambda: reconnects(lab) > before,
               "the agent reconnected to libvirtd", timeout=60)
    lab.virsh("shutdown", "--mode", "agent", "gaming1")
    lent(lab, timeout=90)
    assert lab.state("gpu-node") == "running"


def test_an_owner_undefined_and_a_restart_leave_the_other_owners_swapping(lab: Lab) -> None:
    """An old VM undefined by hand (`virsh undefine gaming-win`) while its [owners] entry
    stays stopped the agent for good once (exit 2, which systemd never restarts): the
    lendee kept the GPUs and every other owner's start failed on libvirt's busy device.
    Now the restart says what is missing and how to fix it, and gaming1 and gaming2 still
    take their GPUs back from the lendee and lend them again when they stop."""
    lab.start_agent()
    wait_lent(lab)
    lab.virsh("undefine", "gaming-win")
    assert lab.stop_agent() == 0
    proc = lab.start_agent()
    text = lab.wait_record(event="config", result="waiting")["MESSAGE"]
    assert "has no domain for owners.gaming-win ('gaming-win')" in text
    assert "virsh define" in text
    lab.wait_records(2, 90, event="phase", to="lent")  # lent again (adopted as it runs)
    for owner in ("gaming1", "gaming2"):  # both asked at once: one reclaim
        assert DEFERRED in lab.ask(owner).stderr
    assert lab.wait_game("gaming1") and lab.wait_game("gaming2")
    # gpu-node comes back with the GPU no game holds (its boot takes a while).
    wait_until(lambda: holders(lab) == {"gpu-a": "gaming1", "gpu-b": "gaming2",
                                        "gpu-c": "gpu-node"}, "gpu-node lent gpu-c", timeout=180)
    for owner in ("gaming1", "gaming2"):
        lab.virsh("destroy", owner)
    wait_until(lambda: holders(lab) == dict.fromkeys(("gpu-a", "gpu-b", "gpu-c"), "gpu-node"),
               "gpu-node lent all three again", timeout=180)
    assert proc.poll() is None


def test_garbage_state_file_is_kept_and_rebuilt_from_reality(lab: Lab) -> None:
    state = lab.root / "var-lib-hostagent" / "state.toml"
    state.write_text("intents = [[[ garbage")
    lab.start_agent()
    wait_lent(lab)
    err = lab.records(event="state")
    assert err and "corrupt" in err[0]["MESSAGE"]
    assert list(state.parent.glob("state.toml.corrupt-*"))


def test_a_pending_start_is_cancelled_by_release(lab: Lab) -> None:
    """gaming1 waits for gpu-a while gpu-node's slow guest agent holds the shutdown
    back: `hostagent release gaming1` withdraws the request. The reclaim under way is
    finished (a half-drained node is the worst of both), gaming1 never starts, and
    gpu-node is lent again."""
    lab.define("gpu-node", agent_delay=8)
    lab.start_agent()
    lab.wait_record(event="phase", to="booting")
    refused = lab.ask("gaming1")
    assert refused.returncode != 0
    out = lab.hostagent("release", "gaming1")
    assert out.returncode == 0, out.stderr
    assert "the pending start of gaming1 is cancelled" in out.stdout
    failed = lab.wait_record(event="intent", to="failed")
    assert "cancelled by hostagent release" in failed["MESSAGE"]
    lent(lab, timeout=120)
    assert lab.state("gaming1") == "shut off"
    assert lab.status()["intents"] == []
