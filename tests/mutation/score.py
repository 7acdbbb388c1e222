"""`make mutate`'s score: per module, how many of mutmut's mutants the unit tests killed.

mutmut (3.x) keeps each mutated file's results in ``mutants/<path>.meta`` (JSON: exit
code by mutant name; None while not run). A mutant counts as killed when a test failed
on it (exit 1 or 3) or it ran past its time (a mutant that loops forever is caught);
as a survivor when every test passed (0) or no test ran its code (33, 5). Those listed
in tests/mutation/equivalent.txt, each with why no test can tell it from the real
code, count as neither. Goals: hostagent.core.machine 100 %, every other module 95 %;
a module whose mutants were not run is said so, not scored.

    python -m tests.mutation.score [MODULE_PREFIX]   exit 1 when a module run misses its goal
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT = Path(__file__).with_name("equivalent.txt")
GOALS = {"hostagent.core.machine": 100.0}
GOAL = 95.0
KILLED = {1, 3, 24, -24, 36, 152, 255}  # a failure, or past its time (SIGXCPU)
SURVIVED = {0, 5, 33}


def equivalent() -> dict[str, str]:
    """Mutant name -> why it is equivalent, from equivalent.txt (``name  reason``)."""
    found = {}
    for line in EQUIVALENT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, why = line.partition(" ")
            found[name] = why.strip()
    return found


def main(argv: list[str]) -> int:
    prefix = argv[0] if argv else ""
    skip = equivalent()
    missed = []
    metas = sorted((ROOT / "mutants").glob("hostagent/**/*.py.meta"))
    if not metas:
        print("no mutmut results under mutants/: run make mutate first")
        return 1
    print(f"{'module':34} {'killed':>6} {'surv.':>6} {'equiv.':>6} {'not run':>7} {'score':>7}")
    for meta in metas:
        module = ".".join(meta.relative_to(ROOT / "mutants").with_suffix("").with_suffix("")
                          .parts)
        if not module.startswith(prefix):
            continue
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if not codes:
            continue
        killed = survived = equiv = unrun = 0
        survivors = []
        for name, code in codes.items():
            if name in skip:
                equiv += 1
            elif code is None:
                unrun += 1
            elif code in KILLED:
                killed += 1
            else:
                survived += 1
                survivors.append(name)
        tried = killed + survived
        if not tried:
            print(f"{module:34} {'':>6} {'':>6} {equiv:6} {unrun:7}  not run")
            continue
        score = 100.0 * killed / tried
        goal = GOALS.get(module, GOAL)
        mark = "" if score >= goal else f"  below {goal:g} %"
        print(f"{module:34} {killed:6} {survived:6} {equiv:6} {unrun:7} {score:6.1f}%{mark}")
        if mark:
            missed.append(module)
        for name in survivors:
            print(f"    survived: {name}  (mutmut show {name})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
