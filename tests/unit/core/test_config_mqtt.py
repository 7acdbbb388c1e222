"""The [mqtt] section: the broker, the credential, the topics and what MQTT may command."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostagent.core.config import ConfigError, parse

MINIMAL = """
[lendee]
domain = "gpu-node"
gpus = ["0000:01:00.0"]

[owners.gaming1]
gpus = ["0000:01:00.0"]
"""


def test_off_unless_configured() -> None:
    assert parse(MINIMAL).mqtt is None


def test_defaults_and_values() -> None:
    cfg = parse(MINIMAL + '[mqtt]\nbroker = "mqtt://broker.lan"\n')
    assert cfg.mqtt is not None
    assert cfg.mqtt.address == ("broker.lan", 1883) and not cfg.mqtt.tls
    # base_topic: None, "hostagent/<the host's name>" (homeassistant.surface).
    assert (cfg.mqtt.discovery_prefix, cfg.mqtt.base_topic) == ("homeassistant", None)
    assert cfg.mqtt.verbs == {"play", "release", "hold", "lend", "reclaim", "reserve"}
    assert cfg.mqtt.vms is None and cfg.mqtt.password_file is None
    cfg = parse(MINIMAL + '[mqtt]\nbroker = "mqtts://[::1]"\nca = "/etc/ca.pem"\n'
                'username = "ha"\npassword_file = "/run/credentials/x/mqtt-password"\n'
                'base_topic = "home/gpus"\nverbs = ["resume"]\nvms = ["gaming1"]\n')
    assert cfg.mqtt is not None
    assert cfg.mqtt.address == ("::1", 8883) and cfg.mqtt.tls
    assert cfg.mqtt.ca == Path("/etc/ca.pem") and cfg.mqtt.username == "ha"
    assert cfg.mqtt.verbs == {"lend"} and cfg.mqtt.vms == ("gaming1",)


@pytest.mark.parametrize(("section", "expected"), [
    ("", 'test.toml: mqtt.broker: missing; add broker = "mqtt://broker.lan" under [mqtt]'),
    ('broker = "http://x"', 'test.toml: mqtt.broker: "http://x" is not a broker URL; write e.g. "mqtt://broker.lan" or "mqtts://broker.lan:8883"'),
    ('broker = "mqtt://x:99999"', 'test.toml: mqtt.broker: "mqtt://x:99999" is not a broker URL; write e.g. "mqtt://broker.lan" or "mqtts://broker.lan:8883"'),
    ('broker = "mqtt://ha:secret@x"', "test.toml: mqtt.broker: the URL carries a user or password; remove it: set username and password_file under [mqtt]"),
    ('broker = "mqtt://x/topic"', 'test.toml: mqtt.broker: "mqtt://x/topic" has a path; write e.g. "mqtt://broker.lan" or "mqtts://broker.lan:8883"'),
    ('broker = "mqtt://x"\nca = "/ca.pem"', "test.toml: mqtt.ca: set, but the broker URL is mqtt:// (no TLS); write the broker as mqtts://... or remove ca"),
    ('broker = "mqtt://x"\npassword_file = "secret"', 'test.toml: mqtt.password_file: "secret" is a relative path; write the full path from /'),
    ('broker = "mqtt://x"\nbase_topic = "a/+/b"', 'test.toml: mqtt.base_topic: "a/+/b" is not a topic prefix; write levels joined by "/", without +, #, spaces or a "/" at either end, e.g. "hostagent"'),
    ('broker = "mqtt://x"\ndiscovery_prefix = "/ha"', 'test.toml: mqtt.discovery_prefix: "/ha" is not a topic prefix; write levels joined by "/", without +, #, spaces or a "/" at either end, e.g. "hostagent"'),
    ('broker = "mqtt://x"\nverbs = ["status"]', 'test.toml: mqtt.verbs[0]: "status" is not a verb MQTT can command; write some of play, release, hold, lend, reclaim, reserve (its states are published)'),
    ('broker = "mqtt://x"\nvms = ["gpu-node"]', 'test.toml: mqtt.vms[0]: "gpu-node" is not an owner VM; list some of gaming1'),
    ('broker = "mqtt://x"\npassword = "x"', 'test.toml: mqtt.password: unknown key; did you mean "password_file"?'),
])
def test_mistakes(section: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(MINIMAL + "[mqtt]\n" + section + "\n", "test.toml")
    assert str(e.value) == expected


def test_check_config_warns_of_a_base_topic_two_hosts_would_share(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hostagent import cli
    monkeypatch.setattr("socket.gethostname", lambda: "tower.lan")
    path = tmp_path / "config.toml"

    def warnings(mqtt: str) -> list[str]:
        path.write_text(MINIMAL + '[mqtt]\nbroker = "mqtt://broker.lan"\n' + mqtt)
        assert cli.main(["--config", str(path), "check-config"]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "mqtt." in line]

    # The default names the host; one set by hand that does not is what two share.
    assert warnings("") == []
    shared = warnings('base_topic = "hostagent"\n')
    assert len(shared) == 1 and 'mqtt.base_topic = "hostagent" does not name this host' in \
        shared[0] and "same device id (hostagent) and topics" in shared[0] and \
        'Fix: leave base_topic out (its default is "hostagent/tower").' in shared[0], shared
    assert warnings('base_topic = "hostagent/tower"\n') == []
    overlap = warnings('base_topic = "homeassistant/tower"\n')
    assert len(overlap) == 1 and "overlap" in overlap[0], overlap
