"""Words from others reach no terminal as orders: cleaned where they come in (the guest's
nvidia-smi, the journal, the API server) and again where the CLI prints them."""

from __future__ import annotations

import io
import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostagent.surfaces import history
from hostagent.host import journal, verify
from hostagent.surfaces.follow import _Line, format_reply, format_status
from hostagent.core import text
from hostagent.core.text import clean

# Clears the screen and homes the cursor; writes the clipboard (OSC 52); the 8-bit CSI;
# a carriage return and a newline that would print over a line or add one; a
# right-to-left override; a zero-width space.
HOSTILE = "Evil\x1b[2J\x1b[H\x1b]52;c;cm0gLXJmIC8K\x07\x9b31m\rRTX\nfake line\u202e\u200b"
NAME = HOSTILE.replace("\n", "\u2028")  # a name in one line of nvidia-smi's
EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "3_000"))


def harmless(text: str) -> bool:
    """Nothing a terminal acts on but the ends of lines."""
    return all(c.isprintable() for line in text.split("\n") for c in line)


# --- the one helper --------------------------------------------------------------------


@settings(max_examples=EXAMPLES)
@given(st.text(alphabet=st.characters(codec=None, exclude_categories=())),
       st.none() | st.integers(0, 50))
def test_clean_gives_one_printable_line_within_its_limit(text: str, limit: int | None) -> None:
    out = clean(text, limit)
    assert out.isprintable()
    if limit is not None:
        assert len(out) <= limit + 1
    if text.isprintable() and (limit is None or len(text) <= limit):
        assert out == text  # honest text is left as it is
    assert clean(out, None) == out


def test_clean_shows_what_was_sent() -> None:
    assert clean("a\x1b[2Jb\x9b\u202e\ud800\n") == "a\\x1b[2Jb\\x9b\\u202e\\ud800\\n"
    assert clean("x" * 5000).endswith("x…") and len(clean("x" * 5000)) == 1001
    assert clean("\x07" * 5000, 10) == "\\x07\\x07\\x…"
    assert clean(ValueError("bad\x1b")) == "bad\\x1b"
    assert clean("Lab RTX 3050 A, ünïcode, 😀") == "Lab RTX 3050 A, ünïcode, 😀"


# --- where it comes in ---------------------------------------------------------------


def test_a_gpu_name_from_the_guest_comes_in_cleaned_and_capped() -> None:
    uuid = "GPU-a0a0a0a0-0000-4000-8000-00000000000a"
    [seen] = verify.parse_query(f"{uuid}, 00000000:01:00.0, {NAME}{'x' * 5000}\n")
    assert harmless(seen.name) and "\\x1b]52;c;" in seen.name and len(seen.name) <= 201
    outcome = verify.compare([verify.Expected(label="gpu-a", uuid=uuid)], [seen])
    assert outcome.ok and harmless(outcome.summary("gpu-node"))


def test_a_failing_guest_command_is_quoted_cleaned() -> None:
    expected = [verify.Expected(label="gpu-a")]
    failed = verify.outcome_of_run(expected, 9, f"{HOSTILE}\n", "")
    assert failed.problem is not None and harmless(failed.problem)
    broken = verify.combine(expected, [("nvidia-smi", RuntimeError(f"guest says {HOSTILE}"))])
    assert broken is not None and broken.problem is not None and harmless(broken.problem)


def record(**fields: str) -> dict[str, Any]:
    return {"__REALTIME_TIMESTAMP": str(int(time.time() * 1e6)), "SYSLOG_IDENTIFIER": "hostagent",
            "_SYSTEMD_UNIT": "hostagent.service", "_UID": "0", "MESSAGE": HOSTILE,
            "HOSTAGENT_EVENT": "owner", "HOSTAGENT_VM": f"gaming1{HOSTILE}",
            "HOSTAGENT_FROM": "off", "HOSTAGENT_TO": f"running{HOSTILE}",
            "HOSTAGENT_RESULT": HOSTILE, "HOSTAGENT_HOLDERS": f"gpu-a=gaming1{HOSTILE}",
            **fields}


def test_journal_text_is_cleaned_as_it_is_read_and_as_it_is_printed() -> None:
    h = history.build([record()])
    [t] = h.transitions
    assert t.holders is not None
    assert all(harmless(str(x)) for x in (t.message, t.vm, t.to, t.result, *t.holders.values()))
    assert harmless(history.format_table(h))
    # Bytes that are not UTF-8 come as a list of numbers from journalctl.
    [t] = history.build([record(MESSAGE=list(b"\x1b[2J\xff"))]).transitions  # type: ignore[arg-type]
    assert t.message == "\\x1b[2J\ufffd"


# --- where the CLI prints ------------------------------------------------------------


