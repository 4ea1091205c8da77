"""The per-rank entry point: run a script or module with failure reporting switched on.

``python -m meshpipe.launch.worker [-m module | script.py] [args...]`` runs the target as
``__main__``. When MESHPIPE_STATUS_DIR is set it also:

* records the runtime's ``meshpipe-status`` log line (emitted when a step fails) as this
  rank's report, and any other exception that escapes the script;
* asks the other ranks for a snapshot when it fails, and answers such requests itself
  from a watcher thread: where the main thread is and, inside a step, the pipeline's
  status (found on the main thread's stack, so nothing needs to register);
* reports where it was when the launcher stops it (SIGTERM, or SIGINT after Ctrl-C).

Without the variable (plain ``torchrun``) it only runs the target.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import signal
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import Any

from meshpipe.launch.report import (
    REQUEST_FILE,
    STATUS_DIR_ENV,
    RankReport,
    has_report,
    read_reports,
    write_report,
)

__all__ = ["main", "snapshot"]

_POLL_S = 0.1
_PEER_WAIT_S = 2.0  # how long a failing rank waits for the others' snapshots
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HIDDEN = (
    *(os.path.join(_PKG_DIR, d) + os.sep for d in ("runtime", "launch")),
    sysconfig.get_paths()["stdlib"] + os.sep,
    "<frozen ",  # the import system and runpy
)


def _hidden() -> tuple[str, ...]:
    """Path prefixes that are not the user's code: meshpipe's machinery, stdlib, torch."""
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    return _HIDDEN + ((os.path.dirname(torch_file) + os.sep,) if torch_file else ())


def _global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_pipeline(obj: object) -> bool:
    mod = sys.modules.get("meshpipe.runtime.pipeline")
    cls = getattr(mod, "Pipeline", None)
    return cls is not None and isinstance(obj, cls)


def _main_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def snapshot(frame: FrameType | None = None) -> tuple[dict[str, Any] | None, bool, str | None]:
    """(pipeline status, inside a step?, innermost user-code line) from the main thread.

    A Pipeline whose method is on the stack means the rank is inside a step; otherwise the
    first Pipeline found in a frame's local variables gives the last known status.
    """
    frame = frame if frame is not None else _main_frame()
    status: dict[str, Any] | None = None
    in_step = False
    where: str | None = None
    found: object | None = None
    hidden = _hidden()
    f = frame
    while f is not None:
        code = f.f_code
        if where is None and not code.co_filename.startswith(hidden):
            where = f"{os.path.basename(code.co_filename)}:{f.f_lineno} in {code.co_name}"
        local = f.f_locals
        if found is None and _is_pipeline(local.get("self")):
            found, in_step = local["self"], True
        if found is None:
            found = next((v for v in local.values() if _is_pipeline(v)), None)
        f = f.f_back
    if found is not None:
        try:
            status = found.status()  # type: ignore[attr-defined]
        except Exception:  # a half-built pipeline; the line of code still says enough
            status = None
    return status, in_step, where


class _Reporter:
    """Writes this rank's report once it knows something, and answers snapshot requests."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rank = _global_rank()
        self.failed = False
        self._lock = threading.RLock()  # re-entrant: a signal handler may run mid-write

    def failure(self, error: BaseException | None, status: dict[str, Any] | None) -> None:
        text = "" if error is None else f"{type(error).__name__}: {error}"
        _, in_step, where = snapshot(sys._getframe(1))
        if error is not None and error.__traceback__ is not None:
            where = _user_line(error.__traceback__) or where
        with self._lock:
            write_report(self.directory, RankReport(self.rank, "failed", text, status, True, where))
            self.failed = True
        open(os.path.join(self.directory, REQUEST_FILE), "a").close()

    def snap(self, kind: str) -> None:
        """Write where this rank is now, unless it already reported its own failure."""
        status, in_step, where = snapshot()
        with self._lock:
            if not self.failed:
                write_report(
                    self.directory, RankReport(self.rank, kind, None, status, in_step, where)
                )

    def watch(self) -> None:
        """Watcher thread: snapshot once when another rank asks."""
        request = os.path.join(self.directory, REQUEST_FILE)
        while not os.path.exists(request):
            time.sleep(_POLL_S)
        if not has_report(self.directory, self.rank):
            self.snap("snapshot")

    def wait_for_peers(self) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        deadline = time.monotonic() + _PEER_WAIT_S
        while time.monotonic() < deadline and len(read_reports(self.directory)) < world:
            time.sleep(_POLL_S)


def _user_line(tb: Any) -> str | None:
    hidden = _hidden()
    frames = [fs for fs in traceback.extract_tb(tb) if not fs.filename.startswith(hidden)]
    if not frames:
        return None
    fs = frames[-1]
    return f"{os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}"


class _StatusHandler(logging.Handler):
    """Turns the runtime's ``meshpipe-status {json}`` log record into this rank's report."""

    def __init__(self, reporter: _Reporter) -> None:
        super().__init__(logging.ERROR)
        self.reporter = reporter

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("meshpipe-status") or not record.args:
            return
        try:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            status = json.loads(str(args[0]))
            self.reporter.failure(sys.exc_info()[1], status)
        except Exception:  # never let reporting break the job's own error path
            self.handleError(record)


def _install(directory: str) -> _Reporter:
    reporter = _Reporter(directory)
    logging.getLogger("meshpipe").addHandler(_StatusHandler(reporter))
    threading.Thread(target=reporter.watch, name="meshpipe-report", daemon=True).start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        reporter.snap("stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return reporter


def _run_target(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m meshpipe.launch.worker [-m module | script.py] [args]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the target given by ``argv`` (default: sys.argv[1:]) as this rank's program."""
    args = list(sys.argv[1:] if argv is None else argv)
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory:
        _run_target(args)
        return
    reporter = _install(directory)
    try:
        _run_target(args)
        reporter.snap("finished")
    except SystemExit as e:
        if e.code in (None, 0):
            reporter.snap("finished")
        elif not reporter.failed:
            reporter.failure(e, None)
            reporter.wait_for_peers()
        raise
    except BaseException as e:
        if not reporter.failed:
            status = getattr(e, "meshpipe_status", None)
            reporter.failure(e, status if isinstance(status, dict) else None)
        reporter.wait_for_peers()
        raise


if __name__ == "__main__":
    main()
