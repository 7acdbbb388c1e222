"""The words an operator reads when a configuration value is wrong: each reader's whole
message (the key, what is wrong, the fix) and each right value's whole result.

The readers made by a factory (`_choice`, `_section`, `_table_of`, `_key`) are also made
here, inside the tests, rather than only taken from the configuration's dataclasses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest

from hostagent.core import config_read
from hostagent.core.config import ConfigError, Gpu, GpuApi, LogLevel, Owner, Ssh, parse
from hostagent.core.config_read import (
    _EXAMPLE,
    _READ,
    _choice,
    _example,
    _gather,
    _join,
    _key,
    _label_key,
    _label_key_or_off,
    _list,
    _pci,
    _Problem,
    _Problems,
    _raise_any,
    _section,
    _split_listen,
    _table_of,
    _taint,
    _text,
    _toml_type,
    _wrong_type,
    parse_duration,
)

BASE = """
[lendee]
domain = "gpu-node"
gpus = ["gpu-a"]

[gpus.gpu-a]
pci = "0000:01:00.0"
"""


def error(text: str) -> str:
    """The whole message of the ConfigError that BASE with `text` after it raises."""
    with pytest.raises(ConfigError) as info:
        parse(BASE + text, "t.toml")
    return str(info.value)


def problem(read: object, value: object, key: str) -> _Problem:
    assert callable(read)
    with pytest.raises(_Problem) as info:
        read(value, key)
    return info.value


def said(p: _Problem) -> tuple[str, str, str]:
    return p.key, p.problem, p.fix


# --- problems --------------------------------------------------------------------------


def test_a_problem_reads_as_what_is_wrong() -> None:
    p = _Problem("a.b", "is empty", "give it a value")
    assert (str(p), p.args, said(p), p.salvaged) == (
        "is empty", ("is empty",), ("a.b", "is empty", "give it a value"), None)
    assert p.each == [p]
    assert _Problem("a.b", "is empty").fix == ""


def test_several_problems_read_as_their_first() -> None:
    first = _Problem("a.x", "is empty", "give it a value")
    second = _Problem("a.y", "unknown key", "remove it")
    both = _Problems([first, second])
    assert (str(both), said(both)) == ("is empty", ("a.x", "is empty", "give it a value"))
    assert both.each == [first, second]


# --- types -----------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "name"), [
    (True, "a boolean"), (3, "an integer"), (1.5, "a float"), ("x", "a string"),
    ([], "an array"), ({}, "a table"), (None, "a value"), (object(), "a value"),
])
def test_the_type_of_a_value_is_named(value: object, name: str) -> None:
    assert _toml_type(value) == name


def test_a_value_of_no_toml_type_is_a_value() -> None:
    p = _wrong_type("k", None, "a string", "quote it")
    assert said(p) == ("k", "expected a string, got a value", "quote it")


# --- keys and examples -----------------------------------------------------------------


def test_a_key_without_an_example_has_none() -> None:
    assert _key(_text) == {_READ: _text, _EXAMPLE: ""}
    assert _key(_text, '"x"') == {_READ: _text, _EXAMPLE: '"x"'}


def test_a_missing_key_is_shown_where_it_goes() -> None:
    assert _example("domain", '"gaming"', "") == 'domain = "gaming" before any [section]'
    assert _example("domain", '"gaming"', "owners.g") == 'domain = "gaming" under [owners.g]'
    assert _example("ssh", "[ssh]\nhost = 1", "verify") == "[ssh]\nhost = 1"


def test_a_missing_required_key_says_what_to_add() -> None:
    assert error('[owners.g]\nstart_at_boot = true\n') == (
        't.toml: owners.g.gpus: missing; add gpus = ["gpu-a"] under [owners.g]')


# --- unknown keys and sections ---------------------------------------------------------


def test_an_unknown_key_suggests_the_closest() -> None:
    assert error('[gpus.gpu-b]\npci = "0000:02:00.0"\nnam = "y"\n') == (
        't.toml: gpus.gpu-b.nam: unknown key; did you mean "name"?')


def test_an_unknown_key_far_from_any_lists_them() -> None:
    assert error('[gpus.gpu-b]\npci = "0000:02:00.0"\nzzzzzz = 1\n') == (
        't.toml: gpus.gpu-b.zzzzzz: unknown key; known keys here: pci, functions, uuid, name')


def test_an_unknown_section_suggests_the_closest() -> None:
    assert error('[timeout]\ndrain = "1m"\n') == (
        't.toml: timeout: unknown key; did you mean "timeouts"?')


def test_a_top_level_key_after_a_section_says_to_move_it() -> None:
    assert error('log_level = "debug"\n') == (
        't.toml: gpus.gpu-a.log_level: unknown key; '
        'log_level is a top-level key: move it above the first [section]')


# --- sections --------------------------------------------------------------------------

SSH = {"host": "gpu-node.lan", "user": "hostagent", "key": "/k", "known_hosts": "/h"}


def test_a_section_reads_into_its_dataclass() -> None:
    assert _section(Ssh)(SSH, "verify.ssh") == Ssh(
        host="gpu-node.lan", port=22, user="hostagent", key=Path("/k"), known_hosts=Path("/h"))


def test_a_section_that_is_not_a_table() -> None:
    p = problem(_section(Ssh), "gpu-node", "verify.ssh")
    assert said(p) == ("verify.ssh", "expected a table, got a string",
                       "write it as a [verify.ssh] section")


def test_a_section_names_its_keys_under_its_own() -> None:
    p = problem(_section(Ssh), {**SSH, "port": 0}, "verify.ssh")
    assert said(p) == ("verify.ssh.port", "0 is not a TCP port", "write a number from 1 to 65535")
    assert p.salvaged == _section(Ssh)(SSH, "verify.ssh")


def test_a_section_in_the_file() -> None:
    assert error('[verify]\nmethod = "ssh"\n[verify.ssh]\nhost = "h"\nuser = "u"\n'
                 'key = "/k"\n') == (
        't.toml: verify.ssh.known_hosts: missing; '
        'add known_hosts = "/var/lib/hostagent/known_hosts" under [verify.ssh]')


# --- tables of sections ----------------------------------------------------------------


def test_a_table_of_sections_reads_each_under_its_name() -> None:
    read = _table_of(Gpu, "label")
    assert read({"a": {"pci": "01:00.0"}, "b": {"uuid": "GPU-1"}}, "gpus") == {
        "a": Gpu(label="a", pci="0000:01:00.0"), "b": Gpu(label="b", uuid="GPU-1")}
    assert read({}, "gpus") == {}


@pytest.mark.parametrize(("value", "got"), [
    ("gpu-a", "a string"), (["gpu-a"], "an array"), (3, "an integer"),
])
def test_a_table_of_sections_that_is_not_a_table(value: object, got: str) -> None:
    p = problem(_table_of(Gpu, "label"), value, "gpus")
    assert said(p) == ("gpus", f"expected a table, got {got}",
                       "write entries as [gpus.NAME] sections")


def test_a_table_of_sections_that_is_not_a_table_in_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        parse('owners = 3\n' + BASE, "t.toml")
    assert str(info.value) == (
        "t.toml: owners: expected a table, got an integer; write entries as [owners.NAME] sections")


def test_an_entry_that_is_not_a_table() -> None:
    p = problem(_table_of(Owner, "domain"), {"g": 3}, "owners")
    assert said(p) == ("owners.g", "expected a table, got an integer",
                       "write it as a [owners.g] section")
    assert p.salvaged == {}


def test_a_table_of_sections_names_every_problem_and_keeps_what_reads() -> None:
    read = _table_of(Gpu, "label")
    value = {"a": {"pci": "01:00.0"}, "b": {"pci": "x"}, "c d": {"uuid": 1}, "e": {"uuid": "U"}}
    p = problem(read, value, "gpus")
    assert [said(q) for q in p.each] == [
        ("gpus.b.pci", '"x" is not a PCI address',
         'write it as domain:bus:device.function, e.g. "0000:01:00.0" (see lspci -D)'),
        ('gpus."c d".uuid', "expected a string, got an integer", "put the value in double quotes"),
    ]
    assert said(p) == said(p.each[0])
    # Each bad entry reads with its bad keys at their defaults.
    assert p.salvaged == {"a": Gpu(label="a", pci="0000:01:00.0"), "b": Gpu(label="b"),
                          "c d": Gpu(label="c d"), "e": Gpu(label="e", uuid="U")}


def test_an_entry_that_cannot_be_salvaged_is_left_out() -> None:
    read = _table_of(Owner, "domain")
    p = problem(read, {"g": {"start_at_boot": True}, "h": {"gpus": ["gpu-a"]}}, "owners")
    assert said(p) == ("owners.g.gpus", "missing", 'add gpus = ["gpu-a"] under [owners.g]')
    assert p.each == [p]
    assert p.salvaged == {"h": Owner(domain="h", gpus=("gpu-a",))}


def test_one_bad_entry_salvages_the_others() -> None:
    p = problem(_table_of(Gpu, "label"), {"a": {"pci": "zz"}, "b": {"pci": "02:00.0"}}, "gpus")
    assert said(p)[:2] == ("gpus.a.pci", '"zz" is not a PCI address')
    assert p.salvaged == {"a": Gpu(label="a"), "b": Gpu(label="b", pci="0000:02:00.0")}


# --- choices ---------------------------------------------------------------------------


def test_a_choice_reads_into_its_enum() -> None:
    read = _choice(LogLevel)
    for word in ("debug", "info", "warning", "error"):
        level = read(word, "log_level")
        assert type(level) is LogLevel
        assert level == LogLevel(word)


def test_a_choice_not_allowed_lists_the_allowed() -> None:
    p = problem(_choice(LogLevel), "loud", "log_level")
    assert said(p) == ("log_level", '"loud" is not allowed',
                       "write one of: debug, info, warning, error")


def test_a_choice_is_exact() -> None:
    p = problem(_choice(LogLevel), "DEBUG", "log_level")
    assert said(p) == ("log_level", '"DEBUG" is not allowed',
                       "write one of: debug, info, warning, error")


@pytest.mark.parametrize(("value", "said_"), [
    (3, ("expected a string, got an integer", "put the value in double quotes")),
    ("  ", ("is empty", "give it a value or remove the key")),
])
def test_a_choice_that_is_no_text(value: object, said_: tuple[str, str]) -> None:
    assert said(problem(_choice(LogLevel), value, "log_level")) == ("log_level", *said_)


def test_a_choice_in_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        parse('log_level = "loud"\n' + BASE, "t.toml")
    assert str(info.value) == (
        't.toml: log_level: "loud" is not allowed; write one of: debug, info, warning, error')
    assert error('[kubernetes]\ngpu_api = "dra2"\n') == (
        't.toml: kubernetes.gpu_api: "dra2" is not allowed; write one of: '
        + ", ".join(GpuApi))


# --- taints ----------------------------------------------------------------------------

TAINT_FIX = ('write it as kubectl does: "key=value:NoSchedule" (or PreferNoSchedule, '
             'NoExecute)')


@pytest.mark.parametrize("taint", [
    "hostagent.io/borrowed=true:NoSchedule", "k:NoExecute", "k=:PreferNoSchedule",
    "a_b-c.d/e=v.1_2-3:NoSchedule",
])
def test_a_taint(taint: str) -> None:
    assert _taint(taint, "k") == taint
    assert parse(BASE + f'[kubernetes]\nlent_taints = ["{taint}"]\n', "t").kubernetes \
        .lent_taints == (taint,)  # type: ignore[union-attr]


@pytest.mark.parametrize("taint", [
    "k", "k=v", "k=v:noschedule", "k=v:Never", ":NoSchedule", "k=v w:NoSchedule",
    "k=v:NoSchedule ", "k:v:NoSchedule",
])
def test_not_a_taint(taint: str) -> None:
    assert said(problem(_taint, taint, "kubernetes.lent_taints[0]")) == (
        "kubernetes.lent_taints[0]", f'"{taint}" is not a taint', TAINT_FIX)


def test_not_a_taint_in_the_file() -> None:
    assert error('[kubernetes]\nlent_taints = ["k=v:NoSchedule", "oops"]\n') == (
        't.toml: kubernetes.lent_taints[1]: "oops" is not a taint; ' + TAINT_FIX)


def test_a_taint_that_is_no_text() -> None:
    assert said(problem(_taint, "", "t")) == ("t", "is empty", "give it a value or remove the key")


# --- label keys ------------------------------------------------------------------------

LABEL_FIX = 'write e.g. "hostagent.io/borrowed", or "" for no label'


@pytest.mark.parametrize("label", [
    "borrowed", "B", "hostagent.io/borrowed", "hostagent.io/Borrowed", "a/B_c.D-e",
    "nvidia.com/gpu.deploy.device-plugin", "x" * 63, "a.b-c/" + "N" * 63, "0/9",
    "a-b.c-d/e", ("x" * 63 + ".") * 3 + "x" * 61 + "/a",
])
def test_a_label_key(label: str) -> None:
    assert _label_key_or_off(label, "k") == label
    assert _label_key(label, "k") == label


@pytest.mark.parametrize("label", [
    "x" * 64, "a/" + "x" * 64, "-a", "a-", "a b", "Hostagent.io/borrowed", "-a/b", "a./b",
    "a/", "a/b/c", "a_b/c", "a/.b", "/a", "/", "a..b/c", "a.-b/c", "a-.b/c", "a.b./c",
    "x" * 254 + "/a", ".a/b",
])
def test_not_a_label_key(label: str) -> None:
    for read in (_label_key_or_off, _label_key):
        assert said(problem(read, label, "kubernetes.borrowed_label")) == (
            "kubernetes.borrowed_label", f'"{label}" is not a label key', LABEL_FIX)


def test_no_label() -> None:
    assert _label_key_or_off("", "k") is None
    assert said(problem(_label_key, "", "kubernetes.plugin_labels[0]")) == (
        "kubernetes.plugin_labels[0]", "an empty label key",
        'write e.g. "nvidia.com/gpu.deploy.device-plugin"')


def test_a_label_key_that_is_no_text() -> None:
    assert said(problem(_label_key_or_off, 3, "k")) == (
        "k", "expected a string, got an integer", "put the value in double quotes")
    assert said(problem(_label_key, " ", "k")) == (
        "k", "is empty", "give it a value or remove the key")


def test_label_keys_in_the_file() -> None:
    assert error('[kubernetes]\nborrowed_label = "a b"\n') == (
        't.toml: kubernetes.borrowed_label: "a b" is not a label key; ' + LABEL_FIX)
    assert error('[kubernetes]\nplugin_labels = ["nvidia.com/x", ""]\n') == (
        't.toml: kubernetes.plugin_labels[1]: an empty label key; '
        'write e.g. "nvidia.com/gpu.deploy.device-plugin"')
    k = parse(BASE + '[kubernetes]\nborrowed_label = "a.io/Lent"\nplugin_labels = ["x/Y"]\n',
              "t").kubernetes
    assert k is not None
    assert (k.borrowed_label, k.plugin_labels) == ("a.io/Lent", ("x/Y",))


# --- every other reader: a wrong value's whole problem, a right value's whole result -----

DURATION_HINT = 'write a number with a unit, e.g. "500ms", "90s", "2m" or "1h30m"'
COMMAND_LINE = ("is not one command line (a newline or control character)",
                "write one line; join commands with && or put them in a script")
PCI_FIX = 'write it as domain:bus:device.function, e.g. "0000:01:00.0" (see lspci -D)'
LISTEN_FIX = 'write host:port, e.g. "127.0.0.1:9477", "[::1]:9477" or ":9477" for every address'
VERB_FIX = ("write one of status, play, release, hold, resume, lend, reclaim, reserve, "
            'cancel-any, or "reserve:gaming1" for one VM')
SCOPE_FIX = 'only play, release, reserve, cancel-any name a VM: write e.g. "reserve:gaming1"'
EXPECTED_EXAMPLE = '{ "nvidia.com/gpu" = 4 } (the count per lent GPU)'
RESOURCE_FIX = ('write it as `kubectl describe node` lists it under Allocatable, '
                'e.g. "nvidia.com/gpu" or "nvidia.com/mig-1g.10gb"')
SELECTOR_FIX = ('write it as kubectl -l does: "key=value", "key!=value", "key" or "!key", '
                "comma-separated")
BROKER_FIX = 'write e.g. "mqtt://broker.lan" or "mqtts://broker.lan:8883"'
TOPIC_FIX = ('write levels joined by "/", without +, #, spaces or a "/" at either end, '
             'e.g. "hostagent"')
MQTT_FIX = "write some of play, release, hold, lend, reclaim, reserve (its states are published)"
LONG_NAME = "a.io/" + "g" * 248  # 253 characters, the most

WRONG: list[tuple[str, object, str, str, str]] = [
    # reader, value, the problem's key (under "s.k"), what is wrong, the fix
    ("_text", 3, "s.k", "expected a string, got an integer", "put the value in double quotes"),
    ("_text", True, "s.k", "expected a string, got a boolean", "put the value in double quotes"),
    ("_text", " \t", "s.k", "is empty", "give it a value or remove the key"),
    ("_guest_command", 3, "s.k", "expected a string, got an integer",
     "put the command line in double quotes"),
    ("_guest_command", "a\nb", "s.k", *COMMAND_LINE),
    ("_guest_command", "a\x1fb", "s.k", *COMMAND_LINE),
    ("_guest_command", "a\x7fb", "s.k", *COMMAND_LINE),
    ("_guest_command", "x" * 1001, "s.k", "is 1001 characters long (at most 1000)",
     "put the commands in a script in the guest and name it here"),
    ("_absolute_path", "rel/p", "s.k", '"rel/p" is a relative path', "write the full path from /"),
    ("_absolute_path", 1, "s.k", "expected a string, got an integer",
     "put the value in double quotes"),
    ("_optional_path", "p", "s.k", '"p" is a relative path', "write the full path from /"),
    ("_bool", "true", "s.k", "expected true or false, got a string",
     "write true or false, without quotes"),
    ("_bool", 1, "s.k", "expected true or false, got an integer",
     "write true or false, without quotes"),
    ("_duration", 90, "s.k", "expected a duration string, got an integer",
     'write "90s" for seconds (in quotes, with a unit)'),
    ("_duration", 1.5, "s.k", "expected a duration string, got a float",
     'write "1.5s" for seconds (in quotes, with a unit)'),
    ("_duration", True, "s.k", "expected a duration string, got a boolean", DURATION_HINT),
    ("_duration", [], "s.k", "expected a duration string, got an array", DURATION_HINT),
    ("_duration", "90", "s.k", '"90" has no unit; write "90s" for seconds (units: ms, s, m, h)',
     ""),
    ("_duration", " 1.5 ", "s.k",
     '" 1.5 " has no unit; write "1.5s" for seconds (units: ms, s, m, h)', ""),
    ("_duration", "9x", "s.k", f'"9x" is not a duration; {DURATION_HINT}', ""),
    ("_duration", "2m x", "s.k", f'"2m x" is not a duration; {DURATION_HINT}', ""),
    ("_duration", "", "s.k", f'"" is not a duration; {DURATION_HINT}', ""),
    ("_positive_duration", "0s", "s.k", "must be longer than zero", 'e.g. "90s"'),
    ("_positive_duration", 5, "s.k", "expected a duration string, got an integer",
     'write "5s" for seconds (in quotes, with a unit)'),
    ("_optional_duration", "90", "s.k",
     '"90" has no unit; write "90s" for seconds (units: ms, s, m, h)', ""),
    ("_annotation_prefix", "a.io", "s.k", '"a.io" does not end with "/"', 'write "a.io/"'),
    ("_pci", "01:00", "s.k", '"01:00" is not a PCI address', PCI_FIX),
    ("_pci", "0000:01:20.0", "s.k", '"0000:01:20.0" is not a PCI address', PCI_FIX),
    ("_pci", "01:00.8", "s.k", '"01:00.8" is not a PCI address', PCI_FIX),
    ("_pci", "", "s.k", "is empty", "give it a value or remove the key"),
    ("_count", "3", "s.k", "expected an integer, got a string",
     "write a whole number without quotes"),
    ("_count", True, "s.k", "expected an integer, got a boolean",
     "write a whole number without quotes"),
    ("_port", 0, "s.k", "0 is not a TCP port", "write a number from 1 to 65535"),
    ("_port", 65536, "s.k", "65536 is not a TCP port", "write a number from 1 to 65535"),
    ("_port", "22", "s.k", "expected an integer, got a string",
     "write the port number without quotes"),
    ("_port", False, "s.k", "expected an integer, got a boolean",
     "write the port number without quotes"),
    ("_listen", "localhost", "s.k", '"localhost" is not an address to listen on', LISTEN_FIX),
    ("_listen", ":0", "s.k", '":0" is not an address to listen on', LISTEN_FIX),
    ("_listen", ":65536", "s.k", '":65536" is not an address to listen on', LISTEN_FIX),
    ("_listen", "a b:1", "s.k", '"a b:1" is not an address to listen on', LISTEN_FIX),
    ("_listen", 3, "s.k", "expected a string, got an integer", "put the value in double quotes"),
    ("_listen_or_port", 0, "s.k", "0 is not a TCP port", "write a number from 1 to 65535"),
    ("_listen_or_port", "", "s.k", "is empty",
     'write host:port, e.g. "0.0.0.0:2222", or a port number'),
    ("_listen_or_port", "x", "s.k", '"x" is not an address to listen on', LISTEN_FIX),
    ("_listen_or_port", True, "s.k", "expected a string, got a boolean",
     "put the value in double quotes"),
    ("_control_verb", "fly", "s.k", '"fly" is not a control verb', VERB_FIX),
    ("_control_verb", "fly:g", "s.k", '"fly:g" is not a control verb', VERB_FIX),
    ("_control_verb", "status:g", "s.k", '"status:g" does not scope a verb to a VM', SCOPE_FIX),
    ("_control_verb", "hold:g", "s.k", '"hold:g" does not scope a verb to a VM', SCOPE_FIX),
    ("_control_verb", "play:", "s.k", '"play:" does not scope a verb to a VM', SCOPE_FIX),
    ("_control_verb", "play:a b", "s.k", '"play:a b" does not scope a verb to a VM', SCOPE_FIX),
    ("_group", "1abc", "s.k", '"1abc" is not a group name', 'write a name, e.g. "hostagent"'),
    ("_group", "a" * 33, "s.k", f'"{"a" * 33}" is not a group name',
     'write a name, e.g. "hostagent"'),
    ("_expected", 4, "s.k", "expected a table, got an integer",
     f"write it as an inline table: {EXPECTED_EXAMPLE}"),
    ("_expected", {}, "s.k", "is empty",
     f"name at least one resource, e.g. {EXPECTED_EXAMPLE}, "
     "or remove the key to read it from the node's labels"),
    ("_expected", {"gpu": 1}, "s.k.gpu", '"gpu" is not an extended resource name', RESOURCE_FIX),
    ("_expected", {"a.io/g": 0}, 's.k."a.io/g"', "0 is not a count",
     "write 1 or more, or remove it"),
    ("_expected", {"a.io/g": "1"}, 's.k."a.io/g"', "expected an integer, got a string",
     "write a whole number without quotes"),
    ("_expected", {LONG_NAME + "g": 1}, f's.k."{LONG_NAME}g"',
     f'"{LONG_NAME}g" is not an extended resource name', RESOURCE_FIX),
    ("_label_selector", "a b", "s.k", '"a b" is not a label selector', SELECTOR_FIX),
    ("_label_selector", "a=b,", "s.k", '"a=b," is not a label selector', SELECTOR_FIX),
    ("_label_selector", "a=b c", "s.k", '"a=b c" is not a label selector', SELECTOR_FIX),
    ("_broker", "http://b", "s.k", '"http://b" is not a broker URL', BROKER_FIX),
    ("_broker", "mqtt://", "s.k", '"mqtt://" is not a broker URL', BROKER_FIX),
    ("_broker", "mqtt://u:p@b", "s.k", "the URL carries a user or password",
     "remove it: set username and password_file under [mqtt]"),
    ("_broker", "mqtt://u@b", "s.k", "the URL carries a user or password",
     "remove it: set username and password_file under [mqtt]"),
    ("_broker", "mqtt://b/x", "s.k", '"mqtt://b/x" has a path', BROKER_FIX),
    ("_broker", "mqtt://b/X", "s.k", '"mqtt://b/X" has a path', BROKER_FIX),  # only "/" stripped
    ("_broker", "mqtt://b?x=1", "s.k", '"mqtt://b?x=1" has a path', BROKER_FIX),
    ("_broker", "mqtt://b#f", "s.k", '"mqtt://b#f" has a path', BROKER_FIX),
    ("_broker", "mqtt://b:0", "s.k", '"mqtt://b:0" has port 0', "write a port from 1 to 65535"),
    ("_broker", "mqtt://b:99999", "s.k", '"mqtt://b:99999" is not a broker URL', BROKER_FIX),
    ("_broker", "mqtt://b:x", "s.k", '"mqtt://b:x" is not a broker URL', BROKER_FIX),
    ("_topic", "a/+/b", "s.k", '"a/+/b" is not a topic prefix', TOPIC_FIX),
    ("_topic", "/a", "s.k", '"/a" is not a topic prefix', TOPIC_FIX),
    ("_topic", "a/", "s.k", '"a/" is not a topic prefix', TOPIC_FIX),
    ("_topic", "a b", "s.k", '"a b" is not a topic prefix', TOPIC_FIX),
    ("_topic", "a#", "s.k", '"a#" is not a topic prefix', TOPIC_FIX),
    ("_topic", "x" * 129, "s.k", f'"{"x" * 64}" is not a topic prefix', TOPIC_FIX),
    ("_mqtt_verb", "status", "s.k", '"status" is not a verb MQTT can command', MQTT_FIX),
    ("_mqtt_verb", "x", "s.k", '"x" is not a verb MQTT can command', MQTT_FIX),
]


@pytest.mark.parametrize(("reader", "value", "key", "what", "fix"), WRONG)
def test_a_wrong_value_says_what_and_how_to_fix_it(
        reader: str, value: object, key: str, what: str, fix: str) -> None:
    p = problem(getattr(config_read, reader), value, "s.k")
    assert said(p) == (key, what, fix)
    assert (str(p), p.each, p.salvaged) == (what, [p], None)


RIGHT: list[tuple[str, object, object]] = [
    ("_text", " a ", " a "),
    ("_guest_command", "  nvidia-smi -L  ", "nvidia-smi -L"),
    ("_guest_command", "", ""),
    ("_guest_command", "x" * 1000, "x" * 1000),
    ("_guest_command", "~ é", "~ é"),
    ("_absolute_path", "/a/b", Path("/a/b")),
    ("_optional_path", "", None),
    ("_optional_path", "/a", Path("/a")),
    ("_bool", False, False),
    ("_bool", True, True),
    ("_duration", "1h30m", 5400.0),
    ("_duration", "1h30m500ms", 5400.5),
    ("_duration", "500ms", 0.5),
    ("_duration", "0s", 0.0),
    ("_duration", " 2m ", 120.0),
    ("_duration", "1.5m", 90.0),
    ("_positive_duration", "1ms", 0.001),
    ("_optional_duration", "", None),
    ("_optional_duration", "2m", 120.0),
    ("_annotation_prefix", "a.io/", "a.io/"),
    ("_pci", "01:00.0", "0000:01:00.0"),
    ("_pci", " 0000:0A:1f.7 ", "0000:0a:1f.7"),
    ("_pci", "abcd:ef:01.1", "abcd:ef:01.1"),
    ("_count", 0, 0),
    ("_count", -1, -1),
    ("_port", 1, 1),
    ("_port", 65535, 65535),
    ("_listen", "", None),
    ("_listen", " 127.0.0.1:9477 ", "127.0.0.1:9477"),
    ("_listen", "[::1]:1", "[::1]:1"),
    ("_listen", ":65535", ":65535"),
    ("_listen_or_port", 2222, ":2222"),
    ("_listen_or_port", "h:1", "h:1"),
    ("_control_verb", "reserve:gaming1", "reserve:gaming1"),
    ("_control_verb", "play:g", "play:g"),
    ("_control_verb", "release:g", "release:g"),
    ("_control_verb", "cancel-any", "cancel-any"),
    ("_control_verb", "cancel-any:g.1_-", "cancel-any:g.1_-"),
    ("_control_verb", "status", "status"),
    ("_control_verbs", ["status"], frozenset({"status"})),
    ("_control_verbs", ["resume"], frozenset({"resume", "lend"})),
    ("_control_verbs", ["lend", "play"], frozenset({"play", "lend", "resume"})),
    ("_group", "_a.b-c", "_a.b-c"),
    ("_group", "a" * 32, "a" * 32),
    ("_expected", {"nvidia.com/mig-1g.10gb": 7, "a.io/g": 1},
     {"nvidia.com/mig-1g.10gb": 7, "a.io/g": 1}),
    ("_expected", {LONG_NAME: 2}, {LONG_NAME: 2}),
    ("_label_selector", "a=b,c!=d,e==f,!g,h,i=", "a=b,c!=d,e==f,!g,h,i="),
    ("_broker", "mqtts://b.lan:8883", "mqtts://b.lan:8883"),
    ("_broker", "mqtt://b/", "mqtt://b/"),
    ("_topic", "a/b", "a/b"),
    ("_topic", "x" * 128, "x" * 128),
    ("_mqtt_verb", "resume", "lend"),
    ("_mqtt_verb", "cancel-any", "cancel-any"),
    ("_mqtt_verb", "play", "play"),
]


@pytest.mark.parametrize(("reader", "value", "read"), RIGHT)
def test_a_right_value_reads_whole(reader: str, value: object, read: object) -> None:
    got = getattr(config_read, reader)(value, "s.k")
    assert (got, type(got)) == (read, type(read))


# --- lists -----------------------------------------------------------------------------

def pcis() -> Callable[[object, str], tuple[Any, ...]]:
    """Made inside each test: a reader made at import escapes make mutate's mutants."""
    return _list(_pci, at_least_one="list some")


