"""What SRC holds, read as data: every file the converter may read or hash is a regular file
inside SRC, found without following a single directory link.

A symbolic link is accepted only when it resolves to a regular file inside SRC or, for a
Hugging Face cache snapshot, inside that repo's ``blobs/`` directory (where the cache keeps
the bytes its snapshot links point to). Anything else -- a link out of SRC (``tokenizer.json
-> /etc/shadow``), a dangling or cyclic link, a link to a directory, a FIFO, socket or device
-- is refused by name before anything is read. Directory links are never followed, so a
cycle cannot loop.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConversionError


def allowed_roots(src: Path) -> tuple[Path, ...]:
    """SRC, plus the blob store of a Hugging Face cache snapshot (``.../models--org--name/
    snapshots/<commit>`` links into ``.../models--org--name/blobs``)."""
    repo = src.parent.parent
    if src.parent.name == "snapshots" and repo.name.startswith("models--"):
        return src, repo / "blobs"
    return (src,)


def _inside(path: Path, roots) -> bool:
    return any(path == r or r in path.parents for r in roots)


def check_entry(src: Path, name: str, roots) -> None:
    """Refuse ``src / name`` unless it is, or links to, a regular file inside ``roots``."""
    path = src / name
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        if not _inside(target, roots):
            raise ConversionError(f"{path}: symbolic link to {os.readlink(path)}, which is "
                                  f"outside SRC (links out of SRC are never followed)")
        try:
            st = os.stat(path)
        except OSError:
            raise ConversionError(f"{path}: dangling or cyclic symbolic link") from None
        if stat.S_ISDIR(st.st_mode):
            raise ConversionError(f"{path}: symbolic link to a directory (never followed)")
    if not stat.S_ISREG(st.st_mode):
        raise ConversionError(f"{path}: not a regular file (FIFOs, sockets and devices are "
                              f"never read)")


def source_files(src: Path) -> list[str]:
    """Every file of SRC, checked as above, as sorted relative names (dot-directories such as
    a local-dir ``.cache`` and dot-files are skipped: they are never read)."""
    roots = allowed_roots(src)
    names = []
    for root, dirs, files in os.walk(src, followlinks=False, onerror=_walk_error):
        rel = Path(root).relative_to(src)
        keep = []
        for d in sorted(d for d in dirs if not d.startswith(".")):
            if os.path.islink(Path(root) / d):
                check_entry(src, (rel / d).as_posix(), roots)     # raises: a directory link
            keep.append(d)
        dirs[:] = keep
        for f in files:
            if not f.startswith("."):
                check_entry(src, (rel / f).as_posix(), roots)
                names.append((rel / f).as_posix())
    return sorted(names)


def _walk_error(e: OSError):
    raise ConversionError(f"{e.filename}: cannot read directory ({e.strerror})")
