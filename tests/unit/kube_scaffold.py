"""What the tests against the API stand-in share: timings short enough for a test."""

from __future__ import annotations

from hostagent.kube import Timing

FAST = Timing(request_timeout=2.0, api_timeout=3.0, backoff_min=0.02, backoff_max=0.1,
              evict_retry=0.05, delete_poll=0.02, watch_timeout=5.0)
