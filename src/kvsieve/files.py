"""The files a user hands kvsieve and the files it writes: when one fails, one line naming it and the fix.

* ``read_text(path)``: every text file kvsieve reads (data files, calibration text, prompts,
  results rows, ``run.json``) is read here, as UTF-8; a file that is not UTF-8 is refused naming
  its line and column and asking for it to be saved as UTF-8.
* ``check_output_dir`` / ``check_output_file``: an output path is checked *before* the work that
  fills it starts (a missing or read-only directory, an ``--out`` that names a file where a
  directory is wanted, an existing file of another kind), so no hour of work is lost at the end.
* ``write_atomic(path, data)``: a file written whole lands complete or not at all (a temporary
  file beside it, fsync, rename), and a write that fails is told as one line.
* ``OutputError``: the ``OSError`` all of these raise for a disk or path that fails: its message
  (``os_error_line``) names the file, what happened and what to do.  The ``kvsieve`` command shows
  it as one line, as it does any ``OSError`` that names a file.

Light on purpose (standard library only), so any module can use it without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Callable

from .checks import InputError

AGAIN = "run the same command again"
DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}  # no space, or over the user's quota


class OutputError(OSError):
    """A file or directory kvsieve cannot write (a full disk, a read-only directory, a path that
    names a file where a directory is wanted): ``str(err)`` is one line naming it and the fix."""

    def __init__(self, code: int | None, message: str):
        super().__init__(code, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def os_error_line(err: OSError, path: str | os.PathLike, doing: str, again: str = AGAIN) -> str:
    """One line for ``err``, met at ``path`` while ``doing`` (e.g. "writing rows"): what happened
    and what to do; ``again`` is how to go on once the cause is fixed."""
    code = err.errno
    if code in DISK_FULL:
        return f"{path}: the disk is full ({err.strerror}) while {doing}; free some space, then {again}"
    if code == errno.EFBIG:
        return f"{path}: the file grew past the size limit ({err.strerror}, see ulimit -f) while {doing}; " \
               f"raise the limit, then {again}"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{path}: not writable ({err.strerror}) while {doing}; make it writable or choose another output path"
    if code == errno.ENOTDIR:
        return f"{path}: a part of this path is a file, not a directory; choose another output path"
    if code == errno.EISDIR:
        return f"{path} is a directory; give a file path"
    if code == errno.ENOENT:
        return f"{path}: its directory does not exist; create it (mkdir -p {Path(path).parent}) or choose another " \
               "output path"
    return f"{path}: {err.strerror or err} while {doing}"


def failure_line(err: OSError) -> str | None:
    """One line for an ``OSError`` that reached the command line: an ``OutputError``'s message, or for
    another error that names its file, that file and what happened (with the fix when it is a full
    or read-only disk); None for an error that names no file (a bug: its traceback is kept)."""
    if isinstance(err, OutputError):
        return str(err)
    if not err.filename or err.errno is None:
        return None
    if err.errno in DISK_FULL | {errno.EFBIG, errno.EROFS}:
        return os_error_line(err, err.filename, "writing it")
    other = f" -> {err.filename2}" if err.filename2 else ""
    return f"{err.filename}{other}: {err.strerror}"


def output_error(err: OSError, path: str | os.PathLike, doing: str, again: str = AGAIN) -> OutputError:
    """``err`` as an ``OutputError`` (its errno kept) with ``os_error_line``'s message."""
    return OutputError(err.errno, os_error_line(err, path, doing, again))


