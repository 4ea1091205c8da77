"""validate(schedule): placeholder until the full checker lands."""

from __future__ import annotations

from meshpipe.schedule.ir import Schedule

__all__ = ["validate"]


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless ``schedule`` is complete, ordered and deadlock-free."""
    return None
