"""The demo: a small GPT trained through a pipeline, with its timeline measured and drawn.

``meshpipe demo`` starts the ranks (see :mod:`meshpipe.launch`); each runs
:mod:`meshpipe.demo.train`. The model is :mod:`meshpipe.demo.gpt`, the text comes from
:mod:`meshpipe.demo.text`. Importing this package imports no torch.
"""
