"""The one output guard: every file and folder hf_mloss writes is checked before the work, written beside its
target and renamed into place.

* :func:`check_output_dir` (folders: merges, report folders) and :func:`check_output_file` (``--json`` reports,
  configs) refuse, before anything is computed, a target that is an input of the run or inside one or holding one
  (models, base, processor, heads, shares, data, the config file), a symbolic link, a device or other special file,
  the current working folder, and an existing target unless ``overwrite``.
* :func:`write_file` writes a file to a temporary sibling, syncs it and renames it into place (``overwrite`` is the
  only way to replace one; a kill leaves the previous file or the new one).
* :func:`check_output_dir` refuses, before anything is computed, an output folder that overlaps an input (the
  models, the data, the config file), a symbolic link, a path under a file, an unwritable or too-full filesystem,
  and an existing non-empty folder unless ``overwrite``; even with ``overwrite``, a folder hf_mloss did not write
  (no ``hf_mloss_files.json``, or files and folders that it does not list, e.g. ``.git/``) is refused, naming them
  (:func:`check_replaceable`); an empty folder is fine.
* :func:`atomic_folder` writes into a hidden temporary sibling (``.hf_mloss-tmp-<pid>-…``) and renames it into place
  at the end: the folder appears complete or not at all. An existing folder is replaced only at that final rename,
  and only with ``overwrite``. The temporary folder is removed on every exit path (exceptions, Ctrl-C, SIGTERM);
  ones left by a killed process (``kill -9``) are removed by the next save into the same parent folder.
* Crash-consistent replacement: the new folder is swapped with the old one in one ``renameat2(RENAME_EXCHANGE)``
  where the filesystem has it; elsewhere the old folder is moved to a hidden backup whose target name is recorded
  first, and a save or check in the same parent after a kill restores that backup when the target is missing.
* Files and folders get the modes the user's umask gives (0755 / 0644 under umask 022), not ``mkdtemp``'s 0700.
* Every file written is listed in ``hf_mloss_files.json`` (name and size), which ``push`` uses as its allow-list.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import sys
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import InvalidParameterError, OutputExistsError, SaveError

TMP_PREFIX = ".hf_mloss-tmp-"
MANIFEST_NAME = "hf_mloss_files.json"
RECORD_SUFFIX = ".target"
"""A backup folder's sidecar file holding the name of the folder it must be restored to after a kill."""
_SPACE_MARGIN = 1.05


def check_output_dir(target: str | os.PathLike[str], *, overwrite: bool = False,
                     protected: Iterable[str | os.PathLike[str]] = (), needed_bytes: int = 0) -> Path:
    """Refuse an output folder that cannot or must not be written (see the module docstring); returns it.

    Args:
        target: the output folder.
        overwrite: allow replacing an existing non-empty folder (at the final rename only).
        protected: paths the output must not overlap (input model folders, data folders, the config file).
        needed_bytes: estimated size of the output, checked against the free space.

    Raises:
        OutputExistsError: the folder exists and is not empty (without ``overwrite``), or is a file.
        InvalidParameterError: overlap with an input, a symlink, a path under a file, no write permission, a name
            too long, or not enough free space.
    """
    target = Path(os.fspath(target)).expanduser()
    absolute = Path(os.path.abspath(target))
    parent = _existing_ancestor(absolute.parent)
    limit = _name_max(parent)
    for part in absolute.parts:
        if len(part.encode()) > limit:
            raise InvalidParameterError(f"Output folder name {part[:40]!r}... is {len(part.encode())} bytes; this "
                                        f"filesystem allows {limit}. Choose a shorter name.")
    if target.is_symlink():
        raise InvalidParameterError(f"Output folder {str(target)!r} is a symbolic link (to {os.readlink(target)!r}); "
                                    "pass the real folder path instead.")
    _check_overlap(absolute, protected)
    if parent.is_dir():
        recover_interrupted(parent)
    if target.exists():
        if not target.is_dir():
            raise OutputExistsError(f"Output path {str(target)!r} is a file; choose a folder path.")
        if _cwd().is_relative_to(os.path.realpath(absolute)):
            raise InvalidParameterError(f"Output folder {str(target)!r} is the current working folder or holds it: "
                                        "replacing it would pull the folder from under this process. Write to a new "
                                        "subfolder (e.g. ./merged) instead.")
        if any(target.iterdir()) and not overwrite:
            raise OutputExistsError(f"Output folder {str(target)!r} already exists and is not empty; pass "
                                    "overwrite=True (CLI: --overwrite) to replace it, or choose another folder.")
        check_replaceable(target)
    if not parent.is_dir():
        raise InvalidParameterError(f"Output folder {str(target)!r} cannot be created: {str(parent)!r} is a file.")
    _probe_writable(target, parent)
    if needed_bytes:
        free = shutil.disk_usage(parent).free
        if free < needed_bytes * _SPACE_MARGIN:
            raise InvalidParameterError(f"Not enough free space for {str(target)!r}: the merge needs about "
                                        f"{needed_bytes / 1e6:.1f} MB and {str(parent)!r} has {free / 1e6:.1f} MB free.")
    return target


