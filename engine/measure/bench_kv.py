"""Documents and their KV for :mod:`engine.measure.bench`.

* Corpus: ``*.txt`` files (``$HISPARSE_CORPUS``, else ``shared/corpus`` beside the checkout)
  sorted by name and tokenized; document ``i`` starts at file ``i mod F`` and wraps around
  (:func:`document_ids`). :func:`write_corpus_tokens` saves the token streams for machines
  without the embedded model (the GGUF the tokenizer is read from).
* Master copies: each document is prefilled once into a one-document resident cache and
  its records ``[P, Hkv, 2, S, D]`` and page metadata ``[P, Hkv, 2, D]`` per layer are kept
  on the compute device (:class:`MasterKV`); :func:`import_kv` copies them into the pool
  pages of a request in any engine (device pool or pinned host pool), one copy per run of
  consecutive pool pages and layer.
* Prefill: ``full`` is the engine's own (:meth:`engine.serve.engine.Engine.prefill`); ``window``
  (the shortcut for synthetic models, :func:`prefill_window`) runs the same layers (the
  linears as the model runs prefill-sized calls: bf16 GEMM on dequantised 4-bit weights
  on CUDA) with attention over a local window instead of the whole prefix.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.events import Job
from engine.kv.cache import KVCache, page_runs
from engine.model.llama import LlamaModel, prefill_attention
from engine.serve.engine import Engine
from kernels.dispatch import Ops
from kernels.fp8_kv import fp8_quantize_ref

CORPUS_ENV = "HISPARSE_CORPUS"
CORPUS_TOKENS_FORMAT = "hisparse-corpus-tokens"


def corpus_dir(override: Path | None = None) -> Path:
    """``override``, else ``$HISPARSE_CORPUS``, else ``shared/corpus`` beside the checkout
    (``<checkout>/../shared/corpus``) where it exists, else the checkout's ``examples/``
    (its bundled corpus document), as the tests do."""
    if override is not None:
        return Path(override)
    env = os.environ.get(CORPUS_ENV)
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2]
    shared = checkout.parent / "shared" / "corpus"
    return shared if any(shared.glob("*.txt")) else checkout / "examples"


def corpus_streams(tokenizer, directory: Path) -> tuple[list[str], list[list[int]]]:
    """Token ids of every ``*.txt`` in ``directory``, files sorted by name (no BOS).

    Raises
    ------
    FileNotFoundError
        No ``*.txt`` there.
    """
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt corpus files in {directory} (set ${CORPUS_ENV})")
    streams = [tokenizer.encode(f.read_text(encoding="utf-8")) for f in files]
    return [f.name for f in files], streams


def write_corpus_tokens(path: Path, directory: Path | None = None) -> Path:
    """Tokenize the corpus with the embedded SmolLM2 tokenizer into a JSON file that
    ``--corpus-tokens`` reads, for machines without the embedded model (its GGUF is the
    tokenizer's source)."""
    from engine.text.tokenizer import TextTokenizer
    from engine.weights.embedded import default_model_path

    tokenizer = TextTokenizer.from_gguf(default_model_path())
    source = corpus_dir(directory)
    files, streams = corpus_streams(tokenizer, source)
    doc = {
        "format": CORPUS_TOKENS_FORMAT,
        "tokenizer": "embedded SmolLM2-135M-Instruct (GGUF)",
        "vocab_size": tokenizer.vocab_size,
        "corpus_dir": str(source),
        "files": files,
        "streams": streams,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")), encoding="utf-8")
    return path


def read_corpus_tokens(path: Path, vocab_size: int) -> tuple[list[str], list[list[int]]]:
    """Files and token streams of a :func:`write_corpus_tokens` file, ids taken
    ``id % vocab_size`` (as :class:`engine.weights.synthetic.SyntheticTokenizer` does).

    Raises
    ------
    ConfigError
        Not such a file.
    """
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if doc.get("format") != CORPUS_TOKENS_FORMAT:
        raise ConfigError(f"{path} is not a {CORPUS_TOKENS_FORMAT} file")
    return doc["files"], [[i % vocab_size for i in s] for s in doc["streams"]]


def document_ids(streams: list[list[int]], index: int, num_tokens: int) -> tuple[int, ...]:
    """Document ``index``: the streams from file ``index mod F`` on, wrapping, cut to
    ``num_tokens``."""
    out: list[int] = []
    f = index % len(streams)
    while len(out) < num_tokens:
        out.extend(streams[f][: num_tokens - len(out)])
        f = (f + 1) % len(streams)
    return tuple(out)


# ----------------------------------------------------------------------------- master KV


@dataclass
class MasterKV:
    """One prefilled document, kept for reuse: per layer ``records [P, Hkv, 2, S, D]`` and
    ``meta [P, Hkv, 2, D]``; ``first_token`` sampled after the prompt's last position."""

    doc: int
    prompt_ids: tuple[int, ...]
    first_token: int
    records: list[torch.Tensor]
    meta: list[torch.Tensor]
    prefill_s: float

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.records, *self.meta))


