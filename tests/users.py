"""A test's code run as an unprivileged user, where the test process is root: root's
permission checks do not apply to it (it reads any file), an unprivileged user's do.

The process's effective user and group become nobody's for the block, its real and
saved ones stay root's, which takes them back at the end; glibc applies the change to
every thread of the process. Its effective capabilities go with the effective user 0
and come back with it (capabilities(7), "Effect of user ID changes on capabilities").
A process that is not root runs the block as itself."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

NOBODY = 65534


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
