"""Per-job fidelity audit (``EngineConfig.audit_steps``, ``hisparse run --audit N``).

For ``N`` decode steps of each job, chosen by :func:`audit_schedule`, the engine also
computes what dense attention would have given at that step and compares:

* **top-1 agreement** — the argmax of the sparse step's logits equals the dense one's;
* **KL(dense || sparse)** of the two next-token distributions (softmax of the float32
  logits at temperature 1, in nats);
* **mass kept** — per layer and query head, the share of the attention mass that the
  sparse step's query puts on its context (exact softmax over every key) which lies in
  the pages its selection read; averaged over layers and heads.

The dense forward is *teacher-forced on the sparse run's cache*: its queries and this
step's key/value come from a dense chain of hidden states through every layer, but the
keys and values of the earlier positions are the ones in the KV pool, written by the
sparse run (prefill is dense in both). It measures this step's selection error, not the
drift of a whole dense generation. It only reads the pool, after the step's writes have
landed (:meth:`engine.kv.cache.KVCache.join_late`), so the sparse decode — its tokens,
hot-buffer slots, page tables and LRU stamps — is the same with and without the audit.
Its cost per audited step is one single-token forward whose attention reads every record
of the job's context (on a hierarchical cache: from the host pool).

Torch is imported on first use (:func:`audit_schedule` serves the CLI's test engine).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.events import AuditStats

if TYPE_CHECKING:
    import torch


def audit_schedule(job_id: str, max_tokens: int, steps: int, seed: int) -> frozenset[int]:
    """The decode steps of job ``job_id`` to audit: at most ``steps`` indices in
    ``1 .. max_tokens - 1`` (decode step ``i`` feeds generated token ``i - 1`` and samples
    token ``i``; token 0 comes from prefill). The range is split into ``steps`` equal
    strata and one index is drawn in each with :class:`random.Random` seeded by
    ``(seed, job_id)``: spread over the decode, the same on every run. A job that stops
    early audits only the steps it reached."""
    span = max_tokens - 1
    n = min(steps, span)
    if n <= 0:
        return frozenset()
    rng = random.Random(f"{seed}:{job_id}")
    edges = [1 + (i * span) // n for i in range(n + 1)]
    return frozenset(rng.randrange(edges[i], edges[i + 1]) for i in range(n))


@dataclass
class AuditTally:
    """Running sums of one job's audited steps (see :class:`engine.events.AuditStats`)."""

    steps: int = 0
    agree: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    mass_sum: float = 0.0
    seconds: float = 0.0

    def add(self, agree: bool, kl: float, mass: float) -> None:
        self.steps += 1
        self.agree += int(agree)
        self.kl_sum += kl
        self.kl_max = max(self.kl_max, kl)
        self.mass_sum += mass

    def stats(self) -> AuditStats:
        n = self.steps
        return AuditStats(
            steps=n,
            top1_agreement=self.agree / n if n else 1.0,
            kl_mean=self.kl_sum / n if n else 0.0,
            kl_max=self.kl_max,
            mass_kept_mean=self.mass_sum / n if n else 1.0,
            seconds=self.seconds,
        )


