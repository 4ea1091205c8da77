"""The per-rank entry point: run a script or module with failure reporting switched on.

``python -m meshpipe.launch.worker [-m module | script.py] [args...]`` runs the target as
``__main__``. When MESHPIPE_STATUS_DIR is set it also:

* records the runtime's ``meshpipe-status`` log line (emitted when a step fails) as this
  rank's report, and any other exception that escapes the script;
* asks the other ranks for a snapshot when it fails, and answers such requests itself
  from a watcher thread: where the main thread is and, inside a step, the pipeline's
  status (found on the main thread's stack, so nothing needs to register);
* reports where it was when the launcher stops it (SIGTERM, or SIGINT after Ctrl-C);
* registers its pid, so that the launcher can end it promptly once a rank has failed
  (:mod:`meshpipe.launch.supervise`).

Without the variable (plain ``torchrun``) it only runs the target.
"""

from __future__ import annotations

import atexit
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
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from meshpipe.launch.report import (
    REQUEST_FILE,
    STATUS_DIR_ENV,
    RankReport,
    has_report,
    read_reports,
    write_report,
)
from meshpipe.launch.supervise import register

__all__ = ["main", "snapshot", "Snapshot"]

_POLL_S = 0.1
_PEER_WAIT_S = 1.0  # how long a failing rank waits for the others' snapshots
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEMO_DIR = os.path.join(_PKG_DIR, "demo") + os.sep  # the demo is user code, the rest is not
_LAUNCH_DIR = os.path.join(_PKG_DIR, "launch") + os.sep  # this reporting machinery
_HIDDEN = (_PKG_DIR + os.sep, sysconfig.get_paths()["stdlib"] + os.sep, "<frozen ")


def _is_user_code(filename: str) -> bool:
    """False for meshpipe's machinery, the standard library, the import system and torch."""
    if filename.startswith(_DEMO_DIR):
        return True
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    hidden = _HIDDEN + ((os.path.dirname(torch_file) + os.sep,) if torch_file else ())
    return not filename.startswith(hidden)


def _global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _is_pipeline(obj: object) -> bool:
    mod = sys.modules.get("meshpipe.runtime.pipeline.pipeline")
    cls = getattr(mod, "Pipeline", None)
    return cls is not None and isinstance(obj, cls)


def _main_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident or -1)


def _stack(frame: FrameType | None) -> list[tuple[FrameType, int]]:
    """(frame, line) pairs from ``frame`` outwards."""
    out = []
    while frame is not None:
        out.append((frame, frame.f_lineno))
        frame = frame.f_back
    return out


def _traceback(tb: TracebackType | None) -> list[tuple[FrameType, int]]:
    """(frame, line) pairs of a traceback, innermost first."""
    out = []
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out[::-1]


@dataclass
class Snapshot:
    """Where a rank is: its pipeline's status, whether a step is running, and two lines of
    code: the innermost of the user's (``where``) and of meshpipe's machinery (``inside``)."""

    status: dict[str, Any] | None = None
    in_step: bool = False
    where: str | None = None
    inside: str | None = None


def _line(frame: FrameType, lineno: int) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{lineno} in {frame.f_code.co_name}"


def snapshot(frames: list[tuple[FrameType, int]] | None = None) -> Snapshot:
    """Read a stack (default: the main thread's), innermost frame first.

    A Pipeline whose method is on the stack means the rank is inside a step; otherwise the
    first Pipeline found in a frame's local variables gives the last known status.
    """
    frames = _stack(_main_frame()) if frames is None else frames
    snap = Snapshot()
    found: object | None = None
    for f, lineno in frames:
        name = f.f_code.co_filename
        if snap.where is None and _is_user_code(name):
            snap.where = _line(f, lineno)
        ours = name.startswith(_PKG_DIR) and not name.startswith(_LAUNCH_DIR)
        if snap.inside is None and ours and not _is_user_code(name):
            snap.inside = _line(f, lineno)
        local = f.f_locals
        if found is None and _is_pipeline(local.get("self")):
            found, snap.in_step = local["self"], True
        if found is None:
            found = next((v for v in local.values() if _is_pipeline(v)), None)
    if found is not None:
        try:
            snap.status = found.status()  # type: ignore[attr-defined]
        except Exception:  # a half-built pipeline; the line of code still says enough
            snap.status = None
    return snap


def _report(rank: int, kind: str, error: str | None, snap: Snapshot) -> RankReport:
    extra = {"inside": snap.inside} if snap.inside else {}
    return RankReport(rank, kind, error, snap.status, snap.in_step, snap.where, extra, time.time())


class _Reporter:
    """Writes this rank's report once it knows something, and answers snapshot requests."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rank = _global_rank()
        self.failed = False
        self._lock = threading.RLock()  # re-entrant: a signal handler may run mid-write

    def failure(self, error: BaseException | None, status: dict[str, Any] | None) -> None:
        """Report this rank's failure (``status``: the runtime's, when it gave one)."""
        text = None if error is None else f"{type(error).__name__}: {error}"
        tb = None if error is None else error.__traceback__
        snap = snapshot(_traceback(tb) + _stack(sys._getframe(1)))
        if status is not None:
            snap.status, snap.in_step = status, True
        with self._lock:
            write_report(self.directory, _report(self.rank, "failed", text, snap))
            self.failed = True
        open(os.path.join(self.directory, REQUEST_FILE), "a").close()

    def snap(self, kind: str) -> None:
        """Write where this rank is now, unless it already reported (its own failure, or a
        snapshot asked for when another rank failed: the picture at that moment)."""
        snap = snapshot()
        with self._lock:
            if not self.failed and not (
                kind == "stopped" and has_report(self.directory, self.rank)
            ):
                write_report(self.directory, _report(self.rank, kind, None, snap))

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
    register(directory, reporter.rank)  # so the launcher can stop this rank promptly
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
            _finish_now()
        if not reporter.failed:
            reporter.failure(e, None)
            reporter.wait_for_peers()
        _exit_now(e.code if isinstance(e.code, int) else 1, None)
    except BaseException as e:
        if not reporter.failed:
            status = getattr(e, "meshpipe_status", None)
            reporter.failure(e, status if isinstance(status, dict) else None)
        reporter.wait_for_peers()
        _exit_now(130 if isinstance(e, KeyboardInterrupt) else 1, e)
    _finish_now()


def _finish_now() -> None:
    """End a rank that finished: the script's atexit handlers run, then ``os._exit(0)``,
    skipping the process groups' destructors (gloo's abort a process whose peers already
    left: status 134 for a run that succeeded)."""
    atexit._run_exitfuncs()
    _exit_now(0, None)


def _exit_now(code: int, error: BaseException | None) -> None:
    """End a failed rank with its own status: the traceback printed as the interpreter
    would, then ``os._exit``. A normal exit would run the process groups' destructors, and
    gloo's can abort a process whose peers are gone ("terminate called without an active
    exception", status 134), hiding the real status from the launcher."""
    if error is not None:
        traceback.print_exception(error)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            continue
    os._exit(code)


if __name__ == "__main__":
    main()