def status_data() -> dict[str, Any]:
    """A status reply whose every string says something hostile."""
    return {
        "lendee": {"domain": "gpu-node", "phase": "failed", "reason": f"the API said {HOSTILE}",
                   "since": time.time() - 5, "hold": False, "lent": [f"gpu-a{HOSTILE}"],
                   "regrow_waiting": False},
        "gpus": [{"gpu": "gpu-a", "name": HOSTILE, "pci": "0000:0a:00.0",
                  "owners": [f"gaming1{HOSTILE}"], "holder": HOSTILE}],
        "verified": {"at": time.time(), "ok": True, "summary": f"the driver sees {HOSTILE}"},
        "intents": [{"owner": HOSTILE, "source": HOSTILE, "age_s": 3}],
        "relend_in_s": None,
        "health": [{"check": "kubernetes", "ok": False, "detail": HOSTILE}],
    }


def test_status_prints_no_order_to_the_terminal() -> None:
    text = format_status(status_data())
    assert harmless(text), text
    assert "the API said Evil\\x1b[2J" in text and "fake line" in text
    assert len(text.splitlines()) == len(format_status({**status_data(), **{
        "gpus": [{"gpu": "gpu-a", "name": "n", "pci": "p", "owners": [], "holder": None}]}}
    ).splitlines())  # no line added by a newline inside a value


def test_follow_prints_no_order_to_the_terminal() -> None:
    for reply in ({"message": HOSTILE, "waiting": HOSTILE, "elapsed_s": 1.0},
                  {"type": "result", "ok": False, "error": HOSTILE},
                  {"type": "result", "ok": True, "data": {"message": HOSTILE}},
                  {"type": "result", "ok": True, "data": {**status_data(), "message": HOSTILE}}):
        assert harmless(format_reply(reply)), reply
    out = io.StringIO()
    line = _Line(out)
    line.show({"message": HOSTILE, "waiting": HOSTILE, "elapsed_s": 1.0})
    drawn = out.getvalue()
    assert drawn.startswith("\r\x1b[K") and harmless(drawn.removeprefix("\r\x1b[K"))


def test_a_journal_line_on_stderr_is_one_harmless_line() -> None:
    entry = journal.Entry(message=HOSTILE, fields={"HOSTAGENT_VM": HOSTILE})
    line = entry.line()
    assert harmless(line) and "\n" not in line


# --- bounded_json: the limits checked before parsing, to the byte and the level --------


@pytest.mark.parametrize(("data", "value"), [
    (b'[[1], {"a": 2}, [3]]', [[1], {"a": 2}, [3]]),  # 2 deep thrice: ] and } close
    (b'["[[[[", "{{{"]', ["[[[[", "{{{"]),  # brackets inside a string are text
    (b'["\\"[[[[", 1]', ['"[[[[', 1]),  # an escaped quote does not end the string
    (b'["\\\\", [1]]', ["\\", [1]]),  # an escaped backslash does not escape the quote
    (b'12345678', 12345678),  # exactly max_bytes
])
def test_bounded_json_accepts_what_is_within_both_limits(data: bytes, value: object) -> None:
    assert text.bounded_json(data, max_bytes=len(data) if len(data) == 8 else 64,
                             max_depth=2) == value


@pytest.mark.parametrize(("data", "why"), [
    (b'[[[1]]]', "nested deeper than 2"),
    (b'{"a": {"b": {}}}', "nested deeper than 2"),
    (b'["\\\\", [[1]]]', "nested deeper than 2"),
    (b'123456789', "9 bytes (at most 8)"),
])
def test_bounded_json_refuses_one_byte_or_one_level_more(data: bytes, why: str) -> None:
    with pytest.raises(ValueError) as e:
        text.bounded_json(data, max_bytes=8 if data.isdigit() else 64, max_depth=2)
    assert str(e.value) == why


def test_printable_characters_beside_an_escaped_one_are_kept_as_they_are() -> None:
    # A backslash or a quote is printable: only the control character is escaped.
    assert clean("C:\\dir 'x' \"y\"\x1b") == "C:\\dir 'x' \"y\"\\x1b"


def test_a_string_is_taken_as_it_is_not_through_its_str() -> None:
    class Shown(str):
        def __str__(self) -> str:
            return "something else"

    assert clean(Shown("the text")) == "the text"
    assert clean(12) == "12"


def test_bounded_json_counts_every_close_once() -> None:
    # Three deep, then back to two and four deep: each ] lowers the depth by one level.
    with pytest.raises(ValueError, match="^nested deeper than 3$"):
        text.bounded_json(b'[[[1], [[2]]]]', max_bytes=64, max_depth=3)


def test_an_escaped_text_exactly_at_the_limit_is_not_cut() -> None:
    assert clean("ab\x1b", limit=6) == "ab\\x1b"
    assert clean("abc\x1b", limit=6) == "abc\\x1…"
