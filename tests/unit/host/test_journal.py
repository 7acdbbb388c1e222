"""Journal records: field names, the stderr line, the sinks, sd_notify and the watchdog."""

from __future__ import annotations

import contextlib
import enum
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hostagent.host import journal
from hostagent.host.journal import Entry, ListSink, Priority, record
from tests.waiting import BOUND



class Phase(enum.StrEnum):
    LENT = "lent"
    DRAINING = "draining"


def test_record_fields(sink: ListSink) -> None:
    record(
        "drain",
        "drained gpu-node in 41 s",
        vm="gpu-node",
        from_=Phase.LENT,
        to=Phase.DRAINING,
        duration_ms=41230.4,
        result="ok",
        pods=3,
        forced=False,
    )
    (entry,) = sink.entries
    assert entry.message == "drained gpu-node in 41 s"
    assert entry.priority is Priority.INFO
    assert dict(entry.fields) == {
        "HOSTAGENT_EVENT": "drain",
        "HOSTAGENT_VM": "gpu-node",
        "HOSTAGENT_FROM": "lent",
        "HOSTAGENT_TO": "draining",
        "HOSTAGENT_DURATION_MS": "41230",
        "HOSTAGENT_RESULT": "ok",
        "HOSTAGENT_PODS": "3",
        "HOSTAGENT_FORCED": "false",
    }
    assert entry.code is not None
    assert entry.code[0] == __file__
    assert entry.code[2] == "test_record_fields"


def test_unset_fields_are_left_out(sink: ListSink) -> None:
    record("intent", "gaming1 asked to start", vm="gaming1", gpu=None)
    assert dict(sink.entries[0].fields) == {
        "HOSTAGENT_EVENT": "intent",
        "HOSTAGENT_VM": "gaming1",
    }
    assert sink.events() == ["intent"]


def test_priority(sink: ListSink) -> None:
    record("verify", "gpu-node reports 1 GPU, expected 3", priority=Priority.ERR)
    assert sink.entries[0].priority is Priority.ERR


def test_extra_name_must_make_a_field_name(sink: ListSink) -> None:
    extra: dict[str, Any] = {"bad-name": 1}
    with pytest.raises(ValueError, match="field name"):
        record("x", "y", **extra)
    assert sink.entries == []


# --- the stderr line -----------------------------------------------------------------


def test_line() -> None:
    entry = Entry(
        message="drained gpu-node in 41 s",
        fields={
            "HOSTAGENT_EVENT": "drain",
            "HOSTAGENT_VM": "gpu-node",
            "HOSTAGENT_DURATION_MS": "41230",
            "HOSTAGENT_RESULT": "ok",
        },
    )
    assert entry.line() == (
        "hostagent: drained gpu-node in 41 s [event=drain vm=gpu-node duration_ms=41230 result=ok]"
    )


def test_line_quotes_what_would_be_ambiguous() -> None:
    entry = Entry(
        message="m",
        fields={"HOSTAGENT_A": "two words", "HOSTAGENT_B": "", "HOSTAGENT_C": 'x="y"'},
    )
    assert entry.line() == 'hostagent: m [a="two words" b="" c="x=\\"y\\""]'


@pytest.mark.parametrize(
    ("priority", "prefix"),
    [
        (Priority.DEBUG, "hostagent: m"),
        (Priority.INFO, "hostagent: m"),
        (Priority.NOTICE, "hostagent: m"),
        (Priority.WARNING, "hostagent: warning: m"),
        (Priority.ERR, "hostagent: error: m"),
        (Priority.CRIT, "hostagent: error: m"),
    ],
)
def test_line_says_warnings_and_errors(priority: Priority, prefix: str) -> None:
    assert Entry(message="m", priority=priority).line() == prefix


def test_stderr_sink(capsys: pytest.CaptureFixture[str]) -> None:
    previous = journal.use_sink(journal.StderrSink())
    try:
        record("lend", "lent gpu-a to gpu-node", vm="gpu-node", result="ok")
    finally:
        journal.use_sink(previous)
    assert capsys.readouterr().err == (
        "hostagent: lent gpu-a to gpu-node [event=lend vm=gpu-node result=ok]\n"
    )


