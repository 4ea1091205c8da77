"""Ends a job promptly once one of its ranks has failed, and records how each rank ended.

Torch's elastic agent stops the other workers after a failure with SIGTERM and then waits
30 s (a fixed default of its process context's ``close``) before SIGKILL, so a rank frozen
by SIGSTOP, or stuck in a native call that never returns to Python, holds the job that
long. The launcher runs a :class:`Supervisor` beside the agent: every rank registers its
pid (:func:`register`), and once one has ended with a non-zero status or a signal, the
others get SIGTERM and SIGCONT at once and SIGKILL after a grace. It only peeks at exit
statuses (``waitid`` with ``WNOWAIT``); the agent still reaps its processes. It also notes
when and how each rank ended, so that the launcher can name the rank that ended first
(:func:`first_failure`). This module imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType

from meshpipe.launch.report import RankReport, culprit_of, read_reports

__all__ = ["Supervisor", "RankEnd", "register", "first_failure", "exit_status"]

log = logging.getLogger(__name__)
PID_PREFIX = "pid-"  # pid-{global_rank} in the status directory: that rank's process id


def register(directory: str | os.PathLike[str], global_rank: int) -> None:
    """Record this process as ``global_rank``'s (atomically: a reader never sees half)."""
    path = os.path.join(os.fspath(directory), f"{PID_PREFIX}{global_rank}")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, path)


def _peek(pid: int) -> tuple[bool, int | None]:
    """(ended, exit code) of the child ``pid``, without reaping it. The code follows
    ``Popen.returncode`` (-N: killed by signal N) and is None when the process was already
    reaped (by the agent), so its status is no longer ours to read."""
    if hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True, None
        if info is None:
            return False, None
        return True, info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    try:  # no waitid: a zombie still looks alive until the agent reaps it
        os.kill(pid, 0)
    except ProcessLookupError:
        return True, None
    return False, None


@dataclass(frozen=True)
class RankEnd:
    """How one rank's process ended: ``exit_code`` as ``Popen.returncode`` (None when it
    could not be read), ``time`` (time.time(), to one poll) when it was seen gone, and
    ``stopped``: the supervisor had signalled it before."""

    global_rank: int
    pid: int
    exit_code: int | None
    time: float
    stopped: bool


