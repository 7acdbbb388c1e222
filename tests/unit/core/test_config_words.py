"""The words an operator reads when a configuration value is wrong: each reader's whole
message (the key, what is wrong, the fix) and each right value's whole result.

The readers made by a factory (`_choice`, `_section`, `_table_of`, `_key`) are also made
here, inside the tests, rather than only taken from the configuration's dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.core.config import ConfigError, Gpu, GpuApi, LogLevel, Owner, Ssh, parse
from hostagent.core.config_read import (
    _EXAMPLE,
    _READ,
    _choice,
    _example,
    _key,
    _label_key,
    _label_key_or_off,
    _Problem,
    _Problems,
    _section,
    _table_of,
    _taint,
    _text,
    _toml_type,
    _wrong_type,
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
])
def test_a_label_key(label: str) -> None:
    assert _label_key_or_off(label, "k") == label
    assert _label_key(label, "k") == label


@pytest.mark.parametrize("label", [
    "x" * 64, "a/" + "x" * 64, "-a", "a-", "a b", "Hostagent.io/borrowed", "-a/b", "a./b",
    "a/", "a/b/c", "a_b/c", "a/.b",
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