def test_stderr_sink_to_a_stream() -> None:
    stream = io.StringIO()
    journal.StderrSink(stream).write(Entry(message="m"))
    assert stream.getvalue() == "hostagent: m\n"


# --- choosing the sink ---------------------------------------------------------------


def test_choose_stderr_without_journald(tmp_path: Path) -> None:
    sink = journal.choose_sink(environ={}, socket=tmp_path / "absent")
    assert isinstance(sink, journal.StderrSink)


def test_choose_journald_when_its_socket_exists(tmp_path: Path) -> None:
    present = tmp_path / "socket"
    present.touch()
    assert isinstance(journal.choose_sink(environ={}, socket=present), journal.JournalSink)
    forced = journal.choose_sink(environ={"HOSTAGENT_LOG": "stderr"}, socket=present)
    assert isinstance(forced, journal.StderrSink)


def test_current_sink_is_chosen_once() -> None:
    previous = journal.use_sink(None)
    try:
        first = journal.current_sink()
        assert journal.current_sink() is first
    finally:
        journal.use_sink(previous)


# --- what journald is sent -----------------------------------------------------------


def test_journal_sink_sends_fields() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    sink = journal.JournalSink(send=lambda *a, **kw: calls.append((a, kw)))
    sink.write(
        Entry(
            message="m",
            priority=Priority.WARNING,
            fields={"HOSTAGENT_EVENT": "e"},
            code=("/x.py", 7, "f"),
        )
    )
    assert calls == [
        (
            ("m",),
            {
                "PRIORITY": "4",
                "SYSLOG_IDENTIFIER": "hostagent",
                "CODE_FILE": "/x.py",
                "CODE_LINE": 7,
                "CODE_FUNC": "f",
                "HOSTAGENT_EVENT": "e",
            },
        )
    ]


def test_journal_sink_falls_back_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    journal.JournalSink(send=fail).write(Entry(message="m", fields={"HOSTAGENT_EVENT": "e"}))
    assert capsys.readouterr().err == "hostagent: m [event=e]\n"


JOURNALD = next((p for p in ("/lib/systemd/systemd-journald", "/usr/lib/systemd/systemd-journald")
                 if Path(p).exists()), None)
# Run in a mount namespace of its own, where /run is private and a standalone journald
# (as the lab runs it, tests/lab/lab.py) listens on the socket the library writes to:
# first with no journald there, then with it.
PRIVATE_JOURNAL = """
import json, subprocess, sys, time
from hostagent.host import journal
from hostagent.host.journal import Entry
journal_dir, conf = sys.argv[1:3]
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "journal-test", "/run"], check=True)
subprocess.run(["mkdir", "-p", "/run/log/journal"], check=True)
subprocess.run(["mount", "--bind", journal_dir, "/run/log/journal"], check=True)
subprocess.run(["mount", "--bind", conf, "/etc/systemd/journald.conf"], check=False)
# No journald: the library drops the record quietly.
journal.JournalSink().write(Entry(message="dropped", fields={"HOSTAGENT_EVENT": "none"}))
journald = subprocess.Popen([sys.argv[3]])
deadline = time.monotonic() + float(sys.argv[4])
try:
    while not journal.JOURNAL_SOCKET.exists():
        assert time.monotonic() < deadline and journald.poll() is None, "journald did not start"
        time.sleep(0.05)
    journal.JournalSink().write(Entry(message="unit test", fields={"HOSTAGENT_EVENT": "test"},
                                      priority=journal.Priority.WARNING))
    while True:  # journald stores the record a moment after the write returns
        out = subprocess.run(["journalctl", "-D", "/run/log/journal", "-o", "json",
                              "SYSLOG_IDENTIFIER=hostagent"], capture_output=True, text=True)
        if out.stdout.strip():
            print(out.stdout, end="")
            break
        assert time.monotonic() < deadline, "the record never reached the journal"
        time.sleep(0.05)
finally:
    journald.kill()
    journald.wait()
"""