def context_kv(
    cache, seq_id: int, layer: int, num_tokens: int, device, dtype, values: bool = True
):
    """Keys and values of positions ``0 .. num_tokens - 1`` of ``seq_id`` in cache layer
    ``layer``, read from the KV pool: ``k, v [num_tokens, Hkv, D]`` in ``dtype`` on
    ``device`` (``v`` is ``None`` when not ``values``). Pool layout ``[P_pool, Hkv, 2, S,
    D]`` (:mod:`engine.kv.cache`); fp8 records (``kv_host_dtype=fp8``) are dequantised with
    their scale exponents (:func:`kernels.fp8_kv.fp8_dequantize_ref`), as the gather does.

    A host pool read for a CUDA ``device`` is copied run by run of consecutive pages
    (each inside one pinned chunk: :func:`engine.kv.cache.page_runs`), asynchronously on
    the current stream — not gathered on the host and copied from pageable memory, which
    cost ~80 ms per audited step of a 3K-token job on an H200 (2026-12-01)."""
    import torch

    from engine.kv.cache import page_runs
    from kernels.fp8_kv import FP8, fp8_dequantize_ref

    s = cache.page_size
    pages = cache.seqs[seq_id].pages[: -(-num_tokens // s)]
    pool = cache.pool[layer]
    scales = cache.host.scales[layer] if pool.dtype == FP8 else None
    device = torch.device(device)
    if pool.device.type == "cpu" and device.type == "cuda":
        runs = page_runs(pages, cache.copy_chunk_pages)

        def read(t):
            parts = [t[first : first + n].to(device, non_blocking=True) for _, first, n in runs]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        rec = read(pool)
        sc = read(scales) if scales is not None else None
    else:
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        rec = pool[index].to(device)
        sc = scales[index].to(device) if scales is not None else None
    rec = fp8_dequantize_ref(rec, sc, dtype) if sc is not None else rec.to(dtype)
    p, hkv, _, _, d = rec.shape  # [P, Hkv, 2, S, D]
    k = rec[:, :, 0].permute(0, 2, 1, 3).reshape(p * s, hkv, d)[:num_tokens]
    if not values:
        return k, None
    v = rec[:, :, 1].permute(0, 2, 1, 3).reshape(p * s, hkv, d)[:num_tokens]
    return k, v


def dense_step_logits(model, cache, seq_id: int, token: int, position: int) -> torch.Tensor:
    """float32 ``[V]``: the next-token logits of feeding ``token`` at ``position`` with
    dense attention in every layer over the job's pool records of positions
    ``0 .. position - 1`` plus the dense chain's own key/value at ``position`` (causal
    SDPA, :func:`engine.model.llama.prefill_attention`). Needs the whole model in this
    engine (no pipeline stage)."""
    import torch

    from engine.model.llama import prefill_attention

    with torch.inference_mode():
        return _dense_chain(model, cache, seq_id, token, position, prefill_attention)


def _dense_chain(model, cache, seq_id, token, position, prefill_attention):
    import torch

    h = model.embed_tokens(torch.tensor([token], dtype=torch.long))
    pos = torch.tensor([position], dtype=torch.long, device=model.device)
    for layer in model.layer_range:
        q, k, v = model.qkv(layer, h, pos)
        kc, vc = context_kv(
            cache, seq_id, layer - cache.layer_offset, position, model.device, k.dtype
        )
        a = prefill_attention(q, torch.cat([kc, k]), torch.cat([vc, v]), position)
        h = model.finish_layer(layer, h, a)
    return model.logits(h)[0]


def mass_kept(
    cache, seq_id: int, captured: dict[int, tuple[torch.Tensor, torch.Tensor]],
    num_tokens: int, scale: float,
) -> float:
    """Mean over layers and query heads of the exact attention mass inside the selected
    pages. ``captured``: cache layer -> (the sparse step's query ``[Hq, D]``, its
    selection bitmask int32 ``[Hkv, W]``); ``num_tokens`` counts the context including
    this step's token (already in the pool). A step with nothing captured (``dense``
    indexer or attention: every page read) keeps 1.0."""
    if not captured:
        return 1.0
    import torch

    from kernels.bitmask import unpack_bits

    with torch.inference_mode():
        return _mass_kept(cache, seq_id, captured, num_tokens, scale, unpack_bits)


def _mass_kept(cache, seq_id, captured, num_tokens, scale, unpack_bits) -> float:
    import torch

    s = cache.page_size
    total, n = 0.0, 0  # summed on the device: one host sync per step, not per layer
    for layer, (q, sel) in captured.items():
        k, _ = context_kv(cache, seq_id, layer, num_tokens, q.device, torch.float32, False)
        hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        logits = torch.einsum("hgd,thd->hgt", q.float().view(hkv, g, d), k) * scale
        prob = torch.softmax(logits, dim=-1)  # [Hkv, G, T]
        p = -(-num_tokens // s)
        page_of = torch.arange(num_tokens, device=q.device) // s
        chosen = unpack_bits(sel, p)[:, page_of]  # [Hkv, T]
        kept = (prob * chosen[:, None, :]).sum(-1)  # [Hkv, G]
        total = total + kept.sum()
        n += hq
    return float(total) / n


def compare(sparse_logits: torch.Tensor, dense_logits: torch.Tensor) -> tuple[bool, float]:
    """(top-1 agreement, KL(dense || sparse) in nats) of two float32 ``[V]`` logits."""
    import torch

    ls = torch.log_softmax(sparse_logits.float(), -1)
    ld = torch.log_softmax(dense_logits.float(), -1)
    kl = float((ld.exp() * (ld - ls)).sum().clamp(min=0.0))
    return bool(sparse_logits.argmax() == dense_logits.argmax()), kl
