"""Generation (``Pipeline.generate``): a prefill per lane, then the decode ring, with each
stage keeping the KV cache of its own layers. Nothing is re-exported."""
