"""The whole message an operator reads when a configuration file is broken: a TOML syntax
error (where, what, the line shown), each check that spans sections, a file that cannot be
read, and several problems named at once."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from hostagent.core.config import ConfigError, _syntax_error, load, parse

BASE = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"
"""

FIX = '; check quotes, brackets and "key = value" on that line'


def error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, "t.toml")
    return info.value


def message(text: str) -> str:
    return str(error(text))


# --- TOML syntax errors ----------------------------------------------------------------


def test_a_syntax_error_on_the_first_line_shows_that_line() -> None:
    e = error("x = \n")
    assert str(e) == 't.toml:1:5: not valid TOML: Invalid value in "x ="' + FIX
    assert (e.line, e.column, e.key) == (1, 5, None)
    assert e.fix == 'check quotes, brackets and "key = value" on that line'


def test_a_syntax_error_on_the_last_line_shows_that_line_stripped() -> None:
    assert message(BASE + "\t[bad\n") == (
        "t.toml:8:6: not valid TOML: Expected ']' at the end of a table declaration"
        ' in "[bad"' + FIX)


def test_a_line_separator_inside_a_comment_does_not_shift_the_line_shown() -> None:
    """TOML counts lines by newline alone; U+2028 and U+2029 are text a comment or string
    may hold, so the line shown is the one the position names, not the one before it."""
    e = error("# a\u2028b\u2029c\nx = \n")
    assert str(e) == 't.toml:2:5: not valid TOML: Invalid value in "x ="' + FIX
    assert message('s = "\u2028"\r\nx = \r\n') == (
        't.toml:2:5: not valid TOML: Invalid value in "x ="' + FIX)


def test_a_syntax_error_on_a_long_line_shows_it_whole() -> None:
    long = 'name = "' + "y" * 200 + '" oops'
    assert message(BASE + long + "\n") == (
        "t.toml:8:211: not valid TOML: Expected newline or end of document after a statement"
        f' in "{long}"' + FIX)


def test_an_unterminated_string_in_a_one_line_file_is_at_its_end() -> None:
    e = error('a = "abc')
    assert str(e) == (
        't.toml:1:9: not valid TOML: Unterminated string at the end of the file in "a = "abc"'
        + FIX)
    assert (e.line, e.column) == (1, 9)


def test_an_unterminated_string_on_the_last_of_two_lines() -> None:
    assert message('a = 1\nb = "abc') == (
        't.toml:2:9: not valid TOML: Unterminated string at the end of the file in "b = "abc"'
        + FIX)


def test_an_open_bracket_at_the_end_of_a_file_with_crlf_lines() -> None:
    assert message("a = 1\r\nb = [1,\r\n") == (
        't.toml:2:8: not valid TOML: Invalid value at the end of the file in "b = [1,"' + FIX)


def test_an_open_bracket_at_the_end_of_the_file() -> None:
    assert message(BASE + "a = [1,\n") == (
        't.toml:8:8: not valid TOML: Invalid value at the end of the file in "a = [1,"' + FIX)


def test_a_syntax_error_without_a_position_is_named_whole() -> None:
    e = _syntax_error(tomllib.TOMLDecodeError("Something odd"), "a = 1\n", "t.toml")
    assert str(e) == "t.toml: not valid TOML: Something odd"
    assert (e.source, e.line, e.column, e.fix) == ("t.toml", None, None, "")


def test_an_error_at_the_end_of_an_empty_text_is_line_1_column_1() -> None:
    e = _syntax_error(tomllib.TOMLDecodeError("Odd (at end of document)"), "", "t.toml")
    assert str(e) == "t.toml:1:1: not valid TOML: Odd at the end of the file" + FIX
    assert (e.line, e.column) == (1, 1)


