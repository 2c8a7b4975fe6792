"""Where a command writes: its folder made (or refused in one line) before any work is spent."""
from __future__ import annotations

import os
from pathlib import Path


def make_folder(folder: str | Path, flag: str) -> Path:
    """`folder` and its parents created, and checked writable; `flag` names what asked for it
    ('--output data/x.npy') in the ValueError otherwise."""
    folder = Path(folder or ".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, a read-only parent, no permission
        raise ValueError(f"{flag}: cannot create the folder {str(folder)!r} ({e.strerror}); choose another "
                         "path") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: the folder {str(folder)!r} is not writable; choose another path")
    return folder
