"""A directory only this user can change: a real directory (not a symlink) of this user that
neither its group nor others may write. What is kept in one (snapshots of the disk prompt
cache, the hashes recorded at a first load) is trusted; what another user could have written
is not. MLX-free."""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager


@contextmanager
def private_directory(path: str):
    """A descriptor of ``path`` once it is a real directory (not a symlink) of this user that
    neither its group nor others may write; OSError saying why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise OSError(f"{path} is not a directory (a symlink or a file)") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise OSError(f"{path} belongs to another user")
        if st.st_mode & 0o022:
            raise OSError(f"{path} can be written by other users (mode "
                          f"{stat.S_IMODE(st.st_mode):o}; chmod 700 it)")
        yield fd
    finally:
        os.close(fd)