def test_a_line_past_the_text_or_line_0_is_not_shown() -> None:
    past = _syntax_error(tomllib.TOMLDecodeError("Odd (at line 3, column 2)"), "a\n", "t.toml")
    assert str(past) == "t.toml:3:2: not valid TOML: Odd" + FIX
    zero = _syntax_error(tomllib.TOMLDecodeError("Odd (at line 0, column 2)"), "a\nb\n",
                         "t.toml")
    assert str(zero) == "t.toml:0:2: not valid TOML: Odd" + FIX


# --- checks that span sections ---------------------------------------------------------


def test_a_gpu_without_pci_or_uuid() -> None:
    assert message(BASE + "[gpus.gpu-b]\nfunctions = []\n") == (
        't.toml: gpus.gpu-b.pci: missing; add pci = "0000:01:00.0" under [gpus.gpu-b]'
        ' (see lspci -D), or uuid = "GPU-..." if NVML on this host sees it'
        " (see hostagent gpus)")


def test_one_uuid_for_two_gpus() -> None:
    e = error(BASE + '[gpus.gpu-b]\nuuid = "GPU-1"\n[gpus.gpu-c]\nuuid = "GPU-1"\n')
    assert str(e) == ("t.toml: gpus.gpu-c.uuid: GPU-1 is already the UUID of GPU gpu-b;"
                      " a UUID names one GPU: fix one of them")
    assert e.fix == "a UUID names one GPU: fix one of them"


def test_one_pci_function_for_two_gpus() -> None:
    assert message(BASE + '[gpus.gpu-b]\npci = "0000:02:00.0"\nfunctions = ["0000:01:00.0"]\n') == (
        "t.toml: gpus.gpu-b.functions[0]: 0000:01:00.0 is already a function of GPU gpu-a"
        " (gpus.gpu-a.pci); a PCI function belongs to one GPU: remove one of them")


def test_an_unknown_gpu_lists_every_label() -> None:
    assert message('[lendee]\ndomain = "gpu-node"\ngpus = ["gpu-z"]\n'
                   '[gpus.gpu-a]\npci = "0000:01:00.0"\n[gpus.gpu-b]\npci = "0000:02:00.0"\n') == (
        't.toml: lendee.gpus[0]: unknown GPU "gpu-z"; define it as a [gpus.gpu-z] section'
        " or use one of: gpu-a, gpu-b")


def test_a_gpu_listed_twice_by_label_and_address() -> None:
    e = error(BASE.replace('["gpu-a"]', '["gpu-a", "0000:01:00.0"]'))
    assert str(e) == ("t.toml: lendee.gpus[1]: GPU gpu-a is already listed at lendee.gpus[0];"
                      " remove one")
    assert e.fix == "remove one"


def test_a_bare_address_listed_twice_in_two_spellings() -> None:
    assert message('[lendee]\ndomain = "gpu-node"\ngpus = ["0000:05:00.0", "05:00.0"]\n') == (
        "t.toml: lendee.gpus[1]: GPU 0000:05:00.0 is already listed at lendee.gpus[0];"
        " remove one")


def test_a_gpu_named_by_uuid_alone_is_labelled_by_it() -> None:
    config = parse('[lendee]\ndomain = "gpu-node"\ngpus = ["GPU-abc"]\n', "t.toml")
    assert config.gpus["GPU-abc"].label == "GPU-abc"
    assert config.gpus["GPU-abc"].uuid == "GPU-abc"
    assert config.lendee.gpus == ("GPU-abc",)


def test_the_lendee_as_an_owner_does_not_hide_the_owners_after_it() -> None:
    assert message(BASE + '[owners.gpu-node]\ngpus = ["gpu-a"]\n'
                   '[owners.gaming1]\ngpus = ["nope"]\n') == (
        "t.toml: owners.gpu-node: gpu-node is the lendee, and the lendee cannot also own GPUs;"
        " remove [owners.gpu-node]: the lendee borrows what lendee.gpus lists\n"
        't.toml: owners.gaming1.gpus[0]: unknown GPU "nope"; define it as a [gpus.nope]'
        " section or use one of: gpu-a")