def export_kv(cache: KVCache, seq_id: int, num_tokens: int) -> tuple[list, list]:
    """Copy the records and metadata of a request's first ``ceil(num_tokens / S)`` pages
    out of ``cache`` (one tensor per layer, on the cache's compute device)."""
    cache.synchronize()  # chunked prefill copies into a host pool may still be in flight
    pages = cache.seqs[seq_id].pages[: cache.pages_for(num_tokens)]
    idx = torch.tensor(pages, dtype=torch.long)
    records = [pool.index_select(0, idx.to(pool.device)).to(cache.device) for pool in cache.pool]
    meta = [m.index_select(0, idx.to(m.device)) for m in cache.meta]
    return records, meta


@torch.inference_mode()
def import_kv(cache: KVCache, seq_id: int, master: MasterKV) -> None:
    """Copy ``master`` into the pool pages and metadata of request ``seq_id`` (allocated
    with room for it) and mark its prompt as stored. One copy per run of consecutive pool
    pages and layer (device->pinned host at link speed for the host pool). An fp8 host pool
    (``kv_host_dtype=fp8``) gets the master's records quantised again; the master, prefilled
    all-resident with the same settings, holds them fp8-rounded already, so this is exact
    but where rounding lifted a row's largest magnitude to the next power of two (its
    smallest values may then lose their last bit: a speed bench, not a fidelity one)."""
    pages = cache.seqs[seq_id].pages[: master.records[0].shape[0]]
    for start, first, n in page_runs(pages, cache.copy_chunk_pages):  # within a pinned chunk
        for layer, (pool, meta) in enumerate(zip(cache.pool, cache.meta, strict=True)):
            rec = master.records[layer][start : start + n]
            if cache.host_fp8:  # fp8 host pool: the master's fp8-rounded records, quantised
                q, e = fp8_quantize_ref(rec)
                pool.view(torch.uint8)[first : first + n].copy_(q.view(torch.uint8), non_blocking=True)
                cache.pool_scale[layer][first : first + n].copy_(e, non_blocking=True)
            else:
                pool[first : first + n].copy_(rec, non_blocking=True)
            meta[first : first + n].copy_(master.meta[layer][start : start + n], non_blocking=True)
    cache.seqs[seq_id].num_tokens = master.num_tokens
    sync(cache.device)


# ----------------------------------------------------------------------------- prefill


@torch.inference_mode()
def prefill_window(
    model: LlamaModel, cache: KVCache, seq_id: int, ids, chunk: int, window: int
) -> int:
    """The prefill shortcut: the model's layers over ``ids`` in chunks, each chunk
    attending causally to itself and the ``window`` tokens before it; K/V written with
    :meth:`KVCache.write_prefill`. Returns the greedy first token. With ``window >= T``
    this is the engine's full prefill."""
    m, cfg = model, model.config
    t = len(ids)
    h = m.embed_tokens(torch.tensor(ids, dtype=torch.long))
    pos = torch.arange(t, device=m.device)
    for layer in range(cfg.num_layers):
        kbuf = torch.empty(t, cfg.num_kv_heads, cfg.head_dim, dtype=m.dtype, device=m.device)
        vbuf = torch.empty_like(kbuf)
        last = layer == cfg.num_layers - 1
        for s in range(0, t, chunk):
            e = min(s + chunk, t)
            q, k, v = m.qkv(layer, h[s:e], pos[s:e])
            kbuf[s:e], vbuf[s:e] = k, v
            if last and e < t:
                continue
            ws = max(0, s - window)
            a = prefill_attention(
                q, kbuf[ws:e], vbuf[ws:e], s - ws, m.scale, m.attn_softcap, m.attn_window(layer)
            )
            if last:
                h = m.finish_layer(layer, h[t - 1 :], a[-1:])
            else:
                h[s:e] = m.finish_layer(layer, h[s:e], a)
        cache.write_prefill(seq_id, layer, kbuf, vbuf, 0)
    return int(m.logits(h[-1:])[0].argmax())


def prefill_documents(
    model: LlamaModel,
    tokenizer,
    ops: Ops,
    config: EngineConfig,
    docs: list[tuple[int, ...]],
    method: str,
    window: int,
) -> list[MasterKV]:
    """Prefill each document once into a one-document resident cache and keep its KV."""
    cfg = config.replace(attention="sparse", hierarchical=False, max_batch=1, memory_budget_gb=None)
    limit = max(len(d) for d in docs) + 1
    pages = -(-limit // cfg.page_size)
    cache = KVCache(model.config, cfg, model.device, pages, num_pool_pages=pages)
    engine = Engine(model, tokenizer, cfg, ops, limit, cache=cache)
    masters = []
    for i, ids in enumerate(docs):
        req = engine.open_request(Job(f"doc{i}", ids, SamplingParams(max_tokens=1)))
        sync(model.device)
        t0 = time.perf_counter()
        if method == "full":
            first = engine.prefill(req)
        else:
            first = prefill_window(model, cache, req.seq_id, ids, cfg.prefill_chunk, window)
        sync(model.device)
        took = time.perf_counter() - t0
        records, meta = export_kv(cache, req.seq_id, len(ids))
        masters.append(MasterKV(i, ids, first, records, meta, took))
        engine.close_request(req)
    cache.close()
    del engine, cache
    free_device_memory()
    return masters


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    """Collect garbage and return cached CUDA blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
