"""Built-in schedule generators, one module per family; importing registers them.

Registration order is the order :func:`~meshpipe.schedule.registry.schedule_names` lists
them in, so the simplest families come first.
"""

# isort: off
from meshpipe.schedule.generators import simple  # noqa: F401
from meshpipe.schedule.generators import interleaved  # noqa: F401
from meshpipe.schedule.generators import zero_bubble  # noqa: F401
from meshpipe.schedule.generators import dualpipe  # noqa: F401

# isort: on
