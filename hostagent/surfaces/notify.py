"""A notification to a URL before each drain, as kured's ``--notify-url`` sends one
before it drains a node to reboot it: one HTTP POST with a small JSON body.

It runs on the agent's event loop with asyncio's own streams (no thread, no blocking
call), under one deadline (`hostagent.core.config_notify.Notify.timeout`, at most 10 s)
that covers the connection, TLS, the request and the status line: the drain waits for
the answer that long at most, then goes on whatever it was. The receiver's answer is
read no further than its status line (bounded by the stream's line limit). A failure
(refused, timed out, a status of 300 or more) is one journal warning; success is one
record too. The URL may carry a secret (a token in its query, a user and password), so
records name its scheme, host and port alone; a user and password in it are sent as
HTTP Basic authentication.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import ssl
import urllib.parse
from typing import Any

from hostagent.core.config_notify import Notify
from hostagent.core.text import clean
from hostagent.host import journal

__all__ = ["before_drain", "post", "shown"]

MAX_LINE = 4096  # the status line read back, at most


class _Failed(Exception):
    """The receiver did not take the notification, in a few words."""


def shown(url: str) -> str:
    """`url` as the journal may show it: scheme, host and port, nothing secret."""
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"


async def post(url: str, body: dict[str, Any], *, timeout: float) -> int:
    """POST `body` as JSON to `url`; the status the receiver answered. Raises `_Failed`
    or TimeoutError; never takes longer than `timeout`."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    data = json.dumps(body, sort_keys=True).encode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = [f"POST {target} HTTP/1.1", f"Host: {parts.netloc.rpartition('@')[2]}",
            "Content-Type: application/json", f"Content-Length: {len(data)}",
            "Connection: close", "User-Agent: hostagent"]
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        head.append(f"Authorization: Basic {token}")
    request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data
    async with asyncio.timeout(timeout):
        context = await asyncio.to_thread(ssl.create_default_context) if https else None
        try:
            reader, writer = await asyncio.open_connection(
                host, port, ssl=context, limit=MAX_LINE,
                server_hostname=host if https else None)
        except (OSError, ssl.SSLError) as e:
            raise _Failed(f"cannot connect ({getattr(e, 'strerror', None) or e})") from e
        try:
            writer.write(request)
            await writer.drain()
            line = await reader.readline()
        except (OSError, ValueError, ssl.SSLError) as e:
            raise _Failed(f"the connection failed ({e})") from e
        finally:
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 0.5)
    words = line.decode("latin-1").split()
    if len(words) < 2 or not words[0].startswith("HTTP/") or not words[1].isdigit():
        raise _Failed(f"no HTTP answer ({clean(line.decode('latin-1'), 80)!r})")
    return int(words[1])


async def before_drain(settings: Notify, body: dict[str, Any]) -> bool:
    """Tell `settings.url` that a drain begins; journaled either way. True if the
    receiver took it (a status below 300). Never raises but for cancellation."""
    where = shown(settings.url)
    try:
        status = await post(settings.url, body, timeout=settings.timeout)
    except TimeoutError:
        why = f"no answer within {settings.timeout:g}s"
    except _Failed as e:
        why = str(e)
    except Exception as e:  # nothing of the receiver's may stop the drain
        why = clean(repr(e), 200)
    else:
        if status < 300:
            journal.record("notify", f"told {where} of the drain of {body.get('node')}: "
                           f"{status}", result="sent", status=status)
            return True
        why = f"it answered {status}"
    journal.record("notify", f"could not tell {where} of the drain of {body.get('node')}: "
                   f"{why}; the drain goes on (notify.url)", result="failed",
                   priority=journal.Priority.WARNING)
    return False
