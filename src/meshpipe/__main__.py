"""``python -m meshpipe ...``: the meshpipe command, where its script is not installed
(the project on PYTHONPATH, as on a lent GPU machine)."""

from meshpipe.cli import main

raise SystemExit(main())
