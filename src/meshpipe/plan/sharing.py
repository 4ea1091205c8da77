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
    w = wiring(schedule)
    rows = schedule.actions
    p = schedule.num_ranks
    arrival: list[list[float]] = [[] for _ in range(p * p)]
    consumed = [0] * (p * p)
    pos = [0] * p
    left = [0.0] * p  # work left in the running action (seconds alone), if running
    started = [0.0] * p
    running: set[int] = set()
    timers: dict[int, float] = {}  # rank -> when its next action's message arrives
    blocked: dict[int, int] = {}  # pair -> rank waiting for a message on it
    events: list[list[Event]] = [[] for _ in range(p)]

    def begin(rank: int, now: float) -> None:
        """Start ``rank``'s next action at ``now`` if its message is in, else wait."""
        i = pos[rank]
        if i >= len(rows[rank]):
            return
        src = w.recv_peer[rank][i]
        if src >= 0:
            pair = src * p + rank
            k = consumed[pair]
            if k >= len(arrival[pair]):
                blocked[pair] = rank
                return
            if arrival[pair][k] > now + _EPS:
                timers[rank] = arrival[pair][k]
                return
            consumed[pair] = k + 1
        left[rank], started[rank] = float(duration(rows[rank][i])), now
        running.add(rank)

    def end(rank: int, now: float) -> None:
        i = pos[rank]
        events[rank].append(Event(rank, rows[rank][i], started[rank], now))
        running.discard(rank)
        pos[rank] = i + 1
        dst = w.send_peer[rank][i]
        if dst >= 0:
            pair = rank * p + dst
            arrival[pair].append(now + p2p)
            woken = blocked.pop(pair, None)
            if woken is not None:
                begin(woken, now)
        begin(rank, now)

    now = 0.0
    for rank in range(p):
        begin(rank, now)
    while running or timers:
        busy = sum(width[r] for r in running)
        rate = min(1.0, cores / busy) if busy else 1.0
        step = min((left[r] / rate for r in running), default=float("inf"))
        step = min(step, min((t - now for t in timers.values()), default=float("inf")))
        now += max(step, 0.0)
        for r in running:
            left[r] -= step * rate
        for r in [r for r in running if left[r] <= _EPS * max(1.0, now)]:
            end(r, now)
        for r in [r for r, t in timers.items() if t <= now + _EPS]:
            del timers[r]
            begin(r, now)
    stuck = [r for r in range(p) if pos[r] < len(rows[r])]
    if stuck:  # replay's own check names the deadlock; a valid schedule never gets here
        raise SimulationError(f"shared_replay: ranks {stuck} never finished their actions")
    return tuple(tuple(row) for row in events)
