"""Replace a directory of files all at once: at every instant a complete one is reachable.

Why: docs/design.md, "Stores switch versions, never folders". ``replace_dir`` writes
version N in steps: (1) files into ``.NAME.tmp-PID-RAND/``, each fsynced; (2) that folder
renamed to ``NAME.vN``; (3) a link ``.NAME.link-PID-RAND -> NAME.vN`` ``os.replace``d
onto ``NAME``, the one atomic switch; (4) older versions removed (parent fsynced after 2
and 3). ``current`` recovers from a crash at any step: it rolls ``NAME`` forward, removes
the leftovers of writers that are gone and migrates a plain ``NAME/`` folder (the layout
before versions). One writer per store at a time; readers need no lock.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ..errors import StoreError

#: Temporary entries this process is writing now (names); recovery leaves them alone.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def current(target: str | os.PathLike[str], *, marker: str = "meta.json") -> Path | None:
    """The folder holding the current files of ``target`` (the link ``NAME``, or a plain
    folder of the old layout) after crash recovery; None if none. ``marker``: a file every
    complete store holds; a plain folder without it is returned as is, never migrated.

    Repairs (rolling the link forward, removing leftovers, migrating a plain folder) are
    best effort: on a read-only disk the complete version is still returned. Raises
    StoreError when ``NAME`` is a link to a missing folder or is a plain file.
    """
    return _recover(Path(target), marker, strict=True)


@contextmanager
def replace_dir(target: str | os.PathLike[str], *, marker: str = "meta.json") -> Iterator[Path]:
    """Yield an empty folder; once the block succeeds it becomes ``target``'s new version
    (its parent must exist). A plain non-empty folder without ``marker`` is refused.

    If the block (or any step before the switch) fails, ``target`` keeps naming the old
    version and the folder is removed; a crash leaves ``target`` naming the old or the
    new version, and leftovers that the next ``current`` or ``replace_dir`` removes.
    """
    target = Path(target)
    parent, name = target.parent, target.name
    _recover(target, marker, strict=False)  # a damaged link is replaced, not an obstacle
    if target.is_dir() and not target.is_symlink():  # a plain folder not migrated
        try:
            os.rmdir(target)  # empty: nothing to keep
        except OSError as e:
            if (target / marker).is_file():  # a store of the old layout that cannot move
                raise StoreError(f"{target}: cannot turn this folder into a version before "
                                 f"replacing it ({e.strerror})") from None
            raise StoreError(f"{target} is a folder without {marker}, not a store; move it "
                             "away before writing one there") from None
    tmp = parent / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    with _active(tmp.name):
        os.mkdir(tmp)
        try:
            yield tmp
            _sync_tree(tmp)
            version = _commit(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:
        _point(target, version)
    except BaseException:  # the switch did not happen: nobody will read the new version
        if not (target.is_symlink() and os.readlink(target) == version):
            shutil.rmtree(parent / version, ignore_errors=True)
        raise
    _prune(target, _number(name, version) or 0)


# -- names ------------------------------------------------------------------------------
def _version_name(name: str, n: int) -> str:
    return f"{name}.v{n:06d}"


def _number(name: str, entry: str) -> int | None:
    """N when ``entry`` is ``NAME.vN``, else None."""
    m = re.fullmatch(re.escape(name) + r"\.v(\d{6,})", entry)
    return int(m.group(1)) if m else None


def _versions(parent: Path, name: str) -> dict[int, str]:
    """The complete versions of ``name`` in ``parent``: number -> folder name."""
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return {}
    return {n: entry for entry in entries if (n := _number(name, entry)) is not None}


def _leftover(name: str, entry: str) -> bool:
    """Is ``entry`` a temporary folder or link of ``name`` whose writer is gone?"""
    m = re.fullmatch(r"\." + re.escape(name) + r"\.(tmp|link)-(\d+)-[0-9a-f]+", entry)
    if m is None:  # the old layout's temporary names: ".NAME.tmp-XXXXXXXX", ".NAME.old-..."
        legacy = r"\." + re.escape(name) + r"\.(tmp|old)-[a-z0-9_]+"
        return re.fullmatch(legacy, entry) is not None
    pid = int(m.group(2))
    if pid == os.getpid():
        with _ACTIVE_LOCK:
            return entry not in _ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


@contextmanager
def _active(entry: str) -> Iterator[None]:
    with _ACTIVE_LOCK:
        _ACTIVE.add(entry)
    try:
        yield
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(entry)


# -- disk steps -------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot sync a folder
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then every folder, deepest first."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _commit(tmp: Path, target: Path) -> str:
    """Rename the written folder to the next version; returns the version's name."""
    parent, name = target.parent, target.name
    n = max(_versions(parent, name), default=0) + 1
    while True:
        version = _version_name(name, n)
        try:
            os.rename(tmp, parent / version)
            break
        except OSError as e:  # another writer took N meanwhile
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            n += 1
    _fsync_dir(parent)
    return version


