"""Where a dead boot's screen is kept, and how many are kept.

When the lendee's guest agent never answers, the screen is the one witness left: the
UEFI shell waiting for a disk, an installer, a firmware stuck before its first pixel,
a kernel panic. libvirt hands over the image in the format QEMU gives (PPM); it is
kept as is, named ``<vm>-<UTC time>.<ext>`` so that names sort by time, and only the
last few per VM are kept. Pure except for `save`, which writes and prunes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["KEEP", "extension", "file_name", "prune", "save", "to_remove"]

KEEP = 5

_EXTENSIONS = {
    "image/x-portable-pixmap": "ppm",
    "image/png": "png",
    "image/jpeg": "jpg",
}


def extension(mime: str) -> str:
    """The file extension for the MIME type libvirt reports (``bin`` if unknown)."""
    return _EXTENSIONS.get(mime.split(";", 1)[0].strip().lower(), "bin")


def file_name(vm: str, mime: str, when: datetime) -> str:
    stamp = when.astimezone(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    return f"{vm}-{stamp}.{extension(mime)}"


def to_remove(names: Iterable[str], vm: str, keep: int = KEEP) -> list[str]:
    """The names of `vm`'s screenshots beyond the newest `keep` (others' are left)."""
    own = re.compile(re.escape(vm) + r"-\d{8}T\d{6}\.\d{6}Z\.\w+")
    mine = sorted(n for n in names if own.fullmatch(n))
    return mine[:-keep] if keep > 0 else mine


def save(directory: Path, vm: str, mime: str, data: bytes, *,
         when: datetime | None = None, keep: int = KEEP) -> Path:
    """Write one screenshot (atomically) and drop `vm`'s older ones beyond `keep`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(vm, mime, when or datetime.now(UTC))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    prune(directory, vm, keep)
    return path


def prune(directory: Path, vm: str, keep: int = KEEP) -> None:
    for name in to_remove((p.name for p in directory.iterdir()), vm, keep):
        (directory / name).unlink(missing_ok=True)