@pytest.mark.parametrize(("value", "problems"), [
    ("01:00.0", [("s.k", "expected an array, got a string",
                  'write it in brackets: ["01:00.0"]')]),
    (3, [("s.k", "expected an array, got an integer", "write it in brackets: [...]")]),
    ([], [("s.k", "is empty", "list some")]),
    (["x", 1, "02:00.0"], [("s.k[0]", '"x" is not a PCI address', PCI_FIX),
                           ("s.k[1]", "expected a string, got an integer",
                            "put the value in double quotes")]),
    (["01:00.0", "02:00.0", "0000:01:00.0"],
     [("s.k[2]", '"0000:01:00.0" is listed twice', "remove one")]),
])
def test_a_wrong_list_names_each_item(value: object, problems: list[tuple[str, ...]]) -> None:
    p = problem(pcis(), value, "s.k")
    assert [said(q) for q in p.each] == problems
    assert said(p) == problems[0]


def test_a_list_reads_each_item() -> None:
    assert pcis()(["01:00.0", "02:00.0"], "s.k") == ("0000:01:00.0", "0000:02:00.0")
    assert _list(_pci)([], "s.k") == ()


# --- the pieces under them -------------------------------------------------------------


def test_keys_are_joined_as_toml_writes_them() -> None:
    assert [_join("", "a"), _join("a", "b c"), _join("a", "b-_9"), _join("", "x.y")] == [
        "a", 'a."b c"', "a.b-_9", '"x.y"']


