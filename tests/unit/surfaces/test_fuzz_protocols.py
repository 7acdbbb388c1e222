"""Bad input, fuzzed: the hook and control protocols, parsed and served live.

Each property runs 10,000 generated inputs, derandomized (tests/conftest.py's
profile) so that CI sees the same ones every time. The live servers run once per module on an event loop in a thread,
and each example is one round trip over a real Unix socket, so that what is checked
is what a client sees: no crash, no exception escaping the server, and every bad
message answered with an error (and logged).
"""

from __future__ import annotations

import os
import asyncio
import json
import logging
import random
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.surfaces.control import parse_request, serve_control
from hostagent.surfaces.inbox import (
    HookEvent,
    ProtocolError,
    Verdict,
    parse_hook_line,
    replay_spool,
    serve_hooks,
)
from tests.unit.fuzz_scaffold import (
    _text,
    _value,
)

# Derandomized (tests/conftest.py): the same examples on every run, so a CI run need
# not repeat many. A deeper search: `make fuzz`; a randomized one: `make explore`.
EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "3_000"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- generated input -------------------------------------------------------------------
#
# Hypothesis draws a seed and a few choices; a seeded `random.Random` builds the message.
# Drawing every byte through Hypothesis would cost a millisecond per example, and these
# tests run 40,000 of them.


def _dumps(value: Any) -> bytes:
    # allow_nan: NaN and Infinity are what a sloppy client sends, and JSON has neither.
    return json.dumps(value, allow_nan=True, ensure_ascii=False,
                      default=str).encode("utf-8", "surrogatepass")


def _mutate(rng: random.Random, valid: dict[str, Any]) -> bytes:
    """A valid message with fields dropped, retyped or added, then perhaps damaged."""
    obj = dict(valid)
    for _ in range(rng.randrange(4)):
        key = rng.choice(sorted(valid)) if rng.random() < 0.8 else _text(rng)
        if rng.random() < 0.3:
            obj.pop(key, None)
        else:
            obj[key] = _value(rng)
    data = _dumps(obj)
    match rng.choice(["keep", "keep", "cut", "insert", "flip"]):
        case "cut":
            data = data[:rng.randrange(len(data) + 1)]
        case "insert":
            at = rng.randrange(len(data) + 1)
            data = data[:at] + rng.randbytes(rng.randrange(1, 5)) + data[at:]
        case "flip":
            at = rng.randrange(len(data))
            data = data[:at] + bytes([data[at] ^ rng.randrange(1, 256)]) + data[at + 1:]
    return data


def _junk(rng: random.Random) -> bytes:
    match rng.randrange(5):
        case 0:
            return rng.randbytes(rng.randrange(120))
        case 1:
            return _dumps(_value(rng))
        case 2:
            n = rng.randrange(1, 3000)
            return b"[" * n + b"]" * n * rng.randrange(2)
        case 3:
            return _text(rng).encode("utf-8", "surrogatepass")
        case _:
            return rng.choice([b"", b"{}", b"null", b"NaN", b"-Infinity", b"1" * 5000,
                               b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'"\\ud800"'])


