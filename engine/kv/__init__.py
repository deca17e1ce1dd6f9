"""Step 4: the KV hierarchy. Host pool, page metadata, hot buffer (slab pool), page tables and
LRU state behind one cache facade (:class:`engine.kv.cache.KVCache`)."""