def test_listen_addresses_split() -> None:
    assert _split_listen(" [::1]:80 ") == ("::1", 80)
    assert _split_listen(":1") == ("", 1)
    assert _split_listen("h:65535") == ("h", 65535)
    assert _split_listen("Xbox-X:9477") == ("Xbox-X", 9477)  # only brackets are stripped
    assert [_split_listen(t) for t in ("h:0", "h:65536", "a b:1", "h")] == [None] * 4


def test_durations() -> None:
    assert parse_duration("1h30m500ms") == 5400.5
    with pytest.raises(ValueError) as info:
        parse_duration("5")
    assert str(info.value) == '"5" has no unit; write "5s" for seconds (units: ms, s, m, h)'


def test_gathered_problems_go_on_to_the_next_key() -> None:
    problems: list[_Problem] = []
    first, second = _Problem("a", "x"), _Problem("b", "y")
    with _gather(problems):
        raise first
    with _gather(problems):
        raise _Problems([second, first])
    with _gather(problems):
        pass
    assert problems == [first, second, first]
    _raise_any([])
    with pytest.raises(_Problem) as info:
        _raise_any([first], "kept")
    assert (info.value, info.value.salvaged) == (first, "kept")
    with pytest.raises(_Problems) as several:
        _raise_any([first, second])
    assert (several.value.each, several.value.salvaged) == ([first, second], None)