def one_line(messages: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """The protocols are line-based: a newline inside would make two messages."""
    return messages.map(lambda b: b.replace(b"\n", b" "))


def mutated(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return one_line(st.integers(0, 2**32).map(lambda seed: _mutate(random.Random(seed), valid)))


def messages(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """One line, without its newline: junk, any JSON, deep nesting, or (mostly) a near miss."""
    junk = st.integers(0, 2**32).map(lambda seed: _junk(random.Random(seed)))
    return one_line(st.binary(max_size=120) | junk) | mutated(valid) | mutated(valid)


# --- a server on a loop of its own ---------------------------------------------------


class Records(logging.Handler):
    """What the server logged, readable from the test's thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.mutex = threading.Lock()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self.mutex:
            self.records.append(record)

    def take(self) -> list[logging.LogRecord]:
        with self.mutex:
            taken, self.records = self.records, []
        return taken


class Live:
    """A server started by `start` on an event loop that runs in a thread."""

    def __init__(self, start: Callable[[], Coroutine[Any, Any, asyncio.Server]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-server")
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()
            await self.server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def tmp() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fz-") as d:  # short: a socket path < 108 B
        yield Path(d)


def _logger(name: str) -> tuple[logging.Logger, Records]:
    log = logging.getLogger(name)
    log.propagate = False  # 10,000 warnings are for the check, not for the report
    records = Records()
    log.addHandler(records)
    return log, records


# --- the hook protocol -----------------------------------------------------------------

VALID_EVENT = {"v": 1, "kind": "hook", "id": "0123456789abcdef", "time": 1700000000.25,
               "domain": "gaming1", "op": "prepare", "sub": "begin", "extra": "-",
               "xml": "<domain/>"}


@fuzz
@given(messages(VALID_EVENT))
def test_parse_hook_line_raises_only_protocol_error(data: bytes) -> None:
    try:
        event = parse_hook_line(data)
    except ProtocolError as e:
        assert str(e)
    else:
        assert isinstance(event, HookEvent) and event.id


SPOOL_EXAMPLES = 500


@settings(max_examples=SPOOL_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(st.lists(messages(VALID_EVENT), min_size=1, max_size=4))
def test_spool_replay_sets_garbage_aside_and_goes_on(tmp: Path, files: list[bytes]) -> None:
    # Whatever lies in the spool, replay ends: each file handled once or moved to bad/.
    spool = tmp / "spool-fuzz"
    if spool.exists():
        for f in [*spool.glob("bad/*"), *spool.glob("*")]:
            if f.is_file():
                f.unlink()
    spool.mkdir(exist_ok=True)
    for i, data in enumerate(files):
        (spool / f"{i:020d}-f{i}.json").write_bytes(data)
    handled: list[HookEvent] = []

    async def handler(event: HookEvent) -> Verdict:
        handled.append(event)
        return Verdict("proceed")

    log, records = _logger("fuzz.spool")
    count = asyncio.run(replay_spool(spool, handler, log=log))
    bad = list((spool / "bad").glob("*.json")) if (spool / "bad").exists() else []
    assert count + len(bad) == len(files)
    assert len(handled) == len({e.id for e in handled}) <= count  # one id, handled once
    assert all(e.spooled for e in handled)
    assert not list(spool.glob("*.json"))
    assert len(records.take()) == len(bad)


class HookClient:
    """One connection, reused across examples; reopened when the server drops it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.file: Any = None

    def ask(self, data: bytes) -> dict[str, Any]:
        for attempt in range(2):
            if self.sock is None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(10)
                self.sock.connect(str(self.path))
                self.file = self.sock.makefile("rb")
            try:
                self.sock.sendall(data + b"\n")
                answer = self.file.readline()
            except (BrokenPipeError, ConnectionResetError):
                answer = b""
            if answer:
                reply: dict[str, Any] = json.loads(answer)
                return reply
            self.close()
            assert attempt == 0, "the server closed the connection without an answer"
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.sock is not None:
            self.file.close()
            self.sock.close()
            self.sock = self.file = None


@pytest.fixture(scope="module")
def hook_server(tmp: Path) -> Iterator[tuple[HookClient, Records, list[HookEvent]]]:
    log, records = _logger("test.fuzz.hook")
    handled: list[HookEvent] = []

    async def handler(event: HookEvent) -> Verdict:
        handled.append(event)
        if event.domain == "boom":
            raise RuntimeError("the handler broke")
        return Verdict("defer", "later") if event.op == "prepare" else Verdict("proceed")

    path = tmp / "hook.sock"
    live = Live(lambda: serve_hooks(path, handler, log=log))
    client = HookClient(path)
    yield client, records, handled
    client.close()
    live.close()
    log.removeHandler(records)


# What the server answered each id it handled, across examples (the inbox remembers).
ANSWERED: dict[str, dict[str, Any]] = {}


@fuzz
@given(messages(VALID_EVENT) | mutated(VALID_EVENT | {"domain": "boom"}))
def test_hook_socket_answers_every_line(
        hook_server: tuple[HookClient, Records, list[HookEvent]], data: bytes) -> None:
    client, records, _ = hook_server
    answered = ANSWERED
    records.take()
    answer = client.ask(data)
    logged = records.take()
    assert answer["v"] == 1 and isinstance(answer["message"], str)
    try:
        event = parse_hook_line(data)
    except ProtocolError:
        # The message itself may differ from ours: how deep JSON may nest depends on the
        # stack of the thread that parses it.
        assert answer["id"] is None and answer["verdict"] == "error" and answer["message"]
        assert any(r.levelno == logging.WARNING and answer["message"] in r.getMessage()
                   for r in logged)
        return
    assert answer["id"] == event.id
    if event.id in answered:
        # Handled once per id: a repeated id gets the first answer, the handler is not run.
        assert answer == answered[event.id]
    elif event.domain == "boom":
        assert answer["verdict"] == "error"
        assert "the handler broke" in answer["message"]
        assert any(r.levelno == logging.ERROR for r in logged)
    else:
        assert answer["verdict"] == ("defer" if event.op == "prepare" else "proceed")
        answered[event.id] = answer


def test_hook_socket_is_still_serving_after_the_fuzz(
        hook_server: tuple[HookClient, Records, list[HookEvent]]) -> None:
    client, _, handled = hook_server
    fresh = VALID_EVENT | {"id": "after-the-fuzz"}
    assert client.ask(_dumps(fresh))["verdict"] == "defer"
    assert handled[-1].id == "after-the-fuzz"


# --- the control protocol --------------------------------------------------------------

VALID_REQUEST = {"v": 1, "verb": "status", "args": {}}


@fuzz
@given(messages(VALID_REQUEST))
def test_parse_request_raises_only_value_error(data: bytes) -> None:
    try:
        verb, args = parse_request(data)
    except ValueError as e:
        assert str(e)
    else:
        assert isinstance(verb, str) and isinstance(args, dict)


async def _status(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield {"ok": True, "data": {"args": args}}


async def _progress(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield {"message": "working"}
    yield {"ok": True, "data": {}}


async def _boom(args: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    raise RuntimeError("the verb broke")
    yield {}  # pragma: no cover - makes this an async generator


VERBS = {"status": _status, "progress": _progress, "boom": _boom}


@pytest.fixture(scope="module")
def control_server(tmp: Path) -> Iterator[tuple[Path, Records]]:
    log, records = _logger("test.fuzz.control")
    path = tmp / "control.sock"
    live = Live(lambda: serve_control(path, VERBS, log=log))
    yield path, records
    live.close()
    log.removeHandler(records)


def control_round_trip(path: Path, data: bytes) -> list[dict[str, Any]]:
    """Send one request line; every reply line, up to the result or the end."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(data + b"\n")
        replies = []
        with sock.makefile("rb") as f:
            for raw in f:
                assert raw.endswith(b"\n")
                replies.append(json.loads(raw))
                if replies[-1].get("type") == "result":
                    break
    return replies


@fuzz
@given(messages(VALID_REQUEST)
       | mutated(VALID_REQUEST | {"verb": "progress"})
       | mutated(VALID_REQUEST | {"verb": "boom"}))
def test_control_socket_answers_every_request(
        control_server: tuple[Path, Records], data: bytes) -> None:
    path, records = control_server
    records.take()
    replies = control_round_trip(path, data)
    logged = records.take()
    assert replies, "no answer at all"
    result = replies[-1]
    assert result["v"] == 1 and result["type"] == "result" and isinstance(result["ok"], bool)
    assert all(r["type"] == "progress" for r in replies[:-1])
    try:
        verb, args = parse_request(data)
    except ValueError:
        # As for the hook: the message may differ, on how deep JSON nests.
        assert not result["ok"] and result["error"].startswith("bad request: ")
        why = result["error"].removeprefix("bad request: ")
        # Logged with its reason, capped, unless this caller's share of records is spent.
        assert all(why[:150] in r.getMessage() for r in logged
                   if r.levelno == logging.WARNING and "bad request" in r.getMessage())
        return
    if verb not in VERBS:
        assert not result["ok"] and result["error"].startswith(f"unknown verb {verb!r}")
    elif verb == "boom":
        assert not result["ok"] and "the verb broke" in result["error"]
        assert any(r.levelno == logging.ERROR for r in logged)
    else:
        assert result["ok"], result
