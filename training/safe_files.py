"""Opening files in folders that other people can write to (a job's folder, a data folder)
without being led elsewhere: a planted link out of the folder, or something that is not a
regular file (a FIFO blocks a reader forever, /dev/zero never ends), is refused at once with a
message naming the file and what it is.

Standard library only: the service imports it without torch.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, Any


class RefusedFile(ValueError):
    """A file that is not a regular file inside the folder it was looked up in. `why` holds no
    path, so the service can word a refusal without showing where its folders are."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(path, why)  # both in args: the error pickles across Ray

    @property
    def path(self) -> str:
        return self.args[0]

    @property
    def why(self) -> str:
        return self.args[1]

    def __str__(self) -> str:
        return f"{self.path!r} {self.why}; refused"


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a folder"))


def require_regular(path: str | Path, mode: int) -> None:
    """RefusedFile unless `mode` (an st_mode) is a regular file's."""
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _KINDS if test(mode)), "an unknown kind of file")
        raise RefusedFile(str(path), f"is {kind}, not a regular file")


def contained(path: str | Path, folder: str | Path) -> Path:
    """`path` with every link resolved, if that lies inside `folder` (itself resolved): links
    that stay inside the folder are fine, one that leads out of it is refused."""
    resolved, root = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    if resolved != root and root not in resolved.parents:
        raise RefusedFile(str(path), "links out of its folder")
    return resolved


def open_regular(path: str | Path, *, inside: str | Path | None = None, text: bool = False,
                 **text_options: Any) -> IO[Any]:
    """Open `path` for reading if it is a regular file (links followed) and, with `inside`,
    lies inside that folder after resolving links; else RefusedFile. The open never blocks:
    O_NONBLOCK makes a FIFO open at once, and the descriptor's own type is checked, so a file
    swapped after the check is never read. A missing file raises FileNotFoundError."""
    target = contained(path, inside) if inside is not None else Path(path)
    # Inside a folder the resolved path has no link left; one there now was planted since.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if inside is not None else 0)
    try:
        fd = os.open(target, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise RefusedFile(str(path), "became a symbolic link while being opened") from None
        raise
    try:
        require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "r" if text else "rb", **text_options)
    except BaseException:
        os.close(fd)
        raise


def read_text(path: str | Path, *, inside: str | Path | None = None) -> str:
    """The UTF-8 text of a regular file (see open_regular), undecodable bytes replaced."""
    with open_regular(path, inside=inside, text=True, encoding="utf-8", errors="replace") as file:
        return file.read()


def regular_file(path: str | Path, *, inside: str | Path) -> Path:
    """The resolved path of a regular file inside `inside`, for a reader that opens files by
    name itself (h5py): checked without opening it, so nothing can block."""
    resolved = contained(path, inside)
    require_regular(path, os.stat(resolved).st_mode)
    return resolved


def os_error(err: OSError, doing: str) -> OSError:
    """`err` retold for a job's reason, "No space left on device (ENOSPC) writing <what>",
    rather than as the library that met it words it."""
    if err.errno is None:
        return OSError(f"{err} {doing}")
    name = errno.errorcode.get(err.errno, str(err.errno))
    return OSError(err.errno, f"{os.strerror(err.errno)} ({name}) {doing}")