def check_output_file(target: str | os.PathLike[str], *, overwrite: bool = False,
                      protected: Iterable[str | os.PathLike[str]] = (), what: str = "Output file") -> Path:
    """Refuse an output file that cannot or must not be written (see the module docstring); returns it.

    Raises:
        OutputExistsError: the file exists (without ``overwrite``).
        InvalidParameterError: overlap with an input, a symbolic link, a folder, a device or other special file, a
            path under a file, no write permission or a name too long.
    """
    target = Path(os.fspath(target)).expanduser()
    absolute = Path(os.path.abspath(target))
    parent = _existing_ancestor(absolute.parent)
    limit = _name_max(parent)
    if len(absolute.name.encode()) > limit:
        raise InvalidParameterError(f"{what} name {absolute.name[:40]!r}... is {len(absolute.name.encode())} bytes; "
                                    f"this filesystem allows {limit}. Choose a shorter name.")
    if target.is_symlink():
        raise InvalidParameterError(f"{what} {str(target)!r} is a symbolic link; hf_mloss never writes through one. "
                                    "Pass the real file path instead.")
    _check_overlap(absolute, protected, what)
    if target.exists():
        if target.is_dir():
            raise InvalidParameterError(f"{what} {str(target)!r} is a folder; give a file path.")
        if not target.is_file():
            raise InvalidParameterError(f"{what} {str(target)!r} is not a regular file (a device, pipe or socket); "
                                        "give the path of a file to create.")
        if not overwrite:
            raise OutputExistsError(f"{what} {str(target)!r} already exists; pass overwrite=True (CLI: --overwrite) "
                                    "to replace it, or choose another path.")
    if not parent.is_dir():
        raise InvalidParameterError(f"{what} {str(target)!r} cannot be created: {str(parent)!r} is a file.")
    _probe_writable(target, parent)
    return target


def write_file(target: str | os.PathLike[str], content: str | bytes, *, overwrite: bool = False,
               protected: Iterable[str | os.PathLike[str]] = (), what: str = "Output file") -> Path:
    """Write ``content`` to ``target`` through a synced temporary sibling renamed into place (checked first with
    :func:`check_output_file`): the previous file or the new one, never a half-written one.

    Raises:
        SaveError: the write failed (disk full...), naming the file; nothing was changed.
    """
    target = check_output_file(target, overwrite=overwrite, protected=protected, what=what)
    data = content.encode("utf-8") if isinstance(content, str) else content
    with _sigterm_raises():  # a SIGTERM raises here, so the temporary file is removed on the way out
        _write_through_temporary(target, data, overwrite=overwrite, what=what)
    return target


def _write_through_temporary(target: Path, data: bytes, *, overwrite: bool, what: str) -> None:
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _sigterm_held():  # the file is created and named at once
            fd, name = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=target.parent)
            tmp = Path(name)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 -> what a plain open() would give
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise InvalidParameterError(f"{what} {str(target)!r} became a link or special file while writing; "
                                        "nothing was written.")
        if overwrite:
            os.replace(tmp, target)
        else:
            try:
                os.link(tmp, target)  # never replaces: fails if something appeared there meanwhile
            except FileExistsError:
                raise OutputExistsError(f"{what} {str(target)!r} was created by something else meanwhile; nothing "
                                        "was replaced.") from None
            except OSError:  # no hard links on this filesystem
                os.replace(tmp, target)
    except OSError as err:
        if isinstance(err, OutputExistsError):
            raise
        raise SaveError(f"Writing {what.lower()} {str(target)!r} failed: {err.strerror or err}; nothing was written."
                        ) from None
    finally:
        if tmp is not None:
            with _sigterm_held():
                tmp.unlink(missing_ok=True)


