"""The agent's side of the hook socket: parsing, answers, dedupe and spool replay."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.surfaces.inbox import (
    MAX_LINE,
    PROTOCOL_VERSION,
    HookEvent,
    Inbox,
    ProtocolError,
    Verdict,
    parse_hook_line,
    replay_spool,
    serve_hooks,
)

LOGGER = "test.inbox"
log = logging.getLogger(LOGGER)


def event_dict(**changes: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "v": 1,
        "kind": "hook",
        "id": "0123456789abcdef0123456789abcdef",
        "time": 1700000000.25,
        "domain": "gaming1",
        "op": "prepare",
        "sub": "begin",
        "extra": "-",
        "xml": "<domain/>",
    }
    event.update(changes)
    return {k: v for k, v in event.items() if v is not ...}


def line(**changes: Any) -> bytes:
    return json.dumps(event_dict(**changes)).encode() + b"\n"


PROCEED = Verdict("proceed")


class Recorder:
    def __init__(self, verdict: Verdict = PROCEED, delay: float = 0.0) -> None:
        self.verdict = verdict
        self.delay = delay
        self.events: list[HookEvent] = []
        self.fail: Exception | None = None

    async def __call__(self, event: HookEvent) -> Verdict:
        self.events.append(event)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return self.verdict


@pytest.fixture
def sock() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ib-") as d:
        yield Path(d) / "hook.sock"


@pytest.fixture
async def served(sock: Path) -> AsyncIterator[Recorder]:
    recorder = Recorder()
    server = await serve_hooks(sock, recorder, log=log)
    yield recorder
    server.close()
    await server.wait_closed()


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def ask(self, data: bytes) -> dict[str, Any]:
        self.writer.write(data)
        await self.writer.drain()
        answer = await asyncio.wait_for(self.reader.readline(), 5)
        assert answer.endswith(b"\n")
        result: dict[str, Any] = json.loads(answer)
        return result

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def connect(sock: Path) -> Client:
    return Client(*await asyncio.open_unix_connection(str(sock)))


# --- parse_hook_line ---------------------------------------------------------------


def test_parse_valid_line() -> None:
    event = parse_hook_line(line())
    assert event == HookEvent(
        id="0123456789abcdef0123456789abcdef",
        time=1700000000.25,
        domain="gaming1",
        op="prepare",
        sub="begin",
        extra="-",
        xml="<domain/>",
    )
    assert PROTOCOL_VERSION == 1


def test_parse_accepts_integer_time_and_unknown_fields() -> None:
    event = parse_hook_line(line(time=1700000000, future="ignored"))
    assert event.time == 1700000000.0 and isinstance(event.time, float)


BAD_LINES: list[tuple[bytes, str]] = [
    (b"hello\n", "bad JSON at line 1 column 1 (char 0): Expecting value"),
    (line()[:40], "bad JSON at line 1 column "),
    (b"[1, 2]\n", "expected a JSON object, got array"),
    (b'"text"\n', "expected a JSON object, got string"),
    (b"\n", "bad JSON at line 1 column 1 (char 0)"),
    (line(domain=...), "missing field 'domain'"),
    (line(v=...), "missing field 'v'"),
    (line(time="now"), "field 'time' has type string, expected number"),
    (line(xml=None), "field 'xml' has type null, expected string"),
    (line(v=True), "field 'v' has type boolean, expected integer"),
    (line(v="1"), "field 'v' has type string, expected integer"),
    (line(op=["prepare"]), "field 'op' has type array, expected string"),
    (line(v=2), "unsupported protocol version 2 (this agent speaks 1)"),
    (line(kind="control"), "field 'kind' is 'control', expected 'hook'"),
    (line(id=""), "field 'id' is empty"),
    (line().replace(b"1700000000.25", b"NaN"), "NaN is not a number"),
    (line().replace(b"1700000000.25", b"1e999"), "field 'time' is inf, expected a finite number"),
    (b'{"v": 1, "x": "\xff"}\n', "not UTF-8: bad byte at position 15"),
    (b"[" * 100_000, "nested too deeply"),
    (b"1" * 5000, "bad JSON: Exceeds the limit"),
]


@pytest.mark.parametrize(("data", "message"), BAD_LINES)
def test_parse_bad_line_says_what_is_wrong(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_hook_line(data)
    assert message in str(caught.value)


def test_parse_too_long_line() -> None:
    data = line(xml="x" * MAX_LINE)
    with pytest.raises(ProtocolError, match=rf"line too long \({len(data) - 1} bytes, limit "):
        parse_hook_line(data)


# Timing checks off: this is about what is raised, and test machines are often busy.
robust = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@robust
@given(st.binary(max_size=2000))
def test_parse_arbitrary_bytes_raises_only_protocol_error(data: bytes) -> None:
    try:
        parse_hook_line(data)
    except ProtocolError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10,
)


@robust
@given(st.dictionaries(st.sampled_from(sorted(event_dict())), json_values))
def test_parse_arbitrary_objects_raises_only_protocol_error(obj: dict[str, Any]) -> None:
    merged = event_dict() | obj
    try:
        event = parse_hook_line(json.dumps(merged).encode())
    except ProtocolError:
        return
    assert event.id == merged["id"] and event.xml == merged["xml"]


# --- serve_hooks -------------------------------------------------------------------


async def test_valid_line_gets_the_verdict(sock: Path, served: Recorder) -> None:
    served.verdict = Verdict("defer", "GPU busy; starting soon.")
    client = await connect(sock)
    answer = await client.ask(line())
    await client.close()
    assert answer == {
        "v": 1,
        "id": "0123456789abcdef0123456789abcdef",
        "verdict": "defer",
        "message": "GPU busy; starting soon.",
    }
    assert served.events == [parse_hook_line(line())]


async def test_socket_mode_and_stale_socket(sock: Path) -> None:
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(sock))  # what a killed agent leaves behind
    server = await serve_hooks(sock, Recorder(), mode=0o660, log=log)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        client = await connect(sock)
        assert (await client.ask(line()))["verdict"] == "proceed"
        await client.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_refuses_to_replace_a_file_that_is_not_a_socket(sock: Path) -> None:
    sock.write_text("precious")
    with pytest.raises(FileExistsError, match="is not a socket"):
        await serve_hooks(sock, Recorder(), log=log)
    assert sock.read_text() == "precious"


@pytest.mark.parametrize(("data", "message"), [b for b in BAD_LINES if b[0].endswith(b"\n")])
async def test_bad_line_is_logged_answered_and_the_server_goes_on(
    sock: Path, served: Recorder, caplog: pytest.LogCaptureFixture, data: bytes, message: str
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    client = await connect(sock)
    answer = await client.ask(data)
    assert answer["v"] == 1 and answer["id"] is None and answer["verdict"] == "error"
    assert message in answer["message"]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert message in record.getMessage()
    assert repr(data[:20])[2:-1] in record.getMessage()  # an excerpt of the line
    # Same connection, then a new one: both still served.
    assert (await client.ask(line()))["verdict"] == "proceed"
    await client.close()
    other = await connect(sock)
    assert (await other.ask(line(id="another")))["verdict"] == "proceed"
    await other.close()
    assert len(served.events) == 2


async def test_too_long_line_closes_only_that_connection(
    sock: Path, served: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    client = await connect(sock)
    client.writer.write(b"x" * (MAX_LINE + 10) + b"\n")
    answer = json.loads(await asyncio.wait_for(client.reader.readline(), 5))
    assert answer["verdict"] == "error" and answer["id"] is None
    assert f"line too long (over {MAX_LINE} bytes, limit {MAX_LINE})" == answer["message"]
    assert await asyncio.wait_for(client.reader.read(), 5) == b""  # closed by the agent
    client.writer.close()
    assert any("line too long" in r.getMessage() for r in caplog.records)
    other = await connect(sock)
    assert (await other.ask(line()))["verdict"] == "proceed"
    await other.close()


async def test_line_at_the_limit_is_accepted(sock: Path, served: Recorder) -> None:
    base = len(line(xml=""))
    data = line(xml="x" * (MAX_LINE - base + 1))
    assert len(data) == MAX_LINE + 1  # the newline is not counted
    client = await connect(sock)
    assert (await client.ask(data))["verdict"] == "proceed"
    await client.close()


async def test_handler_exception_is_logged_answered_and_not_remembered(
    sock: Path, served: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    served.fail = RuntimeError("state file is read-only")
    client = await connect(sock)
    answer = await client.ask(line())
    assert answer["verdict"] == "error"
    assert answer["id"] == "0123456789abcdef0123456789abcdef"
    assert "state file is read-only" in answer["message"]
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "0123456789abcdef0123456789abcdef" in record.getMessage()
    assert record.exc_info is not None
    served.fail = None
    assert (await client.ask(line()))["verdict"] == "proceed"  # retried, not cached
    await client.close()
    assert len(served.events) == 2


async def test_many_concurrent_connections(sock: Path, served: Recorder) -> None:
    served.delay = 0.05  # all 50 are in the handler at once

    async def one(i: int) -> dict[str, Any]:
        client = await connect(sock)
        try:
            return await client.ask(line(id=f"id{i}"))
        finally:
            await client.close()

    answers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(50))), 5)
    assert sorted(a["id"] for a in answers) == sorted(f"id{i}" for i in range(50))
    assert {a["verdict"] for a in answers} == {"proceed"}


async def test_repeated_id_gets_the_same_verdict_without_handling_again(
    sock: Path, served: Recorder
) -> None:
    served.verdict = Verdict("defer", "first")
    client = await connect(sock)
    first = await client.ask(line())
    served.verdict = Verdict("proceed", "second")
    again = await client.ask(line(op="release"))  # same id: the same event
    await client.close()
    assert first == again and first["message"] == "first"
    assert len(served.events) == 1


async def test_concurrent_duplicates_are_handled_once() -> None:
    recorder = Recorder(delay=0.05)
    inbox = Inbox(recorder)
    event = parse_hook_line(line())
    verdicts = await asyncio.gather(*(inbox(event) for _ in range(5)))
    assert verdicts == [Verdict("proceed")] * 5
    assert len(recorder.events) == 1


async def test_dedupe_memory_is_bounded() -> None:
    recorder = Recorder()
    inbox = Inbox(recorder, remember=2)
    for event_id in ["a", "b", "c", "a", "c"]:
        await inbox(parse_hook_line(line(id=event_id)))
    assert [e.id for e in recorder.events] == ["a", "b", "c", "a"]


# --- replay_spool ------------------------------------------------------------------


def spool_file(spool: Path, when: int, event_id: str, data: bytes | None = None) -> Path:
    spool.mkdir(exist_ok=True)
    file = spool / f"{when:020d}-{event_id}.json"
    file.write_bytes(line(id=event_id) if data is None else data)
    return file


async def test_replay_in_order_each_once(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool_file(spool, 3, "c")
    spool_file(spool, 1, "a")
    spool_file(spool, 20, "d")
    spool_file(spool, 2, "b")
    (spool / ".tmp-e").write_bytes(line(id="e")[:10])  # a hook still writing
    recorder = Recorder()
    assert await replay_spool(spool, recorder, log=log) == 4
    assert [e.id for e in recorder.events] == ["a", "b", "c", "d"]
    assert sorted(p.name for p in spool.iterdir()) == [".tmp-e"]
    assert await replay_spool(spool, recorder, log=log) == 0
    assert len(recorder.events) == 4


async def test_replay_moves_garbage_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = tmp_path / "spool"
    spool_file(spool, 1, "a")
    bad = spool_file(spool, 2, "b", b'{"v": 7}\n')
    spool_file(spool, 3, "c")
    recorder = Recorder()
    assert await replay_spool(spool, recorder, log=log) == 2
    assert [e.id for e in recorder.events] == ["a", "c"]
    assert (spool / "bad" / bad.name).read_bytes() == b'{"v": 7}\n'
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bad.name in record.getMessage()
    assert "unsupported protocol version 7" in record.getMessage()


async def test_replay_keeps_the_file_when_the_handler_fails(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    first = spool_file(spool, 1, "a")
    second = spool_file(spool, 2, "b")
    recorder = Recorder()
    recorder.fail = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        await replay_spool(spool, recorder, log=log)
    assert first.exists() and second.exists()
    recorder.fail = None
    assert await replay_spool(spool, recorder, log=log) == 2
    assert [e.id for e in recorder.events] == ["a", "a", "b"]


async def test_replay_shares_dedupe_with_the_socket(sock: Path, tmp_path: Path) -> None:
    recorder = Recorder()
    inbox = Inbox(recorder)
    server = await serve_hooks(sock, inbox, log=log)
    try:
        client = await connect(sock)
        await client.ask(line(id="seen-live"))
        await client.close()
    finally:
        server.close()
        await server.wait_closed()
    spool = tmp_path / "spool"
    spool_file(spool, 1, "seen-live")
    spool_file(spool, 2, "only-spooled")
    assert await replay_spool(spool, inbox, log=log) == 2
    assert [e.id for e in recorder.events] == ["seen-live", "only-spooled"]
    assert list(spool.iterdir()) == []


async def test_replay_of_a_missing_spool_is_nothing(tmp_path: Path) -> None:
    assert await replay_spool(tmp_path / "absent", Recorder(), log=log) == 0


async def test_replay_moves_a_time_that_overflows_a_float_aside(tmp_path: Path) -> None:
    # An integer too large for a float made math.isfinite raise OverflowError, which
    # escaped replay_spool: the agent crash-looped on the same file at every start.
    spool = tmp_path / "spool"
    spool_file(spool, 1, "a")
    poison = spool_file(spool, 2, "b", line(id="b", time=10**400))
    spool_file(spool, 3, "c")
    recorder = Recorder()
    assert await replay_spool(spool, recorder, log=log) == 2
    assert [e.id for e in recorder.events] == ["a", "c"]
    assert (spool / "bad" / poison.name).exists()
    with pytest.raises(ProtocolError, match="time"):
        parse_hook_line(line(time=10**400))


async def test_replay_moves_an_unreadable_file_aside_and_goes_on(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool_file(spool, 1, "a")
    (spool / f"{2:020d}-dir.json").mkdir()  # not a regular file: skipped, left alone
    spool_file(spool, 3, "b", b"\xff" * 100)
    spool_file(spool, 4, "c", b"")
    spool_file(spool, 5, "d")
    recorder = Recorder()
    assert await replay_spool(spool, recorder, log=log) == 2
    assert [e.id for e in recorder.events] == ["a", "d"]
    assert len(list((spool / "bad").iterdir())) == 2


async def test_replayed_events_say_they_were_spooled(tmp_path: Path, sock: Path) -> None:
    # The agent decides live-or-stale by where an event came from, not by the clock.
    spool = tmp_path / "spool"
    spool_file(spool, 1, "from-spool")
    recorder = Recorder()
    inbox = Inbox(recorder)
    assert await replay_spool(spool, inbox, log=log) == 1
    server = await serve_hooks(sock, inbox, log=log)
    try:
        client = await connect(sock)
        await client.ask(line(id="live"))
        await client.close()
    finally:
        server.close()
        await server.wait_closed()
    assert [(e.id, e.spooled) for e in recorder.events] == [("from-spool", True),
                                                            ("live", False)]


async def test_replay_removes_temporary_files_left_by_a_killed_hook(tmp_path: Path) -> None:
    import os
    import time as _time
    spool = tmp_path / "spool"
    spool_file(spool, 1, "a")
    old = spool / ".tmp-00000000000000000001-dead"
    old.write_bytes(b'{"v":1,"ki')
    watchdog = spool / ".tmp-00000000000000000002-dead-watchdog"
    watchdog.write_bytes(b"")
    stamp = _time.time() - 3600
    os.utime(old, (stamp, stamp))
    os.utime(watchdog, (stamp, stamp))
    fresh = spool / ".tmp-00000000000000000003-writing"  # a hook writing it now
    fresh.write_bytes(b"{")
    assert await replay_spool(spool, Recorder(), log=log) == 1
    assert sorted(p.name for p in spool.iterdir()) == [fresh.name]
