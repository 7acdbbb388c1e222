"""Bad input, fuzzed: configuration files that are almost right.

Each example starts from the documented example configuration and breaks it the way
people do: a key dropped, renamed or misspelt, a value of the wrong type, an unknown
key, a line lost, doubled or cut, stray characters, bytes that are not UTF-8. Whatever
comes out, `config.load` either accepts it or raises a `ConfigError` whose message says
where: the key, or the line. An accepted file asserts nothing here: that each bad value
is refused, naming its key, is test_fuzz_config_keys.py's.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import tempfile
import textwrap
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.core import config
from hostagent.core.config import ConfigError

# Derandomized: the same examples on every run, so a CI run need not repeat many. A
# deeper search: HOSTAGENT_FUZZ_EXAMPLES=100000 make unit.
EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "2_000"))
fuzz = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

assert config.__doc__ is not None
EXAMPLE = textwrap.dedent(config.__doc__.split("::\n", 1)[1].split("\nRules", 1)[0])
VALID = tomllib.loads(EXAMPLE)


def _paths(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key in the document, tables included, as a path of names."""
    found = []
    for key, value in table.items():
        found.append((*prefix, key))
        if isinstance(value, dict):
            found += _paths(value, (*prefix, key))
    return found


def _value(rng: random.Random, depth: int = 0) -> Any:
    """Any TOML value, and the ones people write by mistake."""
    kinds = ["str", "int", "float", "bool", "datetime", "date", "time"]
    kinds += ["array", "table"] * (depth < 2)
    match rng.choice(kinds):
        case "str":
            return rng.choice(["", "gpu-a", "0000:01:00.0", "01:00.0", "GPU-x", "30", "30s",
                               "-5s", "1h30m", "/abs/path", "relative/path", "proceed",
                               "abort", "ssh", "none", "127.0.0.1:99999", "[::1]:80", "é\x7f",
                               "gaming1", "gpu-node"])
        case "int":
            return rng.choice([0, 1, -1, 22, 65536, 2**63 - 1])
        case "float":
            return rng.choice([0.0, -1.5, 30.0, float("inf"), float("nan")])
        case "bool":
            return rng.random() < 0.5
        case "datetime":
            return dt.datetime(2026, 1, 10, 20, 15, 2, tzinfo=dt.UTC)
        case "date":
            return dt.date(2026, 1, 10)
        case "time":
            return dt.time(20, 15)
        case "array":
            return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
        case _:
            return {rng.choice(["pci", "gpus", "x", "domain"]): _value(rng, depth + 1)
                    for _ in range(rng.randrange(3))}


def _lookup(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for name in path[:-1]:
        doc = doc[name]
    return doc


def _mutate_document(rng: random.Random) -> str:
    doc = tomllib.loads(EXAMPLE)  # a fresh copy to break
    for _ in range(rng.randrange(1, 4)):
        path = rng.choice(_paths(doc) or [("lendee",)])
        try:
            table = _lookup(doc, path)
        except (KeyError, TypeError):
            continue
        if not isinstance(table, dict):
            continue
        key = path[-1]
        match rng.choice(["drop", "retype", "retype", "rename", "add"]):
            case "drop":
                table.pop(key, None)
            case "retype":
                table[key] = _value(rng)
            case "rename":  # a typo: one letter off
                if key in table and key:
                    i = rng.randrange(len(key))
                    table[key[:i] + rng.choice("aexs_-") + key[i + 1:]] = table.pop(key)
            case "add":
                table[rng.choice(["extra", "gpu", "timeout", "Domain"])] = _value(rng)
    return tomli_w.dumps(doc)


def _damage_text(rng: random.Random, text: str) -> str:
    lines = text.splitlines(keepends=True)
    match rng.choice(["drop", "double", "insert", "cut"]):
        case "drop" if lines:
            del lines[rng.randrange(len(lines))]
        case "double" if lines:
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
        case "insert":
            text = "".join(lines)
            at = rng.randrange(len(text) + 1)
            return text[:at] + rng.choice(['"', "[", "]", "=", "\n", "#", "'", "{", ",", "x",
                                           "\\", "\t", "[[", '"""']) + text[at:]
        case "cut":
            text = "".join(lines)
            return text[:rng.randrange(len(text) + 1)]
    return "".join(lines)


def broken_file(seed: int) -> bytes:
    """The example configuration, broken in one to three ways."""
    rng = random.Random(seed)
    how = rng.choice(["document", "document", "text", "both", "bytes"])
    text = EXAMPLE if how in ("text", "bytes") else _mutate_document(rng)
    if how in ("text", "both"):
        text = _damage_text(rng, text)
    data = text.encode()
    if how == "bytes":
        at = rng.randrange(len(data) + 1)
        data = data[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"]) + data[at:]
    return data


@pytest.fixture(scope="module")
def file() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cfg-fuzz-") as d:
        yield Path(d) / "config.toml"


def test_the_example_is_valid() -> None:
    assert config.parse(EXAMPLE).lendee.domain == "gpu-node"


@fuzz
@given(st.integers(0, 2**32))
def test_a_broken_file_is_refused_with_the_key_or_the_line(file: Path, seed: int) -> None:
    data = broken_file(seed)
    file.write_bytes(data)
    try:
        config.load(file)
    except ConfigError as e:
        message = str(e)
        assert message.startswith(f"{file}"), message
        assert e.key or e.line, f"names neither a key nor a line: {message}"
        if e.key:
            assert f": {e.key}: " in message, message
        if e.line:
            assert message.startswith(f"{file}:{e.line}"), message
        assert e.problem and e.problem in message


# What the fuzz found first: two refusals that named neither a key nor a line.

def test_a_file_that_ends_inside_a_string_names_its_last_line() -> None:
    with pytest.raises(ConfigError) as e:
        config.parse('[lendee]\ndomain = "gpu-node', "c.toml")
    assert (e.value.line, e.value.column) == (2, 19)
    assert str(e.value).startswith("c.toml:2:19: not valid TOML: Unterminated string at the "
                                    'end of the file in "domain = "gpu-node"')


def test_a_byte_that_is_not_utf8_names_its_line_and_column(file: Path) -> None:
    file.write_bytes(b'[lendee]\ndomain = "gpu\xff-node"\n')
    with pytest.raises(ConfigError) as e:
        config.load(file)
    assert (e.value.line, e.value.column) == (2, 14)
    assert str(e.value) == f"{file}:2:14: not UTF-8 text (byte 22); save the file as UTF-8"
