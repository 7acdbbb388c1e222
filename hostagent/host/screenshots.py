"""Where a dead boot's screen is kept, and how many are kept.

When the lendee's guest agent never answers, the screen is the one witness left: the
UEFI shell waiting for a disk, an installer, a firmware stuck before its first pixel,
a kernel panic. libvirt hands over the image in the format QEMU gives (PPM), which few
viewers and no browser open: it is kept as PNG (`ppm_to_png`, zlib only), named
``<vm>-<UTC time>.png`` so that names sort by time, and only the last few per VM are
kept. An image that is not a PPM this module reads is kept as it came, under its own
extension: a witness is never thrown away. Pure except for `save`, which writes and
prunes.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["KEEP", "extension", "file_name", "ppm_to_png", "prune", "save", "to_remove"]

KEEP = 5

_EXTENSIONS = {
    "image/x-portable-pixmap": "ppm",
    "image/png": "png",
    "image/jpeg": "jpg",
}


def extension(mime: str) -> str:
    """The file extension for the MIME type libvirt reports (``bin`` if unknown)."""
    return _EXTENSIONS.get(mime.split(";", 1)[0].strip().lower(), "bin")


_PPM_HEADER = re.compile(rb"P6(?:\s|#[^\n]*\n)+(\d+)(?:\s|#[^\n]*\n)+(\d+)"
                         rb"(?:\s|#[^\n]*\n)+(\d+)\s")
_MAX_SIDE = 1 << 15


def ppm_to_png(ppm: bytes) -> bytes:
    """A binary PPM (P6, what QEMU's screendump writes) as an 8-bit RGB PNG.

    ValueError if `ppm` is not a P6 image whose header matches its size."""
    m = _PPM_HEADER.match(ppm)
    if m is None:
        raise ValueError("not a binary PPM (P6) image")
    width, height, maxval = (int(g) for g in m.groups())
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE and 0 < maxval < 65536):
        raise ValueError(f"unusable PPM size {width}x{height}, maxval {maxval}")
    sample = 1 if maxval < 256 else 2
    stride = width * 3 * sample
    pixels = ppm[m.end():m.end() + stride * height]
    if len(pixels) != stride * height:
        raise ValueError(f"PPM data is {len(pixels)} bytes, {width}x{height} needs "
                         f"{stride * height}")
    if sample == 2:  # 16-bit samples, big-endian: keep the high byte
        pixels = pixels[::2]
        maxval >>= 8
    if maxval != 255:
        scale = bytes(min(255, round(v * 255 / max(maxval, 1))) for v in range(256))
        pixels = pixels.translate(scale)
    row = width * 3
    raw = b"".join(b"\x00" + pixels[y * row:(y + 1) * row] for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


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
    """Write one screenshot (atomically, a PPM as PNG) and drop `vm`'s older ones beyond
    `keep`."""
    if extension(mime) == "ppm":
        try:
            data, mime = ppm_to_png(data), "image/png"
        except ValueError:
            pass  # kept as it came: better an odd file than no witness
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
