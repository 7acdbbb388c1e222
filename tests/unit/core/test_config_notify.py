"""The ``[notify]`` section (`hostagent.core.config_notify`): a URL told before each drain
and how long the drain waits for it, at most 10 s."""

from __future__ import annotations

import pytest

from hostagent.core.config import ConfigError, parse
from hostagent.core.config_notify import MAX_TIMEOUT, Notify
from tests.configs import lendee_toml

URL = 'url = "http://hooks.lan/x"\n'


def test_the_timeout_is_read_up_to_its_limit() -> None:
    cfg = parse(lendee_toml(uuids=False) + "[notify]\n" + URL + 'timeout = "10s"\n')
    assert cfg.notify == Notify(url="http://hooks.lan/x", timeout=MAX_TIMEOUT)
    assert parse(lendee_toml(uuids=False) + "[notify]\n" + URL).notify == Notify(
        url="http://hooks.lan/x", timeout=2.0)


def test_a_timeout_past_the_limit_is_refused_saying_why_and_what_to_write() -> None:
    with pytest.raises(ConfigError) as info:
        parse(lendee_toml(uuids=False) + "[notify]\n" + URL + 'timeout = "10.5s"\n')
    assert str(info.value).endswith(
        'notify.timeout: is at most 10s: the drain waits for it; e.g. "2s"')
