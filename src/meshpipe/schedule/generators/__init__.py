"""Built-in schedule generators, one module per family; importing registers them."""

from meshpipe.schedule.generators import simple  # noqa: F401
