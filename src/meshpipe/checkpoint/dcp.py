"""DCP adapted to meshpipe's errors: its exceptions, and its writes' OS errors, as CheckpointError.

DCP raises ``CheckpointException`` (a BaseException) on every process when any process
fails; :func:`dcp_errors` turns it into a CheckpointError naming each process's error. A
write that the OS refuses (disk full, file size limit) often reaches DCP as torch.save's
``unexpected pos 704 vs 598``, the OSError hidden in its context: :class:`NamingFileSystem`
finds it and says what the OS said, naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import warnings
from collections.abc import Generator, Iterator

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["quiet_single_process", "dcp_errors", "NamingFileSystem", "os_error_text"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _failures(e: CheckpointException) -> str:
    """One line per failing process of a DCP exception (its message cut to 300 characters)."""
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        text = str(exc) if len(str(exc)) <= 300 else str(exc)[:300] + " ..."
        kind = "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "
        parts.append(f"rank {rank}: {kind}{text}")
    return "; ".join(parts)


@contextlib.contextmanager
def dcp_errors(what: str, path: str) -> Iterator[None]:
    """DCP's CheckpointException (raised on every process) as CheckpointError.

    The message names ``path`` and each process's error; DCP's tracebacks go to the debug log.
    """
    try:
        yield
    except CheckpointException as e:
        log.debug("DCP failed to %s: %s", what, e)
        raise CheckpointError(f"cannot {what}: {_failures(e)}", path=path) from None


def _os_error(e: BaseException | None) -> OSError | None:
    """The first OSError with an errno in ``e``'s chain of causes and contexts."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def os_error_text(e: OSError) -> str:
    """What the OS said: ``No space left on device (ENOSPC)``."""
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "?"
    return f"{e.strerror or os.strerror(e.errno or 0)} ({code})"


class NamingFileSystem(FileSystem):
    """DCP's local file system whose write streams name the file and the OS error that failed.

    Whatever fails while a stream is open for writing (the write, torch.save around it, the
    flush on close) is looked through for the OSError underneath.
    """

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except CheckpointError:
            raise
        except Exception as e:
            cause = _os_error(e)
            if cause is None:
                raise
            name = os.path.basename(os.fspath(path))
            raise CheckpointError(
                f"{name}: cannot be written: {os_error_text(cause)}", path=os.fspath(path)
            ) from e
