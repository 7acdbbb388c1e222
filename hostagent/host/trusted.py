"""Files that decide who may do what, read so that nobody but root can have chosen them.

The authorized-keys file grants verbs; a private key proves who we are. Checking a path
with stat() and then reading it by name leaves a window in which a link can be flipped
to another file, and a file that is safe itself can still be replaced through a
directory someone else may write. So, as sshd's StrictModes: symlinks are resolved
first (NixOS links /etc files into the store), then every directory from / down is
opened without following links and checked (owned by root or by the user the agent runs
as, not writable by group or others unless sticky: a sticky directory lets nobody
rename or remove what another owns in it), the file is opened with O_NOFOLLOW from its
checked directory, and the checks and the read go through that one descriptor. A link
flipped meanwhile makes the open fail rather than read the new target.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnsafeFile", "read_private", "read_trusted"]


class UnsafeFile(Exception):
    """The file or a directory above it could be written (or read) by someone else; the
    message names it and the fix."""


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def _check_directory(fd: int, where: str, path: Path) -> None:
    st = os.fstat(fd)
    if not _trusted_owner(st):
        raise UnsafeFile(f"{where}: owned by uid {st.st_uid}, not root, so that user can "
                         f"replace {path}: chown root {where}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeFile(f"{where}: writable by group or others, so anyone who can write "
                         f"there can replace {path}: chmod go-w {where}")


def read_trusted(path: Path, *, limit: int = 1 << 20) -> tuple[os.stat_result, bytes]:
    """The file's status and its first `limit` bytes, through one descriptor, once it and
    every directory above it are found safe. UnsafeFile names the fix; OSError: it
    cannot be read (missing, or a link flipped during the read: ELOOP)."""
    real = Path(os.path.realpath(path))
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_directory(fd, "/", path)
        where = Path("/")
        for name in real.parts[1:-1]:
            where = where / name
            parent, fd = fd, os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, dir_fd=fd)
            os.close(parent)
            _check_directory(fd, str(where), path)
        # O_NONBLOCK: a FIFO put there must not hang the open.
        file = os.open(real.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=fd)
    finally:
        os.close(fd)
    try:
        st = os.fstat(file)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path}: not a regular file")
        if not _trusted_owner(st):
            raise UnsafeFile(f"{path}: owned by uid {st.st_uid}, not root, so that user can "
                             f"change it: chown root {path}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeFile(f"{path}: writable by group or others, so anyone who can write "
                             f"it can change it: chmod go-w {path}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(file, min(65536, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(file)
    if size > limit:
        raise UnsafeFile(f"{path}: larger than {limit} bytes; is it the right file?")
    return st, b"".join(chunks)


def read_private(path: Path, *, limit: int = 1 << 16, what: str = "a private key",
                 noun: str = "key") -> bytes:
    """A secret (a private key, a password): `read_trusted`, and readable by its owner
    alone (as OpenSSH refuses a key file others may read)."""
    st, data = read_trusted(path, limit=limit)
    if st.st_mode & 0o077:
        raise UnsafeFile(f"{path}: {what} readable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}), so anyone who can read it can use "
                         f"it: chmod 600 {path}, and replace the {noun} if others may have "
                         "copied it")
    return data
