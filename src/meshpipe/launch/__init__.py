"""Start N local ranks through torch's elastic launcher and report what each did on failure.

``launch(["train.py", "--lr", "3e-3"], num_ranks=4)`` is ``torchrun --nproc-per-node 4
train.py --lr 3e-3`` on one machine: one rendezvous store served on 127.0.0.1 only
(:mod:`meshpipe.launch.loopback`; torch's c10d rendezvous would listen on every interface),
gloo on the loopback interface, one thread per rank
(OMP_NUM_THREADS=1 unless set), every rank run through :mod:`meshpipe.launch.worker` so
that when one fails, every rank reports its action, microbatch, awaited peer and mesh
coordinates. Once a rank has failed, a :class:`~meshpipe.launch.supervise.Supervisor`
ends the others within a few seconds (torch's own stop waits 30 s for a rank that
ignores SIGTERM). Multi-node jobs use ``torchrun`` itself with the same script.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from meshpipe.launch.loopback import BACKEND, LOOPBACK, loopback_interface, register
from meshpipe.launch.report import STATUS_DIR_ENV, RankReport, format_picture, read_reports
from meshpipe.launch.supervise import Supervisor, exit_status, first_failure

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["launch", "LaunchResult", "LaunchError"]

log = logging.getLogger(__name__)
_SHUTDOWN_S = 3  # seconds a rank gets to stop (and report) before it is killed
_EXIT_INTERRUPTED = 130


class LaunchError(ValueError):
    """Bad launch arguments; ``value`` is the offending one."""

    def __init__(self, message: str, value: object = None) -> None:
        super().__init__(message)
        self.value = value


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended: exit status for the shell, and every rank's report on failure.

    ``exit_code`` is 0 on success; on failure, that of the rank that failed first: its exit
    code, or 128 + N when signal N killed it (1 when unknown); 130 after Ctrl-C.
    ``exit_codes`` are the ranks' ``Popen.returncode`` (-N: killed by signal N); ``cause``
    is the global rank that failed first, when known; ``stopped`` the ranks the launcher
    stopped after it. ``picture`` names the cause, then has one line per rank ("" on
    success).
    """

    exit_code: int
    num_ranks: int
    reports: Mapping[int, RankReport] = field(default_factory=dict)
    exit_codes: Mapping[int, int] = field(default_factory=dict)
    interrupted: bool = False
    cause: int | None = None
    stopped: frozenset[int] = frozenset()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def picture(self) -> str:
        if self.ok:
            return ""
        return format_picture(
            self.reports, self.num_ranks, self.exit_codes, cause=self.cause, stopped=self.stopped
        )


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the ranks (they inherit ours), restored afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _config(num_ranks: int, max_restarts: int, log_dir: str) -> LaunchConfig:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_ranks,
        run_id=f"meshpipe-{uuid.uuid4().hex[:12]}",
        # one store, on 127.0.0.1 only (torch's c10d rendezvous listens on every interface)
        rdzv_backend=BACKEND,
        local_addr=LOOPBACK,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        # ranks write to our stdout/stderr; the agent's per-rank folders (error files) go
        # under log_dir, which launch() removes, not into a new /tmp/torchelastic_* each run
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    # Bound the wait for ranks to stop (and report) before they are killed when the agent
    # itself is stopped (Ctrl-C); older torch versions without the field ignore it. After
    # a failing rank the agent's process context waits a fixed 30 s instead (its close()
    # default): the Supervisor ends the ranks before that.
    config.shutdown_timeout = _SHUTDOWN_S
    return config


def _check(target: Sequence[str], num_ranks: int) -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise LaunchError(f"the number of ranks must be an int >= 1, got {num_ranks!r}", num_ranks)
    if not target or (target[0] == "-m" and len(target) < 2):
        raise LaunchError("nothing to run: give a script (or -m module) and its arguments", target)
    if target[0] != "-m" and not os.path.isfile(target[0]):
        raise LaunchError(f"script {target[0]!r} not found", target[0])


def launch(
    target: Sequence[str],
    num_ranks: int,
    *,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
) -> LaunchResult:
    """Run ``target`` (``[script.py, *args]`` or ``["-m", module, *args]``) on ``num_ranks``
    local ranks and wait for them.

    Ranks get torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
    MASTER_PORT), so ``meshpipe.init_mesh`` picks gloo on CPU and NCCL on GPUs. ``env``
    adds variables for the ranks. Ctrl-C stops every rank. Never raises for a failing
    rank: the result says who failed and what every rank was doing.
    """
    _check(target, num_ranks)
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with (
        tempfile.TemporaryDirectory(prefix="meshpipe-status-") as status_dir,
        tempfile.TemporaryDirectory(prefix="meshpipe-agent-") as agent_dir,
    ):
        config = _config(num_ranks, max_restarts, agent_dir)
        values = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        lo = loopback_interface()
        if lo is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            values["GLOO_SOCKET_IFNAME"] = lo  # gloo's pairs listen on loopback too
        values.update(env or {})
        values[STATUS_DIR_ENV] = status_dir
        args = ["-u", "-m", "meshpipe.launch.worker", *target]
        supervisor = Supervisor(status_dir, grace=_SHUTDOWN_S)
        try:
            register()  # the loopback rendezvous backend, for the agent
            with _environ(values), _quiet_agent(), supervisor:
                elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as e:
            return _failure(e, num_ranks, status_dir, supervisor)
        except (SignalException, KeyboardInterrupt):
            return LaunchResult(
                _EXIT_INTERRUPTED, num_ranks, read_reports(status_dir), interrupted=True
            )
    return LaunchResult(0, num_ranks)


def _failure(
    error: ChildFailedError, num_ranks: int, status_dir: str, supervisor: Supervisor
) -> LaunchResult:
    """The result of a failed run: the supervisor's account of who ended first, completed
    by the agent's exit codes (the agent's own timestamps are in whole seconds)."""
    ends = supervisor.ends()
    codes = {r: f.exitcode for r, f in error.failures.items()}
    codes.update({r: e.exit_code for r, e in ends.items() if e.exit_code is not None})
    reports = read_reports(status_dir)
    cause = first_failure(ends, codes, reports)
    if cause is None:
        first = min(error.failures.values(), key=lambda f: f.timestamp, default=None)
        code = None if first is None else first.exitcode
    else:
        code = codes.get(cause)
    stopped = supervisor.stopped()
    if cause in stopped:  # named by its peers but ended by our signal: not its own status
        ended = first_failure(ends, codes, {})
        code = codes.get(ended) if ended is not None else None
    return LaunchResult(exit_status(code), num_ranks, reports, codes, cause=cause, stopped=stopped)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Keep the elastic agent's routine warnings (rank stop signals) off the console."""
    logger = logging.getLogger("torch.distributed.elastic")
    old = logger.level
    if old == logging.NOTSET and not log.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)
