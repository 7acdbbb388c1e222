"""Words from others, made harmless for a terminal: the one place that decides how.

Guest output (nvidia-smi's GPU names, what a failing command said), the API server's
messages, journal records and what comes over the sockets are someone else's words.
Shown as they are, a control character in them is an order to the terminal that shows
them: ``ESC [2J`` clears root's screen, a carriage return prints over a line of
`hostagent status`, OSC 52 writes the clipboard. So `clean` is applied where such text
comes in, capped (a guest may answer megabytes), and again where the CLI prints, so
that text which reached the agent by some other road is harmless too.

Every character Python does not count as printable is shown escaped, as in a string
literal (``\\x1b``, ``\\x9b``, ``\\u202e``): C0 and C1 controls and DEL, the
bidirectional and zero-width format characters, line and paragraph separators,
surrogates and unassigned code points. The escape keeps what was sent readable, and
the result is one line. No side effects.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["LIMIT", "bounded_json", "clean"]

LIMIT = 1000  # characters: a sentence, a message, a GPU name; never a whole reply


def clean(text: object, limit: int | None = LIMIT) -> str:
    """`text` (`str()` of it, if it is not a string) as one line of printable characters,
    cut to `limit` characters and an ellipsis (None: not cut)."""
    s = text if isinstance(text, str) else str(text)
    if limit is not None and len(s) > limit:
        s = s[:limit]  # first, so that a huge text is not escaped whole
        cut = True
    else:
        cut = False
    if not s.isprintable():
        s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
        if limit is not None and len(s) > limit:
            s, cut = s[:limit], True
    return s + "…" if cut else s


def bounded_json(data: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """`data` parsed as JSON, if it is at most `max_bytes` long and nests arrays and
    objects at most `max_depth` deep; ValueError (with why) otherwise. Checked before
    parsing: `json.loads` recurses once per level, and a message nested a few thousand
    deep raises RecursionError out of whatever called it."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes (at most {max_bytes})")
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > max_depth:
                raise ValueError(f"nested deeper than {max_depth}")
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return json.loads(data)