def read_text(path: str | os.PathLike, error: type[ValueError] = InputError) -> str:
    """The UTF-8 text of ``path``; ``error`` (a ValueError) naming the file and the line and column of
    the first byte that is not UTF-8 (save it as UTF-8), or saying the file is missing or a directory."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path} is a directory; give a file")
    if path.exists() and not path.is_file():
        raise error(f"{path} is not a regular file (a device or a pipe); give a file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path} does not exist") from None
    except OSError as err:
        raise error(f"{path}: cannot be read ({err.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); "
                    "save the file as UTF-8") from None


def read_lines(path: str | os.PathLike, error: type[ValueError] = InputError) -> list[str]:
    """``read_text(path)`` cut at each newline (line i + 1 is item i; the last item is what follows
    the last newline, "" when the file ends with one).  Only "\\n" ends a line: ``str.splitlines``
    also cuts at characters a JSON string may hold (U+2028, U+0085), and would break such a row."""
    return read_text(path, error).split("\n")


def check_writable(directory: str | os.PathLike, flag: str = "--out") -> None:
    """An ``OutputError`` unless existing directory ``directory`` can be written."""
    directory = Path(directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        reason = "on a read-only file system" if _read_only_fs(directory) else "no write permission"
        raise OutputError(errno.EACCES, f"{flag} {directory}: the directory is not writable ({reason}); make it "
                                        "writable or choose another output path")


def _read_only_fs(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return False


def check_output_dir(directory: str | os.PathLike, flag: str = "--out",
                     fix: str = "give a directory (it is created if missing)") -> Path:
    """Create output directory ``directory`` unless it exists and check that it can be written, before
    any work: an ``OutputError`` when it names a file (``fix``: what to do then), or cannot be
    created or written.  ``flag`` names it in the messages (``--out``)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputError(errno.ENOTDIR, f"{flag} {directory} is a file, not a directory; {fix}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(err.errno, f"{flag} {directory}: cannot create the directory ({err.strerror}); "
                                     "choose another output path") from None
    check_writable(directory, flag)
    return directory


def reads(read: Callable[[Path], object], path: Path) -> bool:
    """Whether ``read(path)`` reads ``path`` without a ValueError: a file of the kind ``read`` reads
    (``check_output_file``'s ``ours``)."""
    try:
        read(path)
    except ValueError:
        return False
    return True


def check_output_file(path: str | os.PathLike, flag: str = "--out", force: bool = False,
                      ours: Callable[[Path], bool] | None = None, what: str = "output file") -> Path:
    """Check, before any work, that output file ``path`` can be written: its directory exists (it is
    created if missing) and is writable, it is no directory, and an existing file is overwritten only when ``ours(file)`` says it
    holds a ``what`` (a file of the same kind) or with ``force``.  A symbolic link is followed: the file
    it points to is checked, and is the path returned (write there, so the link stays)."""
    given = Path(path)
    target = given.resolve() if given.is_symlink() else given
    via = f" (a link to {target})" if target != given else ""
    if target.is_dir():
        raise OutputError(errno.EISDIR, f"{flag} {given}{via} is a directory; give a file path")
    check_output_dir(target.parent, f"{flag} {given}{via}: its directory", f"choose another {flag}")
    if target.exists() and not force and (ours is None or not ours(target)):
        raise OutputError(errno.EEXIST, f"{flag} {given}{via} exists and is not a {what}; choose another {flag}, or "
                                        "pass --force to overwrite it")
    return target


def write_atomic(path: str | os.PathLike, data: str | bytes | Callable[[Path], object],
                 doing: str = "writing it") -> Path:
    """Write ``path`` whole or not at all: ``data`` (text as UTF-8, bytes, or a function that writes a
    given temporary path) goes to a file beside it, is synced and renamed over ``path``.  An ``OSError``
    (a full disk, a read-only directory) is an ``OutputError`` naming ``path``; the old file is kept.
    Whatever stops the write (an error of ``data``'s own, Ctrl-C) leaves no temporary file behind.
    A function must let a failed write's ``OSError`` through: ``torch.save`` to a path turns a full
    disk into a ``RuntimeError`` that names neither (``model_files.save_file`` writes through Python)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise output_error(err, path, doing) from None
        raise
    return path


# A setting that names a file is recorded by its content, not its path: ``sha256:`` and the digest
FILE_DIGEST = "sha256:"


def file_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the file's bytes, read in 1 MiB blocks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return FILE_DIGEST + digest.hexdigest()


def pinned_by_content(settings: dict) -> dict:
    """``settings`` with every value that names an existing file (TriAttention's ``stats=FILE``)
    replaced by its ``file_digest``, so a record of them says what ran wherever the file lies."""
    return {k: file_digest(v) if isinstance(v, str) and "\n" not in v and Path(v).is_file() else v
            for k, v in settings.items()}
