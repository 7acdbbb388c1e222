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

__all__ = ["LIMIT", "clean"]

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
