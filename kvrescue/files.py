"""How kvrescue opens files: the one place for both rules (docs/security.md).

Reading: only a regular file is read (a link to one is fine); a FIFO, a device, a socket or a folder is a
one-line error, and opening never blocks on a FIFO. Formats with a natural size (config files) are read
with a bound.

Writing: every file written under an output root (`--out`, a run folder's parents included) is reached
through folders opened one by one without following links (openat-style), is itself opened without
following links, and must be a regular file with one name or absent; anything else is a one-line error
and nothing is written. The root itself is the user's own path and may be a link they made.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO, Iterable

from kvrescue.errors import InputError

CONFIG_LIMIT = 64 << 20  # config.json, generation_config.json, summary.json: far below this

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


def kind(mode: int) -> str:
    """What a file of this mode is, in words ("a FIFO", "a folder", ...)."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refused(path: Path | str, message: str, error: type[Exception]) -> Exception:
    return error(f"{path}: {message}")


def open_regular(path: Path | str, error: type[Exception] = InputError, what: str = "a regular file") -> BinaryIO:
    """`path` opened for reading when it is a regular file (or a link to one); else `error`, one line, saying
    the file should be `what`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _refused(path, "no such file", error) from None
    except OSError as e:
        raise _refused(path, f"cannot read ({e.strerror})", error) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refused(path, f"is {kind(mode)}, not {what}", error)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_regular(path: Path | str, limit: int | None = None, error: type[Exception] = InputError) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (a larger file is `error`)."""
    with open_regular(path, error) as f:
        return read_bounded(f, path, limit, error)


def read_bounded(f: BinaryIO, path: Path | str, limit: int | None, error: type[Exception] = InputError) -> bytes:
    """All of an open file, refusing one over `limit` bytes (checked as read, since /proc files say size 0)."""
    try:
        data = f.read() if limit is None else f.read(limit + 1)
    except OSError as e:
        raise _refused(path, f"cannot read ({e.strerror})", error) from None
    if limit is not None and len(data) > limit:
        raise _refused(path, f"larger than {limit >> 20} MiB, which no file of this kind needs", error)
    return data


def check_regular(path: Path | str, error: type[Exception] = InputError) -> Path:
    """`path` when it is a regular file (or a link to one), for files a library opens itself; else `error`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise _refused(path, "no such file", error) from None
    except OSError as e:
        raise _refused(path, f"cannot read ({e.strerror})", error) from None
    if not stat.S_ISREG(mode):
        raise _refused(path, f"is {kind(mode)}, not a regular file", error)
    return Path(path)


class OutputFolder:
    """A folder under an output root, held open by descriptor; every file in it is reached without links."""

    def __init__(self, fd: int, path: Path, error: type[Exception]) -> None:
        self.fd, self.path, self.error = fd, path, error

    @classmethod
    def open(cls, root: Path | str, below: Iterable[str] = (), *, error: type[Exception] = InputError,
             purpose: str = "an output folder") -> OutputFolder:
        """`root` (created with its parents when missing), then each folder name of `below` in turn, created
        when missing and opened without following a link; `purpose` names the folder in errors."""
        folder = cls._walk(Path(root), below, error, purpose, create=True)
        assert folder is not None
        return folder

    @classmethod
    def existing(cls, root: Path | str, below: Iterable[str] = (), *, error: type[Exception] = InputError,
                 purpose: str = "an output folder") -> OutputFolder | None:
        """The folder `open` opens, if it is there: nothing is created, and None when `root` or a folder of
        `below` is missing (a link or anything else it could not open is the same error as `open`'s)."""
        return cls._walk(Path(root), below, error, purpose, create=False)

    @classmethod
    def _walk(cls, root: Path, below: Iterable[str], error: type[Exception], purpose: str,
              create: bool) -> OutputFolder | None:
        missing = () if create else FileNotFoundError  # what, not creating, means "not there": None
        try:
            if create:
                root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except missing:
            return None
        except OSError as e:
            raise _refused(root, f"cannot use as {purpose} ({e.strerror})", error) from None
        path = root
        for name in below:
            if name in ("", ".", "..") or "/" in name:
                os.close(fd)
                raise _refused(path, f"{name!r} is not a folder name", error)
            path = path / name
            try:
                if create:
                    with suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except missing:
                os.close(fd)
                return None
            except OSError as e:
                os.close(fd)
                raise _refused(path, _why_not(e, "folder"), error) from None
            os.close(fd)
            fd = child
        return cls(fd, path, error)

    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def has(self, name: str) -> bool:
        """Whether the folder holds the regular file `name` (False: absent); a link or a special file there is
        `self.error`."""
        st = self._lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _refused(self.path / name, f"is {kind(st.st_mode)}; kvrescue reads and writes only regular files "
                           "here", self.error)
        return st is not None

    def open_file(self, name: str, flags: int, mode: int = 0o666, shown: str | None = None) -> int:
        """A descriptor of the regular file `name` opened with `flags` (os.O_*) without following a link;
        a link, a special file or a file with other names (hard links) is `self.error`, naming `shown` (the file
        the user named, where `name` is a temporary file beside it) or `name`."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except OSError as e:
            raise _refused(self.path / (shown or name), _why_not(e, "file"), self.error) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            what = kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names (hard links)"
            raise _refused(self.path / name, f"is {what}; kvrescue writes only its own regular files here",
                           self.error)
        os.set_blocking(fd, True)
        return fd

    def read(self, name: str, limit: int | None = None) -> bytes | None:
        """The bytes of the regular file `name` (None when absent), read without following a link."""
        if not self.has(name):
            return None
        with os.fdopen(self.open_file(name, os.O_RDONLY), "rb") as f:
            return read_bounded(f, self.path / name, limit, self.error)

    def unlink(self, name: str) -> None:
        """Remove the file `name` when present (a link itself, never its target)."""
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def write_atomic(self, name: str, payload: bytes) -> None:
        """Write `payload` to a temporary file here, fsync it, then rename it over `name`: readers see the old
        file or the new one, never half of one. `name` must be a regular file or absent. The file gets the mode
        a plain write would give it: that of the file it replaces, else 0666 less the umask."""
        old = self._lstat(name) if self.has(name) else None
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = self.open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, shown=name)
            try:
                with os.fdopen(fd, "wb") as f:
                    if old is not None:  # a new file keeps 0666 less the umask
                        os.fchmod(f.fileno(), old.st_mode & 0o7777)
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                self.unlink(tmp)
                raise
            os.fsync(self.fd)
        except OSError as e:
            raise _refused(self.path / name, f"cannot write ({e.strerror})", self.error) from None

    def close(self) -> None:
        """Release the folder's descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why_not(e: OSError, what: str) -> str:
    """The one-line reason an entry of an output folder could not be opened as a `what`."""
    if e.errno == errno.ELOOP or (what == "folder" and e.errno == errno.ENOTDIR):
        return (f"is a symbolic link or not a {what}; kvrescue follows no links and writes only its own "
                "files under an output folder")
    if e.errno == errno.ENXIO:
        return "is a FIFO or socket; kvrescue writes only regular files here"
    return f"cannot open ({e.strerror})"


def write_file_atomic(path: Path | str, payload: bytes, error: type[Exception] = InputError) -> None:
    """Write one output file (`--out FILE`, `--plot FILE`) atomically: its folder (created when missing) is
    the user's own; the file itself must be a regular file or absent."""
    path = Path(path)
    with OutputFolder.open(path.parent, error=error) as folder:
        folder.write_atomic(path.name, payload)
