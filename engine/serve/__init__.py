"""Step 6: serving a batch. The scheduler and request lifecycle (:class:`engine.serve.engine.Engine`),
data-parallel workers and pipeline stages."""
