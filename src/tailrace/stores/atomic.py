"""Replace a directory of files all at once: readers see the old one or the new one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replace_dir(target: Path) -> Iterator[Path]:
    """Yield an empty folder beside ``target``; on success it replaces ``target``.

    Files written into the folder are fsynced, then ``target`` is swapped for it by two
    renames; if the writing (or the swap) fails, ``target`` is left as it was and the
    folder is removed.

    target: the directory to replace (its parent must exist).
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old = target.parent / f".{target.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
    try:
        yield tmp
        for p in tmp.iterdir():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():
            os.rename(target, old)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
