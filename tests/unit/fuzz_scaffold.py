"""What the fuzzers share (test_fuzz_protocols.py, test_fuzz_kube.py): random text and
JSON-like values."""

from __future__ import annotations

import random
from typing import Any


def _text(rng: random.Random) -> str:
    pools = ("abc-_ 01", "\x00\t\"\\\u00e9\u2028\ufeff\U0001f600", "\ud800\udfff")
    pool = rng.choices(pools, weights=(10, 5, 1))[0]  # lone surrogates: invalid UTF-8
    return "".join(rng.choice(pool) for _ in range(rng.randrange(12)))


def _value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "float", "text"] + ["list", "object"] * (depth < 3)
    match rng.choice(kinds):
        case "null":
            return None
        case "bool":
            return rng.random() < 0.5
        case "int":
            # 10**400: an integer no float holds (it once escaped as OverflowError).
            return rng.choice([0, 1, -1, 2, 2**63, -(2**64), 10**400, -(10**400),
                               rng.randrange(-1000, 1000)])
        case "float":
            return rng.choice([0.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf")])
        case "text":
            return _text(rng)
        case "list":
            return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
        case _:
            return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randrange(3))}
