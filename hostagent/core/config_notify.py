"""The ``[notify]`` section: a URL told before each drain (kured's ``--notify-url``).

Apart from `hostagent.core.config` only for its size; read the same way (`_build`)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from hostagent.core.config_read import _key, _positive_duration, _Problem, _text

__all__ = ["MAX_TIMEOUT", "Notify"]

# The longest a drain may wait for the receiver: a notification must never hold up a
# player's start by more than a moment.
MAX_TIMEOUT = 10.0


def _http_url(value: object, key: str) -> str:
    url = _text(value, key).strip()
    example = 'write e.g. "https://hooks.lan/gaming-host" (http or https)'
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise _Problem(key, f'"{url[:64]}" is not an http(s) URL', example) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or len(url) > 2048 \
            or any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise _Problem(key, f'"{url[:64]}" is not an http(s) URL', example)
    return url


def _timeout(value: object, key: str) -> float:
    seconds = _positive_duration(value, key)
    if seconds > MAX_TIMEOUT:
        raise _Problem(key, f"is at most {MAX_TIMEOUT:g}s: the drain waits for it",
                       'e.g. "2s"')
    return seconds


@dataclass(frozen=True, kw_only=True)
class Notify:
    """POST a small JSON body to `url` before each drain; off without [notify]. The drain
    waits for the answer `timeout` at most, and goes on whatever it is."""

    url: str = field(metadata=_key(_http_url, example='"https://hooks.lan/gaming-host"'))
    timeout: float = field(default=2.0, metadata=_key(_timeout))
