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


@pytest.mark.parametrize("url", ["ftp://hooks.lan/x", "http://hooks.lan:port/x",
                                 "http://" + "a" * 2048, "http://hooks lan/"])
def test_a_url_that_is_not_http_is_refused_saying_what_to_write(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse(lendee_toml(uuids=False) + f'[notify]\nurl = "{url}"\n')
    assert str(info.value).endswith(
        f'notify.url: "{url[:64]}" is not an http(s) URL; write e.g. '
        '"https://hooks.lan/gaming-host" (http or https)')


def test_an_http_or_https_url_is_taken_as_written() -> None:
    for url in ("http://hooks.lan/x", "https://[::1]:8443/h?token=abc"):
        cfg = parse(lendee_toml(uuids=False) + f'[notify]\nurl = " {url} "\n')
        assert cfg.notify is not None and cfg.notify.url == url


def test_a_url_of_2048_characters_and_printable_ones_is_taken() -> None:
    longest = "http://hooks.lan/" + "a" * (2048 - len("http://hooks.lan/"))
    for url in (longest, "http://hooks.lan/x!y"):
        cfg = parse(lendee_toml(uuids=False) + f'[notify]\nurl = "{url}"\n')
        assert cfg.notify is not None and cfg.notify.url == url
    for url in (longest + "a", "http://hooks.lan/\\u007f"):
        with pytest.raises(ConfigError, match="is not an http"):
            parse(lendee_toml(uuids=False) + f'[notify]\nurl = "{url}"\n')


def test_a_long_url_with_a_bad_port_is_quoted_cut_at_64() -> None:
    url = "http://hooks.lan:port/" + "a" * 70
    with pytest.raises(ConfigError) as info:
        parse(lendee_toml(uuids=False) + f'[notify]\nurl = "{url}"\n')
    assert f'notify.url: "{url[:64]}" is not an http(s) URL;' in str(info.value)
