"""The agent's clock: wall time, in seconds since the epoch.

Intents and phases are persisted and shown with it, and must age correctly across
restarts, so it is wall time; waits and deadlines use `time.monotonic` instead.
"""

import time


def now() -> float:
    return time.time()
