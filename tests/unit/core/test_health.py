"""The health checks (`hostagent.core.health`): every probe run at once, each within its
budget, one run shared by every caller and kept `max_age`, forgotten when what a check
reads changes; the probes of libvirt, a socket, the configured domains, the cluster and
another lendee's checks, each saying what it found."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hostagent.core import health
from hostagent.core.health import CheckFailed, CheckResult, Health


class Counted:
    """A check that counts its runs and answers "run N", N its runs so far when it ends;
    each run waits for `gate`, open unless `held`."""

    def __init__(self, *, held: bool = False) -> None:
        self.runs = 0
        self.gate = asyncio.Event()
        if not held:
            self.gate.set()

    async def __call__(self) -> str:
        self.runs += 1
        await self.gate.wait()
        return f"run {self.runs}"


async def test_health_runs_every_check_within_its_budget(tmp_path: Path) -> None:
    async def fine() -> str:
        return "all good"

    async def hangs() -> str:
        await asyncio.sleep(10)
        return "never"

    async def breaks() -> str:
        raise ConnectionRefusedError("refused")

    h = Health(timeout=0.2)
    for name, probe in (("fine", fine), ("hangs", hangs), ("breaks", breaks)):
        h.add(name, probe)
    results = {r.check: r for r in await h.check()}
    assert list(results) == ["fine", "hangs", "breaks"]
    assert results["fine"].ok and results["fine"].detail == "all good"
    assert results["hangs"] == CheckResult("hangs", False, "no answer within 0.2s")
    assert results["breaks"] == CheckResult("breaks", False, "refused")
    assert h.last == list(results.values())


async def test_health_is_one_run_shared_by_every_caller_and_briefly_kept() -> None:
    """Status over SSH, /healthz and /metrics, asked in a flood, cost one run per
    max_age: each run connects to the hook socket, calls libvirt and asks the API server."""
    now = 100.0
    probe = Counted(held=True)
    h = Health(clock=lambda: now)
    h.add("kubernetes", probe)
    callers = [asyncio.create_task(h.check()) for _ in range(200)]
    await asyncio.sleep(0)
    probe.gate.set()
    answers = await asyncio.gather(*callers)
    assert probe.runs == 1
    assert all(a == answers[0] for a in answers) and answers[0][0].detail == "run 1"
    now += h.max_age / 2
    assert (await h.check())[0].detail == "run 1" and probe.runs == 1  # young enough: kept
    now += h.max_age
    assert (await h.check())[0].detail == "run 2"
    assert (await h.check(max_age=0))[0].detail == "run 3"  # asked for fresh
    # A caller that stops waiting (its client hung up) leaves the run to the others.
    probe.gate.clear()
    gone, stays = (asyncio.create_task(h.check(max_age=0)) for _ in range(2))
    await asyncio.sleep(0)
    gone.cancel()
    probe.gate.set()
    assert (await stays)[0].detail == "run 4" and probe.runs == 4
    assert gone.cancelled()


async def test_health_forgets_results_older_than_a_change_it_is_told_of() -> None:
    """The state file is saved again: a status asked just after shows it, neither the
    kept results nor a run begun before the save."""
    now = 100.0
    saved = False
    gate = asyncio.Event()
    gate.set()

    async def probe() -> str:
        seen = saved  # read at the start of a run, as the agent's check does
        await gate.wait()
        return "saved" if seen else "refused"

    h = Health(clock=lambda: now)
    h.add("state file", probe)
    assert (await h.check())[0].detail == "refused"
    saved = True
    h.forget()
    assert (await h.check())[0].detail == "saved"  # within max_age, yet run again
    # A run in flight when told: its callers get the run after it.
    saved = False
    gate.clear()
    caller = asyncio.create_task(h.check(max_age=0))
    await asyncio.sleep(0)
    saved = True
    h.forget()
    gate.set()
    assert (await caller)[0].detail == "saved"
    assert (await h.check())[0].detail == "saved"  # and that later run is kept


async def test_socket_check_connects(tmp_path: Path) -> None:
    path = tmp_path / "hook.sock"
    probe = health.socket_answers(path, "hook socket")
    with pytest.raises(CheckFailed, match="hook socket .*hook.sock"):
        await probe()
    server = await asyncio.start_unix_server(lambda r, w: w.close(), path=str(path))
    async with server:
        assert "accepts connections" in str(await probe())


async def test_libvirt_check_says_what_is_wrong() -> None:
    class FakeLibvirt:
        uri = "qemu:///system"
        connected = False

        async def running_domains(self) -> set[str]:
            raise RuntimeError("list running domains: lost libvirtd")

    fake = FakeLibvirt()
    probe = health.libvirt_alive(fake)
    with pytest.raises(CheckFailed, match=r"^libvirt: not connected to qemu:///system"):
        await probe()
    fake.connected = True
    with pytest.raises(CheckFailed, match=r"^libvirt: list running domains: lost libvirtd"):
        await probe()


def test_a_result_reads_as_a_dict() -> None:
    assert CheckResult("libvirt", False, "not connected").as_dict() == {
        "check": "libvirt", "ok": False, "detail": "not connected"}


async def test_checks_are_added_replaced_and_removed_by_name() -> None:
    async def one() -> str:
        return "one"

    async def two() -> None:
        return None  # nothing to say: "ok"

    async def bare() -> str:
        raise RuntimeError()  # no message: its type says what broke

    async def down() -> str:
        raise CheckFailed("libvirt: not connected")

    h = Health(max_age=0)
    assert (h.timeout, h.max_age, h.names) == (3.0, 0, [])
    assert Health().max_age == health.MAX_AGE == 1.0
    h.add("a", one)
    h.add("b", bare)
    h.add("a", two)
    assert h.names == ["a", "b"]
    h.add("c", down)
    assert await h.check() == [CheckResult("a", True, "ok"),
                               CheckResult("b", False, "RuntimeError"),
                               CheckResult("c", False, "libvirt: not connected")]
    h.remove("c")
    h.remove("a")
    h.remove("never added")
    assert h.names == ["b"]
    assert [r.check for r in await h.check()] == ["b"]


async def test_results_are_kept_for_max_age_then_run_again() -> None:
    now = 100.0
    probe = Counted()
    h = Health(clock=lambda: now, max_age=5.0)
    h.add("x", probe)
    assert (await h.check())[0].detail == "run 1"
    now = 104.9
    assert (await h.check())[0].detail == "run 1"
    assert (await h.check(max_age=4.9))[0].detail == "run 2"  # as old as asked: run again
    now = 109.9 + 5.0
    assert (await h.check())[0].detail == "run 3"
    h.forget()
    assert (await h.check())[0].detail == "run 4"
    assert (await h.check())[0].detail == "run 4"  # the run after a forget is kept


async def test_a_forget_during_a_run_keeps_its_results_from_later_callers() -> None:
    now = 100.0
    probe = Counted(held=True)
    h = Health(clock=lambda: now)
    h.add("x", probe)
    first = asyncio.create_task(h.check())
    await asyncio.sleep(0)
    h.forget()
    probe.gate.set()
    assert (await first)[0].detail == "run 2"  # the run begun before is not given
    assert h.last[0].detail == "run 2"
    assert (await h.check())[0].detail == "run 2" and probe.runs == 2


async def test_domains_defined_names_each_missing_domain_and_what_libvirt_has() -> None:
    class Libvirt:
        uri = "qemu:///system"
        defined = {"win11", "gpu-node"}

        async def defined_domains(self) -> set[str]:
            return set(self.defined)

    fake = Libvirt()
    wanted = {"owners.gaming1": "win11", "lendee": "gpu-node"}
    probe = health.domains_defined(fake, wanted, "hostagent.toml")
    assert await probe() == "the 2 configured domain(s) are defined"
    fake.defined = {"other", "another"}
    with pytest.raises(CheckFailed) as info:
        await probe()
    assert str(info.value) == (
        "hostagent.toml: libvirt at qemu:///system has no domain for owners.gaming1 "
        "('win11'), lendee ('gpu-node') (it has: another, other): fix the name, define the "
        "VM (virsh define), or remove the entry")
    fake.defined = set()
    with pytest.raises(CheckFailed, match=r"\(it has: none\)"):
        await probe()

    class Broken(Libvirt):
        async def defined_domains(self) -> set[str]:
            raise RuntimeError("lost libvirtd")

    with pytest.raises(CheckFailed, match="^domains: lost libvirtd$"):
        await health.domains_defined(Broken(), wanted, "x")()


async def test_libvirt_check_counts_the_running_domains() -> None:
    class Libvirt:
        uri = "qemu:///system"
        connected = True

        async def running_domains(self) -> set[str]:
            return {"a", "b"}

    assert await health.libvirt_alive(Libvirt())() == (
        "connected to qemu:///system; 2 domain(s) running")


async def test_the_kubernetes_check_is_what_the_cluster_says() -> None:
    class Cluster:
        async def health(self) -> str:
            return "node gpu-node Ready"

    assert await health.kubernetes(Cluster())() == "node gpu-node Ready"


async def test_another_lendees_checks_pass_as_one_but_those_it_shares() -> None:
    checks = Health(max_age=0)
    verdict = {"kubernetes": True, "libvirt": False}

    def probe(name: str) -> health.Probe:
        async def run() -> str:
            if not verdict[name]:
                raise CheckFailed(f"{name} down")
            return "fine"
        return run

    for name in verdict:
        checks.add(name, probe(name))
    one = health.of_lendee(checks)
    assert await one() == "kubernetes pass"  # libvirt is the agent's own check
    verdict["kubernetes"] = False
    with pytest.raises(CheckFailed, match="^kubernetes: kubernetes down$"):
        await one()
    both = health.of_lendee(checks, shared=())
    with pytest.raises(CheckFailed, match="^kubernetes: kubernetes down; libvirt: libvirt down$"):
        await both()
    verdict.update(kubernetes=True, libvirt=True)
    assert await both() == "kubernetes, libvirt pass"


async def test_a_socket_nobody_listens_on_is_said_in_words(tmp_path: Path) -> None:
    path = tmp_path / "nothing.sock"
    with pytest.raises(CheckFailed) as info:
        await health.socket_answers(path)()
    assert str(info.value) == f"socket {path}: No such file or directory"


async def test_every_forget_makes_the_results_before_it_stale() -> None:
    now = 100.0
    probe = Counted()
    h = Health(clock=lambda: now)
    h.add("x", probe)
    h.forget()
    assert (await h.check())[0].detail == "run 1"
    probe.gate.clear()
    caller = asyncio.create_task(h.check(max_age=0))
    await asyncio.sleep(0)
    h.forget()  # a second change, during the run begun after the first
    probe.gate.set()
    assert (await caller)[0] == CheckResult("x", True, "run 3")
