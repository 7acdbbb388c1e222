"""What the MQTT device keeps across restarts, and the broker's refusals it must hear.

Home Assistant keeps a device by its identifiers and an entity by its unique id. On the
default base topic (``hostagent/<host>``) both were made from the host's name, so
renaming the host made a new device with new entities (``switch.hostagent_gaming1_2``)
and left every automation on the old ones. The device id in use is therefore kept in
the state directory (`DEVICE_FILE`, with the base topic in use) and stays when the
host's name changes; what the former base topic held is cleared once it changes.

aiomqtt 2.5.1 ignores the reason code of a PUBACK (client.py, ``_on_publish``): a
publish the broker refused (MQTT 5: 0x80 or more; mosquitto 2 answers 0x87 Not
authorized for a topic its ACL denies) looked sent. `Client` tells each refusal, with
the topic and the reason, to the device, which journals it. The device speaks MQTT 5
only; a 3.1.1 broker has no way to refuse a publish but to close the connection, which
the device journals and retries anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.reasoncodes import ReasonCode

__all__ = ["DEVICE_FILE", "Client", "kept_device", "keep_device", "write_private"]

DEVICE_FILE = "mqtt-device"  # in the state directory: {"base": ..., "node": ...}
_NODE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_BASE = re.compile(r"[^#+\x00/][^#+\x00]{0,253}[^#+\x00/]|[^#+\x00/]")


def write_private(path: Path, text: str) -> None:
    """`text` in `path`, mode 0600, whole or not at all (a temporary file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def kept_device(state_dir: Path) -> tuple[str, str] | None:
    """The (base topic, device id) kept in `state_dir`, or None: none kept, unreadable, or
    not what `keep_device` writes (then it is made again). Blocking."""
    try:
        with open(state_dir / DEVICE_FILE, encoding="utf-8", errors="replace") as f:
            text = f.read(4096)
        kept = json.loads(text)
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict):
        return None
    base, node = kept.get("base"), kept.get("node")
    if isinstance(base, str) and isinstance(node, str) and _BASE.fullmatch(base) \
            and "//" not in base and _NODE.fullmatch(node):
        return base, node
    return None


def keep_device(state_dir: Path, *, base: str, node: str) -> str | None:
    """Keep the base topic and the device id in use; why it could not be (None: kept).
    Blocking."""
    path = state_dir / DEVICE_FILE
    try:
        write_private(path, json.dumps({"base": base, "node": node}, sort_keys=True) + "\n")
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


class Client(aiomqtt.Client):
    """aiomqtt's client, telling `refused(topic, reason)` of each publish the broker
    acknowledged with a failure reason code (MQTT 5, 3.4.2.1)."""

    def __init__(self, *args: Any, refused: Callable[[str, ReasonCode], None],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = refused
        # mid -> topic of each QoS 1 publish not acknowledged yet; per connection (a
        # client is made for each), so what a dead link leaves is dropped with it.
        self._topics: dict[int, str] = {}
        publish = self._client.publish

        def tracked(topic: str, payload: Any = None, qos: int = 0, retain: bool = False,
                    properties: Any = None) -> paho.MQTTMessageInfo:
            info = publish(topic, payload, qos, retain, properties)
            if qos > 0 and info.rc == paho.MQTT_ERR_SUCCESS and not info.is_published():
                self._topics[info.mid] = topic
            return info

        self._client.publish = tracked  # type: ignore[method-assign]

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int,
                    reason_code: ReasonCode, properties: Any) -> None:
        topic = self._topics.pop(mid, None)
        if topic is not None and reason_code.is_failure:
            self._refused(topic, reason_code)
        super()._on_publish(client, userdata, mid, reason_code, properties)