def _probe_writable(target: Path, parent: Path) -> None:
    """Create and remove a temporary folder where the output will be written: permissions, read-only filesystems
    and quotas show up now, not after the merge. A SIGTERM waits until the folder is gone again."""
    try:
        with _sigterm_raises(), _sigterm_held():
            os.rmdir(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-probe-", dir=parent))
    except OSError as err:
        reason = "the filesystem is read-only" if err.errno == errno.EROFS else (err.strerror or str(err))
        raise InvalidParameterError(f"Output folder {str(target)!r} cannot be written: {reason} ({str(parent)!r}).") \
            from None


def _check_overlap(target: Path, protected: Iterable[str | os.PathLike[str]], what: str = "Output folder") -> None:
    resolved_target = Path(os.path.realpath(target))
    for item in protected:
        if item is None or not isinstance(item, (str, os.PathLike)):
            continue
        path = Path(os.path.realpath(os.path.expanduser(os.fspath(item))))
        for candidate in {target, resolved_target}:
            if candidate == path or path.is_relative_to(candidate) or candidate.is_relative_to(path):
                raise InvalidParameterError(
                    f"{what} {str(target)!r} overlaps an input ({str(path)!r}): writing or replacing it could "
                    f"delete or corrupt that input. Choose an output path outside the inputs.")


def _cwd() -> Path:
    try:
        return Path(os.path.realpath(os.getcwd()))
    except OSError:  # the working folder was deleted
        return Path("/nonexistent-cwd")


def _existing_ancestor(path: Path) -> Path:
    while path != path.parent:
        try:
            if path.exists():
                break
        except OSError:  # a component too long to even look up
            pass
        path = path.parent
    return path


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike[str], *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder to write into; on success it becomes ``target`` (see the module docstring)."""
    target = Path(os.path.abspath(Path(os.fspath(target)).expanduser()))
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)
    with _sigterm_raises():
        tmp = None
        try:
            with _sigterm_held():  # the folder is created and named at once: a SIGTERM cannot fall in between
                tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=target.parent))
            try:
                yield tmp
                write_manifest(tmp)
                apply_umask(tmp)
            except OSError as err:
                raise SaveError(f"Writing {str(target)!r} failed: {err.strerror or err}; nothing was written (the "
                                "partial copy was removed).") from None
            _rename_into_place(tmp, target, overwrite=overwrite)
        finally:
            if tmp is not None:
                with _sigterm_held():  # the cleanup runs to its end; a SIGTERM that came meanwhile is raised after it
                    shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (read from ``/proc`` on Linux; elsewhere set and put back at once)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a plain ``mkdir`` / ``open`` would have: ``mkdtemp`` makes a
    0700 folder and some writers 0600 files, so a merge renamed into place would be private to its owner (under
    umask 022: folders 0755, files 0644, as the user expects)."""
    mask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _rename_into_place(tmp: Path, target: Path, *, overwrite: bool) -> None:
    if not target.exists() and not target.is_symlink():
        try:
            os.rename(tmp, target)  # fails if another process created a non-empty folder there meanwhile
            return
        except OSError as err:
            if not target.exists():
                raise
            if not overwrite:
                raise OutputExistsError(f"Output folder {str(target)!r} was created by something else while this "
                                        "merge ran; nothing was replaced. Choose another folder.") from err
    if target.is_symlink() or not target.is_dir():
        raise OutputExistsError(f"Output path {str(target)!r} is not a folder; nothing was replaced.")
    if any(target.iterdir()) and not overwrite:
        raise OutputExistsError(f"Output folder {str(target)!r} already exists and is not empty; pass overwrite=True "
                                "(CLI: --overwrite) to replace it.")
    check_replaceable(target)
    if _exchange(tmp, target):  # one atomic swap: at every instant the old folder or the new one is in place
        return  # the old folder is now at ``tmp``, which the caller removes
    backup = target.parent / f"{TMP_PREFIX}{os.getpid()}-old-{secrets.token_hex(6)}"
    record = backup.with_name(backup.name + RECORD_SUFFIX)
    with _sigterm_held():  # SIGTERM waits for the swap and the backup's removal; SIGKILL is what the record is for
        record.write_text(target.name, encoding="utf-8")  # a kill from here on: the next save restores the backup
        os.rename(target, backup)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(backup, target)
            record.unlink(missing_ok=True)
            raise
        record.unlink(missing_ok=True)
        shutil.rmtree(backup, ignore_errors=True)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where not supported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0


def recover_interrupted(parent: Path) -> None:
    """Put back a folder that a killed save had moved to its backup before renaming the new one in (the target is
    missing: the backup is restored; the target is present: the backup is removed)."""
    try:
        records = [e for e in parent.iterdir() if e.name.startswith(TMP_PREFIX) and e.name.endswith(RECORD_SUFFIX)]
    except OSError:
        return
    for record in records:
        backup = record.with_name(record.name[: -len(RECORD_SUFFIX)])
        if _alive_owner(backup.name):
            continue
        try:
            name = record.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            continue
        target = parent / name
        if backup.is_dir() and not backup.is_symlink() and name and "/" not in name and name not in (".", ".."):
            if not target.exists() and not target.is_symlink():
                os.rename(backup, target)
            else:
                shutil.rmtree(backup, ignore_errors=True)
        record.unlink(missing_ok=True)


def remove_stale_temporaries(parent: Path) -> None:
    """Remove temporary files and folders left in ``parent`` by hf_mloss processes that no longer run
    (``kill -9``), after restoring any backup whose target is missing (:func:`recover_interrupted`)."""
    recover_interrupted(parent)
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(TMP_PREFIX) or entry.is_symlink() or _alive_owner(entry.name):
            continue
        if "-old-" in entry.name:  # a backup without its record (older versions): it may be the only copy
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.is_file() and not entry.name.endswith(RECORD_SUFFIX):
            entry.unlink(missing_ok=True)


def _alive_owner(name: str) -> bool:
    """Whether the process whose id a temporary name carries still runs (unknown ids count as running)."""
    pid = name[len(TMP_PREFIX):].split("-", 1)[0]
    return not (pid.isascii() and pid.isdigit()) or process_alive(int(pid))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_HOLD = {"depth": 0, "pending": None}
"""Held sections open in the main thread, and the SIGTERM that arrived during one (raised when the last closes)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into an exception in the block, so ``finally`` clauses run (the default handler kills); inside
    a :func:`_sigterm_held` section the exception waits for the section's end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if _HOLD["depth"]:
            _HOLD["pending"] = signum
            return
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """Hold SIGTERM in the block (it is raised when the block ends), so that creating or removing a temporary
    folder is never cut in the middle. Python runs signal handlers in the main thread whichever thread the kernel
    delivered the signal to, so the hold is kept there (a per-thread signal mask would miss a signal delivered to
    another thread, such as a BLAS or I/O worker)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
        signum, _HOLD["pending"] = (_HOLD["pending"], None) if not _HOLD["depth"] else (None, _HOLD["pending"])
        if signum is not None:
            raise SystemExit(128 + signum)


def check_replaceable(target: Path) -> None:
    """``overwrite`` replaces only a folder hf_mloss wrote: an empty one, or one whose every file and subfolder its
    :data:`MANIFEST_NAME` lists (a file's content may have changed, e.g. an edited card; nothing may be added).

    Raises:
        OutputExistsError: naming what was found (no manifest: the folder's first entries; else the entries the
            manifest does not list, such as ``.git/`` or a user's notes).
    """
    entries = sorted(target.iterdir())
    if not entries:
        return
    try:
        listed = set(read_manifest(target))
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if listed is None:
        raise OutputExistsError(
            f"Output folder {str(target)!r} was not written by hf_mloss (it has no valid {MANIFEST_NAME}) and holds "
            f"{_describe_entries(target, entries)}; overwrite replaces only a folder hf_mloss wrote. Nothing was "
            "changed: choose another folder, or move that one away yourself.")
    owned_dirs = {parent.as_posix() for name in listed for parent in Path(name).parents if parent != Path(".")}
    unknown = []
    for root, dirs, files in os.walk(target):
        for name in [*dirs, *files]:
            path = Path(root) / name
            relative = path.relative_to(target).as_posix()
            is_dir = path.is_dir() and not path.is_symlink()
            if relative == MANIFEST_NAME or (relative in owned_dirs if is_dir else relative in listed):
                continue
            unknown.append(path)
        dirs[:] = [d for d in dirs if (Path(root) / d).relative_to(target).as_posix() in owned_dirs]
    if unknown:
        raise OutputExistsError(
            f"Output folder {str(target)!r} holds {_describe_entries(target, unknown)}, which hf_mloss did not write "
            f"(not in its {MANIFEST_NAME}); overwrite replaces only what hf_mloss wrote. Nothing was changed: move "
            "those away, or choose another folder.")


def _describe_entries(folder: Path, paths: list[Path], shown: int = 5) -> str:
    names = [p.relative_to(folder).as_posix() + ("/" if p.is_dir() and not p.is_symlink() else "") for p in paths]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


def write_manifest(folder: Path) -> None:
    """List every regular file of ``folder`` (relative path and size) in :data:`MANIFEST_NAME`."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != MANIFEST_NAME:
            files[path.relative_to(folder).as_posix()] = path.stat().st_size
    (folder / MANIFEST_NAME).write_text(json.dumps({"files": files}, indent=1) + "\n")


def read_manifest(folder: Path) -> dict[str, int]:
    """The files a save wrote (``{relative path: size}``); raises ``ValueError`` when missing or malformed."""
    data = json.loads((folder / MANIFEST_NAME).read_text())
    files = data["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
        raise ValueError("malformed file list")
    return files
