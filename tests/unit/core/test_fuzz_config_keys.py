"""Bad values, fuzzed on purpose, key by key: each must be refused, naming its key.

`test_fuzz_config.py` breaks the example file at random and checks the message of any
refusal; a validation removed there still passes, since an accepted file asserts
nothing. Here each example sets one key of the documented example to a value that is
wrong for it (the wrong type, out of range, not one of its choices, not a duration) and
requires the refusal, its problem naming that key; a value that is right for it must be
accepted. Every key the configuration reads is listed (`test_every_key_is_fuzzed`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import string
import textwrap
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostagent.core import config
from hostagent.core.config import ConfigError
from hostagent.core.config_notify import Notify
from hostagent.core.levers import DrainPolicy
from hostagent.core.config_read import _READ

EXAMPLES = int(os.environ.get("HOSTAGENT_FUZZ_EXAMPLES", "2_000"))

assert config.__doc__ is not None
EXAMPLE = textwrap.dedent(config.__doc__.split("::\n", 1)[1].split("\nRules", 1)[0])
VALID = {**tomllib.loads(EXAMPLE), "notify": {"url": "http://hooks.lan/x"}}  # its url is required

INT64 = st.integers(-(2**63), 2**63 - 1)
WORD = st.text(string.ascii_letters + string.digits + "-_.", min_size=1, max_size=12)
NOT_A_STRING = st.one_of(INT64, st.booleans(), st.floats(allow_nan=False),
                         st.lists(st.just("x"), max_size=2))


def _enum(*allowed: str) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    bad = st.one_of(st.text(max_size=12).filter(lambda s: s not in allowed),
                    st.sampled_from([a.upper() for a in allowed] + [f" {a}" for a in allowed]),
                    NOT_A_STRING)
    return bad, st.sampled_from(allowed)


UNIT = st.sampled_from(["ms", "s", "m", "h"])
SOME_TIME = st.builds(lambda n, u: f"{n}{u}", st.integers(1, 10**6), UNIT) | st.just("1h30m")
NOT_A_DURATION = st.one_of(
    INT64, st.booleans(), st.floats(allow_nan=False), st.lists(st.just("1s"), min_size=1),
    st.sampled_from(["30", "2.5", "-5s", "5 parsecs", "1h30", "s", "m5", "1x", "1 d"]),
    st.text(string.ascii_letters + " ", min_size=1, max_size=8).filter(
        lambda s: s.strip() not in ("",)),
)
ZERO = st.sampled_from(["0s", "0ms", "0m", "0h", "0.0s"])

# A kind of key: (values it must refuse, values it must accept).
DURATION = (NOT_A_DURATION | st.just(""), SOME_TIME | ZERO)
POSITIVE_DURATION = (NOT_A_DURATION | ZERO | st.just(""), SOME_TIME)
OPTIONAL_DURATION = (NOT_A_DURATION, SOME_TIME | ZERO | st.just(""))
# A number of weeks of history: 1 to 52.
WEEKS = (st.one_of(st.integers(-(2**63), 0), st.integers(53, 2**63 - 1), st.booleans(),
                   st.sampled_from(["3", 3.0])), st.integers(1, 4))
BOOL = (st.one_of(INT64, st.text(max_size=6), st.sampled_from(["true", "false"])),
        st.booleans())
PORT = (st.one_of(st.integers(-(2**63), 0), st.integers(65536, 2**63 - 1), st.booleans(),
                  st.sampled_from(["22", "ssh", ""])), st.integers(1, 65535))
ABSOLUTE = st.builds(lambda parts: "/" + "/".join(parts), st.lists(WORD, max_size=3))
RELATIVE = st.builds("/".join, st.lists(WORD, min_size=1, max_size=3))
PATH = (st.one_of(RELATIVE, NOT_A_STRING, st.sampled_from(["", " "])), ABSOLUTE)
OPTIONAL_PATH = (st.one_of(RELATIVE, NOT_A_STRING, st.just(" ")), ABSOLUTE | st.just(""))
TEXT = (st.one_of(NOT_A_STRING, st.sampled_from(["", "   ", "\t"])),
        st.text(min_size=1, max_size=20).filter(str.strip))
NAME = (TEXT[0], WORD.filter(lambda s: s not in ("gaming1", "gaming2", "gaming-win")))
HOST_PORT = st.builds(lambda host, port: f"{host}:{port}",
                      st.sampled_from(["", "127.0.0.1", "0.0.0.0", "[::1]", "gpu-node.lan"]),
                      st.integers(1, 65535))
BAD_PORT_NUMBER = st.integers(65536, 10**9) | st.just(0)
BAD_HOST_PORT = st.one_of(
    st.builds(lambda host, port: f"{host}:{port}",
              st.sampled_from(["", "127.0.0.1", "[::1]"]), BAD_PORT_NUMBER),
    st.sampled_from(["host", "127.0.0.1", "1.2.3.4:", "a b:80", ":http", "[::1:80"]))
LISTEN = (BAD_HOST_PORT | NOT_A_STRING, HOST_PORT | st.just(""))
LISTEN_OR_PORT = (BAD_HOST_PORT | st.integers(-(2**63), 0) | st.integers(65536, 2**63 - 1)
                  | st.sampled_from(["", " "]), HOST_PORT | st.integers(1, 65535))
TOPIC = (st.one_of(NOT_A_STRING, st.sampled_from(["", "a/+/b", "a/#", "/a", "a/", "a b",
                                                   "a//b", "x" * 129])),
         st.lists(WORD, min_size=1, max_size=3).map("/".join))


def _strings(bad: list[str], ok: list[str]) -> tuple[st.SearchStrategy[Any],
                                                     st.SearchStrategy[Any]]:
    return st.sampled_from(bad) | NOT_A_STRING, st.sampled_from(ok)


def _lists(item_bad: st.SearchStrategy[Any], item_ok: st.SearchStrategy[Any], *,
           empty_ok: bool = True) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    """Arrays: not an array, or one with a bad item among good ones."""
    bad = st.one_of(
        st.one_of(st.text(max_size=8), INT64, st.booleans()),
        st.tuples(st.lists(item_ok, max_size=2, unique=True), item_bad).map(
            lambda t: [*t[0], t[1]]))
    if not empty_ok:
        bad = bad | st.just([])
    return bad, st.lists(item_ok, min_size=0 if empty_ok else 1, max_size=3, unique=True)


GPU_REFS = _lists(st.sampled_from(["gpu-z", "0000:01:00.1", "01:00", "GPU"]) | INT64,
                  st.sampled_from(["gpu-a", "gpu-b", "gpu-c"]), empty_ok=False)

# Every key the configuration reads (a [gpus.*] or [owners.*] entry stands for all),
# and what it must refuse and accept.
KINDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "libvirt_uri": TEXT,
    "hook_socket": PATH,
    "control_socket": PATH,
    "control_group": _strings(["", "bad group", "1abc", "x" * 33, "a:b"], ["hostagent", "_x"]),
    "control_verbs": _lists(st.sampled_from(["fly", "STATUS", "", "reserve:nobody"]) | INT64,
                            st.sampled_from(["status", "hold", "resume", "reserve:gaming1"])),
    "state_dir": PATH,
    "log_level": _enum("debug", "info", "warning", "error"),
    "lendee.domain": NAME,
    "lendee.node": TEXT,
    "lendee.gpus": GPU_REFS,
    "lendee.min_gpus": (st.one_of(st.integers(-(2**63), 0), st.integers(4, 2**63 - 1),
                                  st.booleans(), st.sampled_from(["1", 1.0])),
                        st.integers(1, 3)),
    "lendee.cdi_refresh": (st.one_of(NOT_A_STRING, st.sampled_from(["a\nb", "x\x00", "\x7f"]),
                                     st.just("x" * 1001)),
                           st.text(string.printable.strip() + " ", max_size=40)),
    "gpus.*.pci": _strings(["01:00", "0000:01:00", "zz:00.0", "0000:01:00.8", "", "gpu-a"],
                           ["0000:0a:00.0", "0a:00.0", "0000:0A:00.0"]),
    "gpus.*.functions": _lists(st.sampled_from(["01:00", "x", ""]) | INT64,
                               st.sampled_from(["0000:0a:00.1", "0000:0a:00.2"])),
    "gpus.*.uuid": TEXT,
    "gpus.*.name": TEXT,
    "owners.*.gpus": GPU_REFS,
    "owners.*.start_at_boot": BOOL,
    "timeouts.guest_agent": POSITIVE_DURATION,
    "timeouts.shutdown": POSITIVE_DURATION,
    "timeouts.start": POSITIVE_DURATION,
    "timeouts.drain": POSITIVE_DURATION,
    "timeouts.ready": POSITIVE_DURATION,
    "timeouts.release": POSITIVE_DURATION,
    "policy.relend_delay": DURATION,
    "policy.force_off_after": OPTIONAL_DURATION,
    "policy.on_drain_timeout": _enum("proceed", "abort"),
    "policy.lint_before_start": BOOL,
    "policy.partial": BOOL,
    "policy.regrow": _enum("when-idle", "always", "never"),
    "policy.regrow_max_wait": OPTIONAL_DURATION,
    "policy.hotplug": _enum("auto", "none", "add", "both"),
    "policy.reserve_lead": DURATION,
    "policy.reserve_margin": DURATION,
    "policy.reserve_expiry": POSITIVE_DURATION,
    "policy.reserve_cooldown": DURATION,
    "verify.method": _enum("guest-agent", "ssh", "none"),
    "verify.command": TEXT,
    "verify.timeout": POSITIVE_DURATION,
    "verify.ssh.host": TEXT,
    "verify.ssh.port": PORT,
    "verify.ssh.user": TEXT,
    "verify.ssh.key": PATH,
    "verify.ssh.known_hosts": PATH,
    "kubernetes.kubeconfig": OPTIONAL_PATH,
    "kubernetes.annotation_prefix": _strings(["hostagent.io", "", "x"], ["hostagent.io/", "a/"]),
    "kubernetes.gpu_resource": TEXT,
    "kubernetes.gpu_api": _enum("auto", "device-plugin", "dra"),
    "kubernetes.dra_driver": TEXT,
    "kubernetes.drain_emptydir": BOOL,
    "kubernetes.drain_unmanaged": BOOL,
    "kubernetes.lent_taints": _lists(
        st.sampled_from(["x", "a=b", "a=b:Sometimes", "a b:NoSchedule"]) | INT64,
        st.sampled_from(["a=b:NoSchedule", "k:NoExecute", "x.io/y=1:PreferNoSchedule"])),
    "kubernetes.evict_retry": POSITIVE_DURATION,
    "kubernetes.borrowed_label": _strings(["not a label", "a/b/c", "-x"],
                                          ["", "hostagent.io/borrowed", "borrowed"]),
    "kubernetes.expected": (
        st.one_of(INT64, st.text(max_size=5), st.just({}),
                  st.fixed_dictionaries({"nvidia.com/gpu": st.integers(-(2**63), 0)
                                         | st.just("4")}),
                  st.fixed_dictionaries({"gpu": st.integers(1, 8)})),
        st.fixed_dictionaries({"nvidia.com/gpu": st.integers(1, 64)})),
    "kubernetes.grace_period": OPTIONAL_DURATION,
    "kubernetes.skip_wait_for_delete_timeout": DURATION,
    "kubernetes.plugin_selectors": _lists(st.sampled_from(["", "a b", "=x", "a=b=c"]) | INT64,
                                          st.sampled_from(["app=x", "name=nvidia-plugin"])),
    "kubernetes.plugin_labels": _lists(st.sampled_from(["", "a b", "a/b/c"]) | INT64,
                                       st.sampled_from(["nvidia.com/gpu.deploy.dcgm", "x"])),
    "metrics.listen": LISTEN,
    "ssh.listen": LISTEN_OR_PORT,
    "ssh.host_key": PATH,
    "ssh.authorized_keys": PATH,
    "mqtt.broker": _strings(["http://x", "mqtts://x:99999", "mqtts://x:0", "mqtts://u:p@x",
                             "mqtts://x/topic", "mqtts://", "", "x"],
                            ["mqtts://broker.lan", "mqtts://[::1]:8883", "mqtts://b:1"]),
    "mqtt.ca": PATH,
    "mqtt.username": TEXT,
    "mqtt.password_file": PATH,
    "mqtt.discovery_prefix": TOPIC,
    "mqtt.base_topic": TOPIC,
    "mqtt.verbs": _lists(st.sampled_from(["fly", "PLAY", "status", ""]) | INT64,
                         st.sampled_from(["play", "release", "reserve", "hold"])),
    "mqtt.vms": _lists(st.sampled_from(["nobody", "gpu-node", ""]) | INT64,
                       st.sampled_from(["gaming1", "gaming2", "gaming-win"])),
    "mqtt.per_entity": BOOL,
    "lendee.kubeconfig": OPTIONAL_PATH,
    "drain.unplanned_grace": OPTIONAL_DURATION,
    "drain.shutdown_when": _enum("accepted", "gone"),
    "drain.cordon_ahead": BOOL,
    "drain.ahead_lead": DURATION,
    "drain.usual_weeks": WEEKS,
    "drain.usual_of": WEEKS,
    "drain.stop": _enum("shutdown", "power-off"),
    "notify.url": _strings(["ftp://x", "http://", "hooks.lan", "", "http://a b/", "http://x:y/"],
                           ["http://hooks.lan/x", "https://[::1]:8443/h?token=abc"]),
    "notify.timeout": (NOT_A_DURATION | ZERO | st.sampled_from(["11s", "1m", ""]),
                       st.sampled_from(["1s", "2s", "500ms", "10s"])),
}


def _fields(cls: type[Any], prefix: str) -> Iterator[str]:
    """Every key `cls` reads, sections walked (their own names not listed)."""
    hints = {"gpus": (config.Gpu, "gpus.*"), "owners": (config.Owner, "owners.*")}
    for f in dataclasses.fields(cls):
        if _READ not in f.metadata:
            continue
        key = f"{prefix}{f.name}"
        if not prefix and f.name in hints:
            inner, where = hints[f.name]
            yield from _fields(inner, f"{where}.")
            continue
        kind = {"lendee": config.Lendee, "timeouts": config.Timeouts,
                "policy": config.Policy, "verify": config.Verify, "ssh": config.SshEndpoint,
                "kubernetes": config.Kubernetes, "metrics": config.Metrics,
                "mqtt": config.Mqtt, "drain": DrainPolicy, "notify": Notify}.get(key) \
            or ({"verify.ssh": config.Ssh}.get(key))
        if key == "lendees":  # [lendees.NAME]: the keys of [lendee], fuzzed there
            continue
        if kind is not None:
            yield from _fields(kind, f"{key}.")
        else:
            yield key


def test_every_key_is_fuzzed() -> None:
    assert sorted(_fields(config.Config, "")) == sorted(KINDS)


def _with(key: str, value: Any) -> dict[str, Any]:
    """The example with `key` set to `value` (``gpus.*``: gpu-a's; ``owners.*``: gaming1's)."""
    doc = copy.deepcopy(VALID)
    *path, name = key.replace("gpus.*", "gpus.gpu-a").replace("owners.*", "owners.gaming1") \
        .split(".")
    if path[:2] == ["verify", "ssh"]:
        path = ["verify", "ssh"]
    table = doc
    for part in path:
        table = table.setdefault(part, {})
    table[name] = value
    return doc


def _refusals(doc: dict[str, Any]) -> tuple[ConfigError, ...]:
    try:
        config.parse(tomli_w.dumps(doc), "fuzz.toml")
    except ConfigError as e:
        return e.problems
    return ()


def _names(key: str, problem: ConfigError) -> bool:
    actual = key.replace("gpus.*", "gpus.gpu-a").replace("owners.*", "owners.gaming1")
    return problem.key is not None and (problem.key == actual or problem.key.startswith(
        (f"{actual}[", f"{actual}.")))


# Each key drawn as often as the next: its share of the examples, at least 25.
per_key = settings(max_examples=max(25, EXAMPLES // len(KINDS)), deadline=None,
                   suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("key", sorted(KINDS))
@per_key
@given(data=st.data())
def test_a_bad_value_is_refused_naming_its_key(key: str, data: st.DataObject) -> None:
    value = data.draw(KINDS[key][0], label="bad value")
    problems = _refusals(_with(key, value))
    assert problems, f"{key} = {value!r} was accepted"
    named = [p for p in problems if _names(key, p)]
    assert named, f"{key} = {value!r}: refused, but not naming it: {problems[0]}"
    assert str(named[0]).startswith(f"fuzz.toml: {named[0].key}: "), str(named[0])


@pytest.mark.parametrize("key", sorted(KINDS))
@per_key
@given(data=st.data())
def test_a_good_value_is_accepted(key: str, data: st.DataObject) -> None:
    value = data.draw(KINDS[key][1], label="good value")
    problems = _refusals(_with(key, value))
    assert not problems, f"{key} = {value!r} refused: {problems[0]}"
