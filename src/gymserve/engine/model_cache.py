"""The model cache on disk: where it is, and building each entry once, safely, however many runs start.

An entry (a file or a directory, e.g. the embedded model's safetensors copy) is built by
:func:`prepare_entry`, which makes any number of concurrent first runs — threads and processes, a
``make demo`` beside a ``make test`` — all succeed with one result:

1. If the entry is already complete, it is returned at once (no lock: a finished entry never changes).
2. Otherwise an exclusive lock is taken on ``.<name>.lock`` beside it (``filelock``, i.e.
   ``flock(2)``: the kernel drops it when its process dies, so a killed run never leaves a stale
   lock). Runs that find it held wait, saying so every 10 s.
3. With the lock held the entry is checked again: the run that held it before has usually finished
   it, and then nothing is built.
4. Leftovers of killed runs (``.<name>.tmp-*``, ``.<name>.old-*`` and the fixed temporary names of
   older gymserve versions) are deleted: only the lock holder writes them, so none is in use.
5. The entry is built at a temporary path unique to this run (``.<name>.tmp-<pid>-<random>``) in the
   same directory, checked, and moved into place with one ``rename(2)``, so readers see either no
   entry or a complete one.

Any failure becomes a :class:`ModelStoreError` that says what failed, where, and how to retry; the
temporary path is removed first, so a failed run leaves nothing half-written behind.
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from gymserve.engine.progress import PLAIN_INTERVAL_S, say

LOCK_REPORT_S = PLAIN_INTERVAL_S  # a run waiting for another one's lock says so this often


class ModelStoreError(RuntimeError):
    """A model could not be found, assembled or converted; the message says what failed, the path
    involved and how to retry."""


def cache_dir() -> Path:
    """``$GYMSERVE_CACHE``, else ``$XDG_CACHE_HOME/gymserve``, else ``~/.cache/gymserve``."""
    if os.environ.get("GYMSERVE_CACHE"):
        return Path(os.environ["GYMSERVE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "gymserve"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _space_hint(path: Path) -> str:
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return ""
    return f" ({free / 1e9:.1f} GB free there now)"


def _os_error(exc: OSError, what: str, where: Path) -> ModelStoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelStoreError(
            f"{what} failed: no space left on the device holding {where}{_space_hint(where)}; free some "
            "space or set GYMSERVE_CACHE to a directory on a larger disk, then re-run"
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return ModelStoreError(
            f"{what} failed: cannot write {exc.filename or where} ({exc.strerror}); make {where} writable "
            "or set GYMSERVE_CACHE to a writable directory, then re-run"
        )
    return ModelStoreError(
        f"{what} failed at {exc.filename or where}: {exc.strerror or exc}; re-run to try again (a failed run "
        "leaves nothing behind)"
    )


@contextmanager
def _locked(lock_path: Path, what: str):
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path))
    waited = 0.0
    while True:
        try:
            lock.acquire(timeout=LOCK_REPORT_S)
            break
        except Timeout:
            waited += LOCK_REPORT_S
            say(f"waiting for another gymserve process that is {what} (it holds {lock_path}), {waited:.0f} s so far")
        except OSError as exc:  # the lock file cannot be created (read-only cache, ...)
            raise _os_error(exc, what, lock_path.parent) from exc
    if waited:
        say(f"took over {lock_path} after waiting {waited:.0f} s")
    try:
        yield
    finally:
        lock.release()


def leftovers(dest: Path, legacy: Iterable[Path] = ()) -> list[Path]:
    """Temporary paths that runs building ``dest`` leave when killed, plus ``legacy`` names.

    Only meaningful while holding the entry's lock (then none of them is being written)."""
    name = glob.escape(dest.name)
    found = list(dest.parent.glob(f".{name}.tmp-*")) + list(dest.parent.glob(f".{name}.old-*"))
    return found + [p for p in legacy if p.exists() or p.is_symlink()]


def _publish(tmp: Path, dest: Path) -> None:
    # A directory cannot be renamed over a non-empty one: an incomplete entry is moved aside first.
    if dest.exists() or dest.is_symlink():
        aside = dest.with_name(f".{dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
        dest.rename(aside)
        tmp.rename(dest)
        _remove(aside)
    else:
        tmp.rename(dest)


def prepare_entry(
    dest: Path,
    build: Callable[[Path], object],
    *,
    is_complete: Callable[[Path], bool],
    what: str,
    legacy: Iterable[Path] = (),
) -> Path:
    """Return ``dest`` complete, building it with ``build(tmp)`` at most once at a time (see above).

    ``build`` receives a path that does not exist yet, in ``dest``'s directory, and must create the
    entry there (a file or a directory); ``is_complete(path)`` says whether a file or directory is a
    finished entry (it is asked about ``dest`` before and after taking the lock, and about ``tmp``
    before it is published). ``what`` names the work for messages ("preparing the embedded model").
    ``legacy``: fixed temporary paths of older versions, deleted with the other leftovers.

    Raises ModelStoreError naming the failure, the path and how to retry; ``build``'s own
    ModelStoreError passes through unchanged. KeyboardInterrupt is re-raised after the temporary
    path is removed.
    """
    if is_complete(dest):
        return dest
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _os_error(exc, what, parent) from exc
    with _locked(parent / f".{dest.name}.lock", what):
        if is_complete(dest):
            return dest
        for path in leftovers(dest, legacy):
            _remove(path)
        tmp = parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            build(tmp)
            if not is_complete(tmp):
                raise ModelStoreError(
                    f"{what} produced an incomplete result at {tmp} (a bug: please report it); it was "
                    "removed, re-run to try again"
                )
            _publish(tmp, dest)
        except ModelStoreError:
            _remove(tmp)
            raise
        except OSError as exc:
            _remove(tmp)
            raise _os_error(exc, what, parent) from exc
        except Exception as exc:
            _remove(tmp)
            raise ModelStoreError(
                f"{what} failed: {type(exc).__name__}: {exc}. Nothing was written to {dest}; fix the cause and re-run"
            ) from exc
        except BaseException:
            _remove(tmp)
            raise
    return dest
