"""Schedules as values: the IR, generators, validation and text form. Imports no torch."""

from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.schedule.program import P2P, p2p_program
from meshpipe.schedule.registry import get_schedule, register, schedule_names
from meshpipe.schedule.validate import validate

__all__ = [
    "Action",
    "Op",
    "P2P",
    "Schedule",
    "get_schedule",
    "p2p_program",
    "register",
    "schedule_names",
    "validate",
]