class Supervisor:
    """Watches the registered ranks from a thread; use as a context manager around the run.

    ``grace`` is the time between SIGTERM (with SIGCONT, for a stopped process) and
    SIGKILL; ``poll`` the interval between looks. After the run, :meth:`ends` says how each
    rank ended and :meth:`stopped` which ranks the supervisor signalled.
    """

    def __init__(self, directory: str, *, grace: float = 3.0, poll: float = 0.02) -> None:
        self.directory = directory
        self.grace = grace
        self.poll = poll
        self._files: dict[str, tuple[int, int]] = {}  # pid file -> (inode, mtime) read
        self._ranks: dict[int, int] = {}  # pid -> global rank, in order of registration
        self._live: set[int] = set()
        self._ends: dict[int, RankEnd] = {}  # pid -> end
        self._signalled: set[int] = set()
        self._killed: set[int] = set()
        self._doomed: set[int] = set()  # the pids being stopped
        self._deadline: float | None = None  # time.monotonic() of the SIGKILL
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshpipe-supervise", daemon=True)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()
        self._safe_tick()  # ranks that ended since the last look

    def _run(self) -> None:
        while not self._done.wait(self.poll) and self._safe_tick():
            pass

    def _safe_tick(self) -> bool:
        try:
            self.tick()
        except Exception:  # never let supervision break the launch; the agent remains
            log.exception("meshpipe launch: supervising the ranks failed")
            return False
        return True

    def tick(self) -> None:
        """One look: new registrations, ranks that ended, signals that are due."""
        self._scan()
        now = time.time()
        for pid in sorted(self._live):
            ended, code = _peek(pid)
            if not ended:
                continue
            self._live.discard(pid)
            rank = self._ranks[pid]
            self._ends[pid] = RankEnd(rank, pid, code, now, pid in self._signalled)
            if self._deadline is None and self._failed(rank, code):
                self._stop()
        self._enforce()

    def _scan(self) -> None:
        """Take in new pid files (one replaced by a restarted rank counts anew)."""
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                if not name.startswith(PID_PREFIX) or name.endswith(".tmp"):
                    continue
                with contextlib.suppress(OSError, ValueError):
                    ident = (entry.inode(), entry.stat().st_mtime_ns)
                    if self._files.get(name) == ident:
                        continue
                    with open(entry.path, encoding="utf-8") as fh:
                        pid = int(fh.read())
                    self._files[name] = ident
                    self._track(pid, int(name[len(PID_PREFIX) :]))

    def _track(self, pid: int, rank: int) -> None:
        self._ranks.pop(pid, None)  # a pid the system gave again starts afresh
        self._ends.pop(pid, None)
        for pids in (self._signalled, self._killed, self._doomed):
            pids.discard(pid)
        self._ranks[pid] = rank
        self._live.add(pid)

    def _failed(self, rank: int, code: int | None) -> bool:
        if code is not None:
            return code != 0
        report = read_reports(self.directory).get(rank)  # reaped before we saw its status
        return report is None or report.kind != "finished"

    def _stop(self) -> None:
        """SIGTERM and SIGCONT to every live rank now; SIGKILL is due after the grace."""
        self._doomed = set(self._live)
        self._deadline = time.monotonic() + self.grace
        for pid in sorted(self._doomed):
            self._signal(pid, signal.SIGTERM)
            self._signal(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only then
        log.debug("meshpipe launch: stopping pids %s", sorted(self._doomed))

    def _enforce(self) -> None:
        if self._deadline is None:
            return
        left = self._doomed & self._live
        if not left:  # all stopped: a restarted generation starts with a clean slate
            self._deadline, self._doomed = None, set()
        elif time.monotonic() >= self._deadline:
            for pid in sorted(left - self._killed):
                self._signal(pid, signal.SIGKILL)
                self._killed.add(pid)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        if _peek(pid)[0]:  # never signal a pid that may no longer be our rank
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            self._signalled.add(pid)

    def ends(self) -> dict[int, RankEnd]:
        """How each rank's latest process ended, by global rank (ranks still running or
        never registered are absent)."""
        latest: dict[int, int] = {}
        for pid, rank in self._ranks.items():  # in order of registration: the last wins
            latest[rank] = pid
        return {rank: self._ends[pid] for rank, pid in latest.items() if pid in self._ends}

    def stopped(self) -> frozenset[int]:
        """Global ranks whose latest process the supervisor signalled."""
        return frozenset(e.global_rank for e in self.ends().values() if e.pid in self._signalled)


def first_failure(
    ends: Mapping[int, RankEnd],
    exit_codes: Mapping[int, int],
    reports: Mapping[int, RankReport],
) -> int | None:
    """The global rank that failed first: the culprit the failed processes named in their
    reports when it raised (runtime/failures/culprit.py; one they found stuck did not fail, and the
    launcher stopped it: the picture names it, see format_picture), else the earliest to
    end with a non-zero status before the supervisor signalled it (``exit_codes`` fill in
    statuses it could not read); the process that ends first is often not the one that
    failed first (it waits for its peers' reports, or a peer of it is faster). Ranks
    seen ending at the same look are ordered: one that stopped on a signal handler (a
    "stopped" report) last, one that ended without a report (killed) first, then by the
    time of the report."""
    culprit = culprit_of(reports)
    if culprit is not None and culprit.get("kind") == "failed":
        return int(culprit["rank"])

    def code(e: RankEnd) -> int | None:
        return e.exit_code if e.exit_code is not None else exit_codes.get(e.global_rank)

    candidates = [e for e in ends.values() if not e.stopped and code(e) not in (None, 0)]

    def key(e: RankEnd) -> tuple[float, bool, bool, float]:
        rep = reports.get(e.global_rank)
        stopped = rep is not None and rep.kind == "stopped"
        return (e.time, stopped, rep is not None, rep.time if rep is not None else 0.0)

    return min(candidates, key=key).global_rank if candidates else None


def exit_status(code: int | None) -> int:
    """The launcher's exit status for a failing rank's ``Popen.returncode``: 128 + N when a
    signal N killed it, its own code otherwise, 1 when unknown."""
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code
