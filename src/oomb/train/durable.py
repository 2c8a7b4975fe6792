"""Directories published whole and durably: written under a unique temporary name, flushed to the
disk (files, the directory, and its parent after the rename), renamed into place. A directory
being replaced is renamed aside first and removed last, so a crash at any point leaves the old
one or the new one under the final name, or the old one aside, which clean_stale() puts back.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

#: directories a process leaves only when it is killed: being written, being deleted
STALE = ("*.tmp", "*.tmp-*", "*.deleted-*")
ASIDE = "*.old-*"  # a replaced directory, until its replacement is in place


def unique(name: str, kind: str) -> str:
    """`name.kind-<pid>-<random>`: no two processes (two runs, or a run and its killed
    predecessor) ever write into the same temporary directory."""
    return f"{name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename is on the disk once its
    directory is flushed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under root, root last."""
    for path in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        fsync(path)
    fsync(root)


def write_file(path: Path, text: str) -> None:
    """Replace the file `path` by `text` whole: written under a unique temporary name (which
    clean_stale() removes after a kill), flushed, renamed into place, its directory flushed: a
    reader sees the old file or the new one."""
    path = Path(path)
    tmp = path.with_name(unique(path.name, "tmp"))
    tmp.write_text(text)
    fsync(tmp)
    os.replace(tmp, path)
    fsync(path.parent)


def publish(tmp: Path, final: Path) -> None:
    """Put the fully written (and flushed) directory `tmp` in place of `final`: a reader sees the
    old one or the new one, never half of either; an old `final` is removed only once the new
    one is in place, and put back if the rename fails."""
    fsync(tmp)
    aside = final.with_name(unique(final.name, "old")) if final.exists() else None
    if aside is not None:
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except OSError:
        if aside is not None:
            os.replace(aside, final)
        raise
    fsync(final.parent)
    if aside is not None:
        remove(aside)


def remove(path: Path) -> None:
    """Delete a directory: renamed first (one atomic step), so that a kill halfway through the
    deletion leaves a `.deleted-` directory that clean_stale() removes, not a damaged one under
    its name."""
    doomed = path.with_name(unique(path.name, "deleted"))
    os.replace(path, doomed)
    fsync(path.parent)
    shutil.rmtree(doomed)


def clean_stale(directory: Path) -> list[str]:
    """After a killed run (the caller holds the directory's lock: no live writer): remove what it
    was writing or deleting, and put back a directory it had renamed aside and not yet replaced.
    Returns the names removed or restored."""
    done = []
    for pattern in STALE:
        for path in directory.glob(pattern):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            done.append(path.name)
    for path in directory.glob(ASIDE):
        final = path.with_name(path.name.split(".old-")[0])
        if final.exists():
            shutil.rmtree(path)
        else:
            os.replace(path, final)
        done.append(path.name)
    return done


def check_room(directory: Path, need_bytes: int) -> None:
    """OSError(ENOSPC) naming both numbers when the file system holding `directory` has less
    than need_bytes free."""
    free = shutil.disk_usage(directory).free
    if free < need_bytes:
        raise OSError(errno.ENOSPC, f"needs {need_bytes / 2**30:.2f} GiB, {free / 2**30:.2f} GiB is free in "
                                    f"{directory}")