def _point(target: Path, version: str) -> None:
    """Switch the link ``target`` to ``version`` in one ``os.replace``; fsync the parent."""
    parent, name = target.parent, target.name
    link = parent / f".{name}.link-{os.getpid()}-{secrets.token_hex(4)}"
    with _active(link.name):
        os.symlink(version, link)
        try:
            os.replace(link, target)
        except BaseException:
            link.unlink(missing_ok=True)
            raise
    _fsync_dir(parent)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _prune(target: Path, keep: int) -> None:
    """Remove versions older than ``keep`` and the leftovers of writers that are gone."""
    parent, name = target.parent, target.name
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        n = _number(name, entry)
        if (n is not None and n < keep) or (n is None and _leftover(name, entry)):
            with suppress(OSError):  # best effort: a later recovery tries again
                _remove(parent / entry)


# -- recovery ---------------------------------------------------------------------------
def _recover(target: Path, marker: str, *, strict: bool) -> Path | None:
    for _ in range(3):  # a concurrent recovery may move things under us: look again
        try:
            return _recover_once(target, marker, strict)
        except FileNotFoundError as e:
            last = e
    raise StoreError(f"{target}: the store keeps changing while it is opened ({last}); "
                     f"is another process writing {target}?")


def _recover_once(target: Path, marker: str, strict: bool) -> Path | None:
    parent, name = target.parent, target.name
    versions = _versions(parent, name)
    if not os.path.lexists(target):
        _rescue_old_swap(target, versions)
    if target.is_symlink():
        link = os.readlink(target)
        pointed = _number(name, link)
        if pointed is None:  # the user's own link to a folder elsewhere: read through it
            if target.is_dir():
                return target
            _damaged(target, link, strict)
            return None
        if not (parent / link).is_dir():
            if os.readlink(target) != link:  # a writer switched it meanwhile: look again
                raise FileNotFoundError(link)
            _damaged(target, link, strict)
            return None
        head = max(versions, default=pointed)
        if head <= pointed:
            head, versions[pointed] = pointed, link
        else:  # a crash (or a writer) between steps 2 and 3: roll forward
            _try(_point, target, versions[head])
        _try(_prune, target, head)
        return parent / versions[head]
    if target.is_dir():  # the old layout: a plain folder
        if not (target / marker).is_file():
            return target
        return _migrate(target, versions)
    if os.path.lexists(target):
        raise StoreError(f"{target} is a file, not a store folder or a link to one; "
                         "move it away")
    if versions:  # a crash between steps 2 and 3 of the first write (or of a migration)
        head = max(versions)
        _try(_point, target, versions[head])
        _try(_prune, target, head)
        return parent / versions[head]
    _try(_prune, target, 0)
    return None


def _damaged(target: Path, link: str, strict: bool) -> None:
    """A link to a missing folder: an error for readers; writers replace the link."""
    if strict:
        raise StoreError(f"{target} points to {target.parent / link}, which is missing; "
                         f"restore that folder, or remove {target} to start over")


def _migrate(target: Path, versions: dict[int, str]) -> Path:
    """Turn the plain folder ``target`` into the newest version; on failure, read it."""
    parent, name = target.parent, target.name
    version = _version_name(name, max(versions, default=0) + 1)
    try:
        _sync_tree(target)
        os.rename(target, parent / version)
    except OSError:  # read-only, or busy: keep reading the plain folder
        return target
    _fsync_dir(parent)
    _try(_point, target, version)
    _try(_prune, target, _number(name, version) or 0)
    return parent / version


def _rescue_old_swap(target: Path, versions: dict[int, str]) -> None:
    """The old layout's swap died between its renames: put the old folder back."""
    if versions:
        return
    parent, name = target.parent, target.name
    try:
        entries = sorted(os.listdir(parent))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.startswith(f".{name}.old-") and (parent / entry).is_dir():
            _try(os.rename, parent / entry, target)
            return


def _try(step: Callable[..., object], *args: object) -> None:
    """Run a repair step; a read-only disk or a concurrent repair is not an error."""
    try:
        step(*args)
    except FileNotFoundError:
        raise
    except OSError:
        pass
