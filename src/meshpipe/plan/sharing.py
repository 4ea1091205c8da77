"""A schedule replayed on processes that share fewer cores than they are: each action runs at
the speed its share of the cores allows while it runs. No torch.

``meshpipe.simulate`` gives every pp rank a core of its own. A job of ``n`` local processes
on ``c < n`` CPU cores is slower than that wherever more than ``c`` processes compute at
once, and not slower where the schedule keeps some of them idle (its bubble): a single
slowdown factor cannot say which. Here every pp rank runs ``width[r]`` processes (its dp
and tp replicas, which compute together), and while ``k`` processes compute, each advances
at ``min(1, cores / k)`` of its own speed (the operating system shares the cores evenly;
a process waiting for a message takes none). Messages are matched as ``replay`` matches
them: a receiving action starts once the matching send has ended plus the transfer time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from meshpipe.errors import SimulationError
from meshpipe.schedule.comm import wiring
from meshpipe.schedule.ir import Action, Schedule
from meshpipe.schedule.replay import Event, replay

__all__ = ["shared_replay"]

_EPS = 1e-15


def shared_replay(
    schedule: Schedule,
    duration: Callable[[Action], float],
    p2p: float,
    width: Sequence[int],
    cores: int,
) -> tuple[tuple[Event, ...], ...]:
    """Every action's start and end, per rank, when pp rank ``r`` is ``width[r]`` processes
    and the job has ``cores`` cores (0, or at least as many as processes: ``replay``'s own
    timeline, each rank alone on its core). ``duration(a)`` is an action's time alone."""
    if cores <= 0 or sum(width) <= cores:
        return replay(schedule, duration, p2p)
    return _Shared(schedule, duration, p2p, width, cores).run()


class _Shared:
    """The event-driven replay: ranks run, wait for a message, or wait for its arrival."""

    def __init__(
        self, schedule: Schedule, duration: Callable[[Action], float], p2p: float,
        width: Sequence[int], cores: int,
    ) -> None:  # fmt: skip
        self.w, self.rows, self.p = wiring(schedule), schedule.actions, schedule.num_ranks
        self.duration, self.p2p, self.width, self.cores = duration, p2p, width, cores
        p = self.p
        self.arrival: list[list[float]] = [[] for _ in range(p * p)]
        self.consumed = [0] * (p * p)
        self.pos = [0] * p
        self.left = [0.0] * p  # work left in the running action (seconds alone)
        self.started = [0.0] * p
        self.running: set[int] = set()
        self.timers: dict[int, float] = {}  # rank -> when its next action's message arrives
        self.blocked: dict[int, int] = {}  # pair -> rank waiting for a message on it
        self.events: list[list[Event]] = [[] for _ in range(p)]

    def begin(self, rank: int, now: float) -> None:
        """Start ``rank``'s next action at ``now`` if its message is in, else wait."""
        i, p = self.pos[rank], self.p
        if i >= len(self.rows[rank]):
            return
        src = self.w.recv_peer[rank][i]
        if src >= 0:
            pair = src * p + rank
            k = self.consumed[pair]
            if k >= len(self.arrival[pair]):
                self.blocked[pair] = rank
                return
            if self.arrival[pair][k] > now + _EPS:
                self.timers[rank] = self.arrival[pair][k]
                return
            self.consumed[pair] = k + 1
        self.left[rank], self.started[rank] = float(self.duration(self.rows[rank][i])), now
        self.running.add(rank)

    def end(self, rank: int, now: float) -> None:
        i = self.pos[rank]
        self.events[rank].append(Event(rank, self.rows[rank][i], self.started[rank], now))
        self.running.discard(rank)
        self.pos[rank] = i + 1
        dst = self.w.send_peer[rank][i]
        if dst >= 0:
            pair = rank * self.p + dst
            self.arrival[pair].append(now + self.p2p)
            woken = self.blocked.pop(pair, None)
            if woken is not None:
                self.begin(woken, now)
        self.begin(rank, now)

    def run(self) -> tuple[tuple[Event, ...], ...]:
        now = 0.0
        for rank in range(self.p):
            self.begin(rank, now)
        while self.running or self.timers:
            busy = sum(self.width[r] for r in self.running)
            rate = min(1.0, self.cores / busy) if busy else 1.0
            step = min((self.left[r] / rate for r in self.running), default=float("inf"))
            step = min(step, min((t - now for t in self.timers.values()), default=float("inf")))
            now += max(step, 0.0)
            for r in self.running:
                self.left[r] -= step * rate
            for r in [r for r in self.running if self.left[r] <= _EPS * max(1.0, now)]:
                self.end(r, now)
            for r in [r for r, t in self.timers.items() if t <= now + _EPS]:
                del self.timers[r]
                self.begin(r, now)
        stuck = [r for r in range(self.p) if self.pos[r] < len(self.rows[r])]
        if stuck:  # replay's own check names a deadlock; a valid schedule never gets here
            raise SimulationError(f"shared_replay: ranks {stuck} never finished their actions")
        return tuple(tuple(row) for row in self.events)