def test_journal_sink_with_the_real_module_reaches_journald(tmp_path: Path) -> None:
    if JOURNALD is None:
        pytest.skip("systemd-journald is not installed (Debian package systemd)")
    if os.geteuid() != 0:
        pytest.skip("needs root: the test's journald runs in a mount namespace of its own")
    (tmp_path / "journal").mkdir()
    (tmp_path / "journald.conf").write_text("[Journal]\nStorage=volatile\nReadKMsg=no\n"
                                            "ForwardToSyslog=no\nForwardToWall=no\n")
    with subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
             PRIVATE_JOURNAL, str(tmp_path / "journal"), str(tmp_path / "journald.conf"),
             JOURNALD, str(BOUND)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=BOUND + 30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its journald too, whatever happened
    assert proc.returncode == 0, err
    entries = [json.loads(line) for line in out.splitlines()]
    assert [(e["MESSAGE"], e["HOSTAGENT_EVENT"], e["PRIORITY"]) for e in entries] == [
        ("unit test", "test", str(int(Priority.WARNING)))]


# --- logging -------------------------------------------------------------------------


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger("hostagent.test")
    log.propagate = False
    yield log
    log.handlers.clear()
    log.propagate = True


def test_log_handler(logger: logging.Logger) -> None:
    captured = ListSink()
    logger.addHandler(journal.LogHandler(sink=captured))
    logger.warning("NVML is missing; GPU checks inside the host are off")
    (entry,) = captured.entries
    assert entry.message == "NVML is missing; GPU checks inside the host are off"
    assert entry.priority is Priority.WARNING
    assert dict(entry.fields) == {"HOSTAGENT_LOGGER": "hostagent.test"}
    assert entry.code is not None and entry.code[2] == "test_log_handler"
    assert captured.events() == []  # log records are not transitions


@pytest.mark.parametrize(
    ("level", "priority"),
    [
        (logging.DEBUG, Priority.DEBUG),
        (logging.INFO, Priority.INFO),
        (logging.WARNING, Priority.WARNING),
        (logging.ERROR, Priority.ERR),
        (logging.CRITICAL, Priority.CRIT),
    ],
)
def test_log_levels(logger: logging.Logger, level: int, priority: Priority) -> None:
    captured = ListSink()
    logger.setLevel(logging.DEBUG)
    logger.addHandler(journal.LogHandler(sink=captured))
    logger.log(level, "m")
    assert captured.entries[0].priority is priority


def test_log_handler_uses_the_current_sink(sink: ListSink, logger: logging.Logger) -> None:
    logger.addHandler(journal.LogHandler())
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("lend failed")
    (entry,) = sink.entries
    assert entry.priority is Priority.ERR
    assert entry.message.startswith("lend failed\nTraceback")
    assert "RuntimeError: boom" in entry.message


def test_log_handler_stderr_line(logger: logging.Logger) -> None:
    stream = io.StringIO()
    logger.addHandler(journal.LogHandler(sink=journal.StderrSink(stream)))
    logger.error("cannot reach the API server")
    assert stream.getvalue() == (
        "hostagent: error: cannot reach the API server [logger=hostagent.test]\n"
    )


# --- systemd -------------------------------------------------------------------------


def test_notify_without_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert journal.notify("lending", ready=True) is False


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    # Not tmp_path: a unix socket path must stay below 108 bytes.
    with (
        tempfile.TemporaryDirectory(prefix="hostagent-") as directory,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server,
    ):
        path = Path(directory) / "notify"
        server.bind(str(path))
        server.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield server


def test_notify_sends(notify_socket: socket.socket) -> None:
    assert journal.notify("lent: gpu-a, gpu-b\nto gpu-node", ready=True) is True
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=lent: gpu-a, gpu-b to gpu-node"
    assert journal.notify(watchdog=True) is True
    assert notify_socket.recv(4096) == b"WATCHDOG=1"


def test_notify_nothing_to_say(notify_socket: socket.socket) -> None:
    assert journal.notify() is False


def test_notify_failure_is_not_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert journal.notify(watchdog=True) is False


@pytest.mark.parametrize(
    ("environ", "seconds"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),  # meant for another
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], seconds: float | None) -> None:
    assert journal.watchdog_interval(environ=environ) == seconds