def test_an_mqtt_vm_that_is_no_owner_lists_every_owner() -> None:
    assert message(
        BASE + '[gpus.gpu-b]\npci = "0000:02:00.0"\n[gpus.gpu-c]\npci = "0000:03:00.0"\n'
        '[owners.g1]\ngpus = ["gpu-b"]\n[owners.g2]\ngpus = ["gpu-c"]\n'
        '[mqtt]\nbroker = "mqtt://b.lan"\nvms = ["g1", "nope"]\n') == (
        't.toml: mqtt.vms[1]: "nope" is not an owner VM; list some of g1, g2')


def test_a_bad_key_keeps_what_still_reads() -> None:
    e = error(BASE + 'drain_timeout = 5\n[gpus.gpu-b]\n')
    assert str(e) == (
        "t.toml: gpus.gpu-a.drain_timeout: unknown key; known keys here: pci, functions, uuid,"
        " name\n"
        't.toml: gpus.gpu-b.pci: missing; add pci = "0000:01:00.0" under [gpus.gpu-b]'
        ' (see lspci -D), or uuid = "GPU-..." if NVML on this host sees it'
        " (see hostagent gpus)")
    assert [p.key for p in e.problems] == ["gpus.gpu-a.drain_timeout", "gpus.gpu-b.pci"]
    assert e.salvaged is not None
    assert e.salvaged.lendee.domain == "gpu-node"


# --- ConfigError and several -----------------------------------------------------------


def test_a_config_error_without_fix_or_column() -> None:
    e = ConfigError(source="s", problem="p", line=3)
    assert str(e) == "s:3: p"
    assert (e.fix, e.line, e.column, e.key) == ("", 3, None, None)
    assert e.problems == (e,)
    assert e.salvaged is None


def test_a_config_error_with_every_field() -> None:
    e = ConfigError(source="s", problem="p", fix="f", key="k", line=3, column=4)
    assert str(e) == "s:3:4: k: p; f"
    assert (e.source, e.key, e.problem, e.fix, e.line, e.column) == ("s", "k", "p", "f", 3, 4)


def test_several_errors_keep_the_first_fields_and_name_each_on_a_line() -> None:
    first = ConfigError(source="a", problem="p1", fix="f1", key="k1", line=2, column=5)
    second = ConfigError(source="b", problem="p2")
    e = ConfigError.several([first, second])
    assert str(e) == "a:2:5: k1: p1; f1\nb: p2"
    assert (e.source, e.key, e.problem, e.fix, e.line, e.column) == (
        "a", "k1", "p1", "f1", 2, 5)
    assert e.problems == (first, second)


# --- load ------------------------------------------------------------------------------


def test_load_of_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "none.toml"
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == (
        f"{path}: no such file; create one with `hostagent config init`, then edit it")
    assert info.value.source == str(path)


def test_load_of_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path)
    assert str(info.value) == f"{tmp_path}: cannot read it: Is a directory"
    assert (info.value.source, info.value.fix) == (str(tmp_path), "")


def test_load_of_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("")
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value).startswith(f"{path}: lendee: missing;")


def test_load_of_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    assert load(path) == parse(BASE, str(path))
    assert load(path).lendee.gpus == ("gpu-a",)


@pytest.mark.parametrize(("data", "where"), [
    (b"\xff\n\n", "1:1"),  # newlines after the bad byte are not counted
    (b"\n\xff", "2:1"),  # a newline at byte 0 is counted, and the column starts after it
    (b"a\nb\ncd\xff", "3:3"),  # the column counts from the last newline, not the first
])
def test_load_of_a_file_that_is_not_utf8(tmp_path: Path, data: bytes, where: str) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load(path)
    start = data.index(b"\xff")
    assert str(info.value) == (
        f"{path}:{where}: not UTF-8 text (byte {start}); save the file as UTF-8")
