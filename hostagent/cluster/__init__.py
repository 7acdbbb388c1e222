"""The lendee's node in Kubernetes: the adapter (kube), the cycle's policy, DRA."""
