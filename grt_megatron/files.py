"""Writing a file so that a reader sees the old contents or the new, never a part: the new contents go to
a temporary file beside it (removed again if writing fails or is interrupted), which is then renamed
over it. `durable` also flushes file and directory to disk (checkpoints: a power loss keeps one or the other)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional, Union


def fsync_dir(path: Path, strict: bool = True) -> None:
    """Make the renames in `path` survive a crash. `strict=False`: where a filesystem cannot open or sync
    a folder, carry on (the rename itself has happened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


def write_atomic(path: Union[str, os.PathLike], contents: Union[str, bytes, Callable[[Path], object]],
                 durable: bool = False) -> Path:
    """Write `contents` (text, bytes, or a function that writes the file it is given) to `path` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # NAME.tmp: grt-prepare-data removes a dead run's temporaries by that name (data/indexed.py).
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(contents, str):
            tmp.write_text(contents, encoding="utf-8")
        elif isinstance(contents, bytes):
            tmp.write_bytes(contents)
        else:
            contents(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk or a Ctrl-C leaves no half-written file behind
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def file_in_the_way(folder: Union[str, os.PathLike]) -> Optional[Path]:
    """The file that stops `folder` from being (or being created as) a folder: `folder` itself or its nearest
    existing ancestor, when that is not a directory; None when the path is usable."""
    folder = Path(folder)
    nearest = next((q for q in (folder, *folder.absolute().parents) if q.exists()), None)
    return nearest if nearest is not None and not nearest.is_dir() else None
