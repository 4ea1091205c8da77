"""Simulation of schedules: simulate(schedule, cost) -> Timeline, and its renderings. No torch."""

from meshpipe.schedule.replay import Event
from meshpipe.sim.meshes import stage_mesh_cost
from meshpipe.sim.render import (
    chrome_trace,
    render_ascii,
    render_png,
    save_chrome_trace,
    to_chrome_trace,
)
from meshpipe.sim.simulate import Cost, Timeline, simulate

__all__ = [
    "Cost",
    "Event",
    "Timeline",
    "chrome_trace",
    "render_ascii",
    "render_png",
    "save_chrome_trace",
    "simulate",
    "stage_mesh_cost",
    "to_chrome_trace",
]
