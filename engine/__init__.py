"""hisparse's engine: sparse hierarchical KV decoding of many long documents in one batch.

The folders are the steps of the data path, in order:

1. ``weights/`` — a model file becomes :class:`engine.weights.types.ModelWeights`: GGUF
   (read and dequantised with the ``gguf`` package), Hugging Face folders (safetensors),
   synthetic weights of a published shape, the embedded SmolLM2; 4-bit blocks stay 4-bit
   (:mod:`engine.weights.quant`).
2. ``text/`` — the document and task become token ids: the tokenizer (``tokenizers``), the
   model's chat template (Jinja) and the prompt; document text is data, never control tokens.
3. ``model/`` — the forward pass of each architecture (:mod:`engine.model.registry`), its
   linears and RoPE, layer by layer so prefill can run layer-major.
4. ``kv/`` — every request's KV records live in a (pinned) host pool, page metadata (key
   min/max) and a hot buffer of slots on the compute device; :mod:`engine.kv.sizing` holds
   every byte formula (the planner and admission both use it).
5. ``decode/`` — one decode step, planned once and run per layer: append → select (indexer)
   → resolve (hits, LRU victims, load list) → gather misses → sparse attention; CUDA graphs
   of the whole step; sampling.
6. ``serve/`` — the scheduler and request lifecycle (queued → admitted → prefill → decode →
   finished), data-parallel workers and pipeline stages; it yields :mod:`engine.events`.

Beside the data path: ``capacity/`` (memory arithmetic: planner, model shapes, budget split)
and ``measure/`` (bench, roofline, profiling, traces, replay).

Top-level modules: :mod:`engine.config` (the typed settings and the one precedence chain),
:mod:`engine.load` (the one engine builder), :mod:`engine.events` (what the engine yields)
and :mod:`engine.presets` (the YAML presets' loader). Nothing here imports typer, rich,
matplotlib or :mod:`hisparse_cli`.
"""
