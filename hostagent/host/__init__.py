"""What runs on this host: libvirt, the GPUs, in-guest checks, lint, state, journal."""
