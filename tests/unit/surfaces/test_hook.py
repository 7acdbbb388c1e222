"""The real hooks/qemu script, run as libvirtd runs it, against a real hook socket."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import json
import re
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.surfaces.inbox import HookEvent, Inbox, Verdict, parse_hook_line, replay_spool, serve_hooks
from tests.unit.hook_scaffold import (
    HOOK,
    Place,
    run_hook,
    XML,
)
from tests.waiting import until

BUDGET = 0.3
# Generous: this bounds correctness (the hook must not hang), it is not a benchmark.
MARGIN = 2.0
log = logging.getLogger("test.hook")


@pytest.fixture
def place() -> Iterator[Place]:
    # Not tmp_path: a Unix socket path must stay under about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="hk-") as d:
        yield Place(Path(d) / "hook.sock", Path(d) / "spool")


class Recorder:
    def __init__(self, verdict: Verdict, delay: float = 0.0) -> None:
        self.verdict = verdict
        self.delay = delay
        self.events: list[HookEvent] = []
        self.answered = 0  # calls that ended, answered or cancelled

    async def __call__(self, event: HookEvent) -> Verdict:
        self.events.append(event)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            return self.verdict
        finally:
            self.answered += 1


@pytest.fixture
async def agent(place: Place) -> AsyncIterator[Recorder]:
    recorder = Recorder(Verdict("proceed"))
    server = await serve_hooks(place.socket, recorder, log=log)
    yield recorder
    server.close()
    await server.wait_closed()


async def test_proceed_sends_the_event_and_exits_0(place: Place, agent: Recorder) -> None:
    run = await run_hook(place, "gaming1", "prepare", "begin", "-")
    assert (run.rc, run.stderr) == (0, "")
    [event] = agent.events
    assert (event.domain, event.op, event.sub, event.extra, event.xml) == (
        "gaming1",
        "prepare",
        "begin",
        "-",
        XML,
    )
    assert len(event.id) == 32 and int(event.id, 16) >= 0
    assert abs(event.time - time.time()) < 60
    assert place.spooled() == []


async def test_defer_of_prepare_begin_exits_1_with_the_message(
    place: Place, agent: Recorder
) -> None:
    agent.verdict = Verdict("defer", "GPU 0000:01:00.0 is being reclaimed; gaming1 starts soon.")
    run = await run_hook(place, "gaming1", "prepare", "begin", "-")
    assert run.rc == 1
    assert run.stderr == "GPU 0000:01:00.0 is being reclaimed; gaming1 starts soon.\n"
    assert place.spooled() == []


async def test_defer_message_is_one_line(place: Place, agent: Recorder) -> None:
    agent.verdict = Verdict("defer", "two\nlines")
    run = await run_hook(place, "gaming1", "prepare", "begin", "-")
    assert (run.rc, run.stderr) == (1, "two lines\n")


@pytest.mark.parametrize(
    "op",
    [
        ("start", "begin"),
        ("started", "begin"),
        ("migrate", "begin"),
        ("restore", "begin"),
        ("release", "end"),
        ("prepare", "end"),
    ],
)
async def test_defer_of_any_other_operation_exits_0(
    place: Place, agent: Recorder, op: tuple[str, str]
) -> None:
    agent.verdict = Verdict("defer", "no")
    run = await run_hook(place, "gaming1", *op, "-")
    assert (run.rc, run.stderr) == (0, "")
    assert [(e.op, e.sub) for e in agent.events] == [op]


async def test_agent_absent_spools_the_exact_event_for_replay(place: Place) -> None:
    run = await run_hook(place, "gaming1", "prepare", "begin", "-")
    assert run.rc == 0  # fail-open
    assert run.stderr.startswith("hostagent hook: agent did not take the event")
    [file] = place.spooled()
    assert [p.name for p in place.spool.iterdir()] == [file.name]  # no temp file left
    assert oct(place.spool.stat().st_mode & 0o777) == "0o700"
    raw = file.read_bytes()
    assert raw.endswith(b"}\n") and raw.count(b"\n") == 1
    spooled = parse_hook_line(raw)
    assert (spooled.domain, spooled.op, spooled.sub, spooled.extra, spooled.xml) == (
        "gaming1",
        "prepare",
        "begin",
        "-",
        XML,
    )
    stem_time, stem_id = file.stem.split("-")
    assert len(stem_time) == 20 and stem_id == spooled.id
    assert int(stem_time) / 1e9 == spooled.time  # named by event time

    recorder = Recorder(Verdict("proceed"))
    assert await replay_spool(place.spool, recorder, log=log) == 1
    assert recorder.events == [dataclasses.replace(spooled, spooled=True)]
    assert place.spooled() == []
    assert await replay_spool(place.spool, recorder, log=log) == 0
    assert recorder.events == [dataclasses.replace(spooled, spooled=True)]


async def test_agent_refusing_connections_spools(place: Place) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(place.socket))  # bound, never listening: ECONNREFUSED
        run = await run_hook(place, "gaming1", "release", "end", "-")
    assert run.rc == 0
    assert "ConnectionRefusedError" in run.stderr
    assert len(place.spooled()) == 1


async def fake_agent(place: Place, answer: bytes | None) -> tuple[asyncio.Server, asyncio.Event]:
    """An agent that reads the event and answers `answer`, or never answers if None."""
    release = asyncio.Event()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if answer is None:
            await release.wait()
        else:
            event_id = json.loads(line)["id"]
            writer.write(answer.replace(b"ID", event_id.encode()))
            await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(connection, path=str(place.socket))
    return server, release


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (None, "TimeoutError"),
        (b"", "without answering"),
        (b"garbage\n", ""),
        (b"[1, 2]\n", "not a JSON object"),
        (b'{"v":1,"id":"someone-else","verdict":"proceed","message":""}\n', "not for this event"),
        (b'{"v":2,"id":"ID","verdict":"proceed","message":""}\n', "not for this event"),
        (b'{"v":1,"id":"ID","verdict":"error","message":"handler broke"}\n', "handler broke"),
        (b'{"v":1,"id":"ID","verdict":"maybe","message":""}\n', "maybe"),
        (b'{"v":1,"id":"ID","verdict":"proceed"', "without answering"),
    ],
    ids=["hung", "closes", "garbage", "array", "wrong-id", "wrong-version", "error", "odd", "cut"],
)
async def test_unhelpful_agent_means_spool_and_proceed(
    place: Place, answer: bytes | None, why: str
) -> None:
    server, release = await fake_agent(place, answer)
    try:
        run = await run_hook(place, "gaming1", "prepare", "begin", "-")
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert run.rc == 0
    assert run.elapsed < BUDGET + MARGIN
    assert run.stderr.startswith("hostagent hook: agent did not take the event")
    assert why in run.stderr
    [file] = place.spooled()
    assert parse_hook_line(file.read_bytes()).op == "prepare"


async def test_budget_is_configurable(place: Place) -> None:
    server, release = await fake_agent(place, None)
    try:
        run = await run_hook(place, "gaming1", "prepare", "begin", "-", budget=1.2)
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert run.rc == 0
    # Three quarters of the budget go to waiting for the agent, the rest to the spool.
    assert 0.9 <= run.elapsed < 1.2 + MARGIN
    assert len(place.spooled()) == 1


async def test_bad_budget_falls_back_to_the_default(place: Place, agent: Recorder) -> None:
    run = await run_hook(place, "gaming1", "start", "begin", "-", budget="soon")
    assert run.rc == 0
    assert run.stderr.startswith("hostagent hook: HOSTAGENT_HOOK_BUDGET is not a positive number")
    assert len(agent.events) == 1


async def test_unwritable_spool_still_exits_0_and_says_why(place: Place, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = await run_hook(place, "gaming1", "started", "begin", "-", spool=blocker / "spool")
    assert run.rc == 0
    assert run.elapsed < BUDGET + MARGIN
    [line] = run.stderr.splitlines()
    assert line.startswith("hostagent hook: ")
    assert "unwritable" in line and "event lost" in line


async def test_stuck_stdin_is_cut_by_the_watchdog(place: Place, agent: Recorder) -> None:
    # libvirt always closes stdin, but a hung writer must not hang the hook either.
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        str(HOOK),
        "gaming1",
        "started",
        "begin",
        "-",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"HOSTAGENT_SOCKET": str(place.socket), "HOSTAGENT_SPOOL": str(place.spool)},
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b"<domain>")  # and never closed
    rc = await asyncio.wait_for(proc.wait(), BUDGET + MARGIN)
    elapsed = time.monotonic() - start
    out, err = await proc.stdout.read(), await proc.stderr.read()
    proc.stdin.close()
    assert (rc, out) == (0, b"")
    assert elapsed < BUDGET + MARGIN
    assert re.search(r"gave up after the 0\.[23]\d* s budget", err.decode()), err
    # The event still reaches the agent, without the XML it could not read.
    [file] = place.spooled()
    event = parse_hook_line(file.read_bytes())
    assert (event.domain, event.op, event.xml) == ("gaming1", "started", "")


async def test_oversized_xml_is_sent_without_it(place: Place, agent: Recorder) -> None:
    run = await run_hook(place, "gaming1", "prepare", "begin", "-", xml="x" * (8 * 1024 * 1024 + 1))
    assert run.rc == 0
    assert "sent without it" in run.stderr
    [event] = agent.events
    assert event.xml == ""


async def test_odd_bytes_in_arguments_and_xml_arrive_as_text(place: Place, agent: Recorder) -> None:
    name = os.fsdecode(b"vm-\xff")
    run = await run_hook(place, name, "prepare", "begin", "-", xml='<a b="\\"/>\t\x01')
    assert (run.rc, run.stderr) == (0, "")
    [event] = agent.events
    assert event.domain == "vm-\ufffd"
    assert event.xml == '<a b="\\"/>\t\x01'


async def test_missing_arguments_are_dashes(place: Place, agent: Recorder) -> None:
    run = await run_hook(place, "gaming1")
    assert run.rc == 0
    [event] = agent.events
    assert (event.op, event.sub, event.extra) == ("-", "-", "-")


async def test_a_hook_frozen_past_its_budget_still_spools_its_event(place: Place) -> None:
    # What CPU starvation does to a hook that waits for its answer (`prepare begin`, the
    # one that does): its threads get no time until the budget has long run out.
    # Whichever thread runs first then, the event must end up in the spool, once.
    connected = asyncio.Event()
    release = asyncio.Event()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        connected.set()
        await release.wait()
        writer.close()

    server = await asyncio.start_unix_server(connection, path=str(place.socket))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", str(HOOK), "vm1", "prepare", "begin", "-",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"HOSTAGENT_SOCKET": str(place.socket), "HOSTAGENT_SPOOL": str(place.spool)},
    )  # fmt: skip
    try:
        assert proc.stdin is not None
        proc.stdin.write(XML.encode())
        proc.stdin.close()
        await asyncio.wait_for(connected.wait(), 30)  # the hook is waiting for the answer
        proc.send_signal(signal.SIGSTOP)
        await asyncio.sleep(3 * BUDGET)
        proc.send_signal(signal.SIGCONT)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert (proc.returncode, out) == (0, b"")
    assert "event spooled to" in err.decode(), err
    [file] = place.spooled()
    event = parse_hook_line(file.read_bytes())
    assert (event.domain, event.op, event.xml) == ("vm1", "prepare", XML)
    assert not [f for f in place.spool.iterdir() if f.name.startswith(".tmp-")]


async def test_many_concurrent_hooks_are_all_answered(place: Place, agent: Recorder) -> None:
    # A loaded test machine starts 50 interpreters slowly; the budget is not under test.
    runs = await asyncio.gather(
        *(run_hook(place, f"vm{i}", "prepare", "begin", "-", budget=30) for i in range(50))
    )
    assert [r.rc for r in runs] == [0] * 50
    assert sorted(e.domain for e in agent.events) == sorted(f"vm{i}" for i in range(50))
    assert len({e.id for e in agent.events}) == 50
    assert place.spooled() == []


async def test_late_answer_is_spooled_but_not_handled_twice(place: Place) -> None:
    # The agent handles the event, but too slowly for the hook, which spools it too.
    recorder = Recorder(Verdict("proceed"), delay=0.6)
    inbox = Inbox(recorder)
    server = await serve_hooks(place.socket, inbox, log=log)
    try:
        run = await run_hook(place, "gaming1", "prepare", "begin", "-")
        await until(lambda: recorder.answered == 1, "the slow handler to finish")
    finally:
        server.close()
        await server.wait_closed()
    assert run.rc == 0 and "TimeoutError" in run.stderr
    assert len(place.spooled()) == 1
    assert await replay_spool(place.spool, inbox, log=log) == 1
    assert len(recorder.events) == 1
    assert place.spooled() == []


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no /usr/bin/python3")
async def test_runs_through_its_shebang(place: Place, agent: Recorder) -> None:
    assert HOOK.read_text().startswith("#!/usr/bin/python3 -IS\n")
    assert os.access(HOOK, os.X_OK)
    run = await run_hook(place, "gaming1", "prepare", "begin", "-", argv0=[str(HOOK)])
    assert (run.rc, run.stderr) == (0, "")
    assert len(agent.events) == 1


def test_hook_uses_only_the_standard_library_and_no_subprocess() -> None:
    tree = ast.parse(HOOK.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.module is not None
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert "subprocess" not in imported and "multiprocessing" not in imported
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    forbidden = {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"}
    forbidden |= {name for name in called if name.startswith(("exec", "spawn"))}
    assert not called & forbidden, called & forbidden
    assert "print" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


async def test_a_settled_defer_stays_a_defer_when_stderr_blocks(place: Place) -> None:
    # libvirt reads the hook's stderr; a pipe nobody drains blocked the defer message,
    # the watchdog then fired after main had settled and exited 0: the start went on.
    server = await serve_hooks(place.socket, Recorder(Verdict("defer", "wait for it")),
                               log=log)
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        try:
            while True:
                os.write(write_end, b"x" * 65536)
        except BlockingIOError:
            pass  # full
        os.set_blocking(write_end, True)
        env = {"HOSTAGENT_SOCKET": str(place.socket), "HOSTAGENT_SPOOL": str(place.spool)}
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(HOOK), "gaming1", "prepare", "begin", "-",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=write_end, env=env)
        os.close(write_end)
        write_end = -1
        try:
            rc = await asyncio.wait_for(proc.wait(), BUDGET + MARGIN)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError("the hook hung on its stderr") from None
        assert rc == 1
        assert time.monotonic() - start < BUDGET + MARGIN
    finally:
        if write_end >= 0:
            os.close(write_end)
        os.close(read_end)
        server.close()
        await server.wait_closed()


def load_hook() -> object:
    """hooks/qemu as a module, to drive its threads one by one."""
    import importlib.machinery
    import importlib.util
    loader = importlib.machinery.SourceFileLoader("hostagent_hook_under_test", str(HOOK))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Exits:
    """Stands in for the hook's `os`: `_exit` records the status and parks the thread
    (until `release`) instead of ending the process."""

    def __init__(self) -> None:
        import threading
        self.codes: list[int] = []
        self.done = threading.Event()
        self.released = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def _exit(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()
        self.released.wait(30)

    def release(self) -> None:
        self.released.set()


def run(target: Any, *args: Any) -> None:
    import threading
    threading.Thread(target=target, args=args, daemon=True).start()


def test_the_watchdog_s_own_spool_write_is_bounded(place: Place) -> None:
    # A disk that hangs held the watchdog's spool write, and the hook with it, forever.
    import threading
    hook: Any = load_hook()
    exits = Exits()
    stuck = threading.Event()
    hook.os = exits
    hook.spool = lambda *args, **kwargs: stuck.wait(30)
    hook.note = lambda text: None
    try:
        assert hook.unsettled((str(place.spool), "0001-x", b"{}\n"))
        run(hook.watchdog, 0.0)
        assert exits.done.wait(2 + MARGIN), "the watchdog hung on a stuck spool write"
        assert exits.codes[0] == 0
    finally:
        exits.release()
        stuck.set()


def test_the_watchdog_keeps_the_exit_status_main_settled_on() -> None:
    hook: Any = load_hook()
    exits = Exits()
    hook.os = exits
    hook.note = lambda text: None
    assert hook.unsettled(("/nonexistent", "0001-x", b"{}\n"))
    assert hook.settle(1)  # main: the agent deferred; it is late to exit
    try:
        run(hook.watchdog, 0.0)
        assert exits.done.wait(2 + MARGIN)
        assert exits.codes == [1]
        assert not hook.settle(0)  # the watchdog has taken over
    finally:
        exits.release()


async def test_an_informing_hook_hands_its_line_over_without_waiting(place: Place) -> None:
    """Only `prepare begin` needs the agent's answer. An operation that only informs
    writes its line into the agent's socket and exits: it neither waits on an agent
    that is slow to answer nor spools an event the agent already has."""
    received: list[bytes] = []
    release = asyncio.Event()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readline())
        await release.wait()  # answers nothing while the hook runs
        writer.close()

    server = await asyncio.start_unix_server(connection, path=str(place.socket))
    try:
        run = await run_hook(place, "gaming1", "release", "end", "-")
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert (run.rc, run.stderr) == (0, "")
    assert place.spooled() == []
    [line] = received
    event = parse_hook_line(line)
    assert (event.domain, event.op, event.sub) == ("gaming1", "release", "end")


@pytest.mark.parametrize("agent_there", [True, False], ids=["agent up", "agent absent"])
async def test_reconnect_begin_sends_nothing_and_exits_0(
        place: Place, agent_there: bool) -> None:
    """libvirtd restarting runs every running domain's `reconnect begin` at once; the
    agent learns the same from its own reconnection to libvirtd (it reads every running
    domain then). The hook takes its XML and exits 0: nothing sent, nothing spooled, so
    hundreds of them on two CPUs wait on nothing."""
    recorder = Recorder(Verdict("defer", "no"))
    server = await serve_hooks(place.socket, recorder, log=log) if agent_there else None
    try:
        run = await run_hook(place, "gaming1", "reconnect", "begin", "-")
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
    assert (run.rc, run.stderr) == (0, "")
    assert recorder.events == [] and place.spooled() == []
