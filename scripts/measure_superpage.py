"""Two-level superpage selection against exact (flat) Quest on the real model (issue 20).

CPU, the embedded SmolLM2-135M by default, one long corpus document with the context
extended past the model's 8K (``context_policy=extend``, YaRN), all-resident sparse
decoding (``hierarchical=False``; bit-identical to the hierarchical path), page 16,
``group_combine`` normmax:

1. **Exact run** — prefill, then ``--steps`` greedy steps with exact Quest (end-of-turn
   ids masked, so every step yields text). At every step, layer and KV head the
   selection of ``page_metadata=superpage`` (each ``--variants`` entry, superpage pages x
   oversample) is also computed from
   the same query and metadata (superpage bounds rebuilt from the page metadata, which is
   what the engine's superpage rows hold) and compared: the share of (step, layer, KV
   head) rows whose page set equals exact's, and the share of exact's selected pages
   missing from it.
2. **Teacher-forced runs** on the exact run's tokens, each with its own cache filled with
   the prefill's K/V: dense attention (``--dense``, the fidelity reference) and, per
   ``--fidelity`` variant, ``page_metadata=superpage``: greedy agreement (argmax equal)
   and KL per step, of each superpage run against exact and against dense, and of exact
   against dense.
   With dense, also the paired difference superpage - exact against dense (agreement
   and KL per step, block-bootstrap 95 % intervals); ``--pool A.json B.json ...`` pools
   that comparison over several runs (documents) without running anything.
3. **Bytes** — metadata read per step and job (all layers and KV heads) for exact and
   superpage at this context (its ``--top-k``) and at 32K / 128K / 256K (``--bytes-top-k``,
   default 2048 tokens), next to the job's KV bytes (bf16), from the formula of
   :mod:`kernels.superpage_select`.

Prints a table and writes JSON.

Usage::

    OMP_NUM_THREADS=1 python scripts/measure_superpage.py --tokens 8192 --steps 200 \
        --top-k 512 --variants 16x4,16x8,8x8 --out docs/bench/superpage_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, SamplingParams  # noqa: E402
from engine.decode.attention import DecodeAttention  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.bench_kv import corpus_dir  # noqa: E402
from kernels.bitmask import unpack_bits  # noqa: E402
from kernels.quest_scores import quest_scores_ref  # noqa: E402
from kernels.superpage_select import (  # noqa: E402
    num_candidates,
    superpage_meta_ref,
    superpage_select_ref,
    superpage_table,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def meta_rows_per_head(num_pages: int, k_pages: int, sp: int, oversample: float | None) -> int:
    """Metadata pair rows one (request, layer, KV head) reads per step: every page for
    exact (``oversample`` None), else superpages + candidate pages + the refreshed tail."""
    if oversample is None:
        return num_pages
    c = min(num_candidates(k_pages, sp, oversample), -(-num_pages // sp))
    return -(-num_pages // sp) + c * sp + sp


def parse_variant(text: str) -> tuple[int, float]:
    """``"16x2"`` -> (superpage_pages 16, oversample 2.0)."""
    sp, o = text.split("x")
    return int(sp), float(o)


def name(sp: int, o: float) -> str:
    return f"{sp}x{o:g}"


def bytes_table(model, tokens: int, top_k: int, long_top_k: int, page: int, variants) -> dict:
    """Metadata bytes per step and job (bf16 metadata) vs the job's bf16 KV bytes: at the
    measured context with its ``top_k``, and at 32K / 128K / 256K with ``long_top_k``."""
    hl = model.num_layers * model.num_kv_heads
    out = {}
    for t in sorted({tokens, 32768, 131072, 262144}):
        p = -(-t // page)
        kv = hl * p * 2 * page * model.head_dim * 2
        k = top_k if t == tokens else long_top_k
        row = {"kv_bytes": kv, "top_k_tokens": k}
        cols = [("exact", 1, None)] + [(name(sp, o), sp, o) for sp, o in variants]
        for key, sp, o in cols:
            b = hl * meta_rows_per_head(p, -(-k // page), sp, o) * 2 * model.head_dim * 2
            row[key] = {"bytes": b, "kv_over": kv / b}
        out[str(t)] = row
    return out


def compare(ref: tuple, got: tuple) -> dict:
    """Greedy agreement (argmax, end-of-turn masked) and KL(ref || got) over the steps of
    two teacher-forced runs ``(tokens, log-probabilities)`` on the same tokens; the
    per-step values too (``agree_steps``, ``kl_steps``: the paired comparison's input)."""
    agree = [a == b for a, b in zip(got[0][1:], ref[0][1:], strict=True)]
    kls = [float((r.exp() * (r - g)).sum()) for r, g in zip(ref[1], got[1], strict=True)]
    prefix = next((i for i, ok in enumerate(agree) if not ok), len(agree))
    return {
        "greedy_agreement": sum(agree) / len(agree),
        "first_disagreement_step": prefix,
        "kl_mean_nats": sum(kls) / len(kls),
        "kl_max_nats": max(kls),
        "agree_steps": [int(a) for a in agree],
        "kl_steps": kls,
    }


BOOT_BLOCK, BOOT_SAMPLES = 16, 4000
"""Moving-block bootstrap: blocks of consecutive decode steps (neighbouring steps of one
text are correlated), resamples."""


def paired(runs: list[tuple[list, list]], seed: int = 0) -> dict:
    """Paired difference variant - exact of a per-step measure against dense (one
    ``(exact_steps, variant_steps)`` pair per document run): mean and its 95 % interval by
    a moving-block bootstrap (Künsch 1989) that resamples blocks of :data:`BOOT_BLOCK`
    steps within each run, so each run keeps its weight."""
    gen = torch.Generator().manual_seed(seed)
    diffs = [torch.tensor(v, dtype=torch.float64) - torch.tensor(e, dtype=torch.float64)
             for e, v in runs]  # fmt: skip
    total = sum(d.numel() for d in diffs)
    means = torch.zeros(BOOT_SAMPLES, dtype=torch.float64)
    for d in diffs:
        n = d.numel()
        blk = min(BOOT_BLOCK, n)
        starts = torch.randint(0, n - blk + 1, (BOOT_SAMPLES, -(-n // blk)), generator=gen)
        idx = (starts[..., None] + torch.arange(blk)).flatten(1)[:, :n]
        means += d[idx].sum(1)
    means /= total
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64))
    mean = float(sum(d.sum() for d in diffs) / total)
    return {"steps": total, "mean": mean, "ci95": [float(lo), float(hi)]}


def paired_against_dense(results: list[dict], variant: str) -> dict:
    """Superpage ``variant`` minus exact, each against dense, over the runs ``results``
    (this script's JSON): greedy agreement (> 0: the variant agrees more) and KL (> 0: the
    variant is further from dense). "No loss" at 95 %: the agreement interval's upper end
    is >= 0 and the KL interval's lower end is <= 0."""
    agree, kl = [], []
    for r in results:
        e, v = r["fidelity"]["exact"]["vs_dense"], r["fidelity"][variant]["vs_dense"]
        agree.append((e["agree_steps"], v["agree_steps"]))
        kl.append((e["kl_steps"], v["kl_steps"]))
    out = {"greedy_agreement": paired(agree), "kl_nats": paired(kl, seed=1)}
    out["no_loss_at_95"] = (
        out["greedy_agreement"]["ci95"][1] >= 0 and out["kl_nats"]["ci95"][0] <= 0
    )
    return out


def pool(paths: list[Path], out: Path | None) -> int:
    """``--pool``: the paired comparison over several runs' JSON files (same variants)."""
    results = [json.loads(p.read_text()) for p in paths]
    variants = [v for v in results[0]["fidelity"] if v != "exact"]
    pooled = {
        "what": "superpage vs exact, each against dense, pooled over runs (issue 20)",
        "runs": [
            {
                "file": str(p),
                "doc": r["doc"],
                "tokens": r["tokens"],
                "steps": r["steps"],
                "top_k_tokens": r["top_k_tokens"],
            }
            for p, r in zip(paths, results, strict=True)
        ],  # fmt: skip
        "variants": {v: paired_against_dense(results, v) for v in variants},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    print(f"{len(results)} runs, {sum(r['steps'] for r in results)} steps")
    print(f"{'variant':<10}{'agreement diff [95% CI]':>34}{'KL diff nats [95% CI]':>36}  no loss")
    for v, r in pooled["variants"].items():
        a, k = r["greedy_agreement"], r["kl_nats"]
        print(
            f"{v:<10}{a['mean']:>+10.4f} [{a['ci95'][0]:+.4f}, {a['ci95'][1]:+.4f}]"
            f"{k['mean']:>+14.4f} [{k['ci95'][0]:+.4f}, {k['ci95'][1]:+.4f}]"
            f"  {'yes' if r['no_loss_at_95'] else 'NO'}"
        )
    if out:
        out.write_text(json.dumps(pooled, indent=2) + "\n")
    return 0


def sticky_select_ref(
    q, meta, super_meta, page_super, block_table, num_pages, top_k_pages, sink_pages,
    window_pages, superpage_pages, num_cand, scale, prev, lse_over_all=False, out_cand=None,
):  # fmt: skip
    """Measured only, not an engine mode: the two-level selection (``normmax``) whose
    candidates are the pages of the best ``num_cand`` superpages **and** the pages the
    same (layer, KV head) selected at the previous step (``prev`` bool ``[B, Hkv, P_max]``,
    or None: the superpages' pages only). Scores every page's Quest bound here, for
    simplicity; an engine version would read only the candidates' (``M + top_k`` rows).
    ``lse_over_all``: each head's log-sum-exp over every page, as exact Quest's normmax,
    instead of over the candidates (a diagnosis: how much of the difference from exact is
    the normalisation, not the candidates). ``out_cand``: a list that receives the
    candidate mask. Returns bool ``[B, Hkv, P_max]``."""
    b, hq, d = q.shape
    hkv = meta.shape[1]
    g, p_max, s = hq // hkv, block_table.shape[1], superpage_pages
    n = num_pages.long().to(q.device)
    idx = torch.arange(p_max, device=q.device)
    valid = idx[None, :] < n[:, None]  # [B, P]
    sp_scores = quest_scores_ref(
        q, super_meta, superpage_table(page_super, block_table, s), (n + s - 1) // s,
        "normmax", scale,
    )  # fmt: skip
    c = min(num_cand, sp_scores.shape[-1])
    top = torch.sort(sp_scores, dim=-1, descending=True, stable=True).indices[..., :c]
    cand = torch.zeros(b, hkv, p_max, dtype=torch.bool, device=q.device)
    pages = (top[..., None] * s + torch.arange(s, device=q.device)).flatten(2)
    cand.scatter_(-1, pages.clamp(max=p_max - 1), pages < p_max)
    if prev is not None:  # the page table may have grown by a page since
        width = min(prev.shape[-1], p_max)
        cand[..., :width] |= prev[..., :width]
    cand &= valid[:, None, :]
    rows = meta[block_table.long().clamp(min=0)].float()  # [B, P, Hkv, 2, D]
    qg = q.float().view(b, 1, hkv, g, d)
    u = torch.maximum(qg * rows[:, :, :, None, 0], qg * rows[:, :, :, None, 1]).sum(-1)
    x = (u * scale).permute(0, 2, 3, 1)  # [B, Hkv, G, P]
    over = valid[:, None, None, :] if lse_over_all else cand[:, :, None, :]
    lse = torch.logsumexp(x.masked_fill(~over, -math.inf), dim=-1, keepdim=True)
    x = x.masked_fill(~cand[:, :, None, :], -math.inf)
    score = (x - lse).amax(2)  # [B, Hkv, P]
    if out_cand is not None:
        out_cand.append(cand)
    forced = valid & ((idx[None, :] < sink_pages) | (idx[None, :] >= n[:, None] - window_pages))
    usable = cand & ~forced[:, None, :]
    score = score.masked_fill(~usable, -math.inf)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    n_forced = forced.sum(-1)
    free = (torch.maximum(n.clamp(max=top_k_pages), n_forced) - n_forced)[:, None, None]
    ranked_usable = usable.gather(-1, order)
    keep = ranked_usable & (torch.arange(p_max, device=q.device) < free)
    picked = torch.zeros_like(cand).scatter_(-1, order, keep)
    return picked | forced[:, None, :]


def engine_config(args, **changes) -> EngineConfig:
    settings = dict(
        attention="sparse",
        hierarchical=False,
        host_pool_gb=args.host_pool_gb,
        max_batch=1,
        page_size=args.page_size,
        top_k=args.top_k,
        sink_tokens=16,
        local_window=64,
        context_policy="extend",
        max_context=args.tokens + args.steps + 64,
    )
    if args.device != "cpu":
        # bfloat16 as the GPU presets; eager steps, since the comparison wraps the select
        settings.update(device=args.device, dtype="bfloat16", kv_dtype="bfloat16",
                        cuda_graph=False, async_decode=False, decode_overlap=False)  # fmt: skip
    return EngineConfig(**{**settings, **changes})


def use(engine, cfg: EngineConfig) -> None:
    """Point ``engine`` at a fresh cache and decode attention for ``cfg``."""
    cfg.validate()
    engine.cache.close()
    m = engine.model
    cache = KVCache(
        engine.model_config, cfg, m.device, -(-engine.context_limit // cfg.page_size),
        layers=m.layer_range,
    )  # fmt: skip
    windows = [m.attn_window(i) for i in m.layer_range]
    engine.config, engine.cache = cfg, cache
    engine.attn = DecodeAttention(cache, cfg, engine.ops, m.scale, None, m.attn_softcap, windows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=corpus_dir())
    p.add_argument(
        "--doc",
        default="library-stdtypes.txt",
        help="corpus file, or a comma list read in order and joined by blank lines "
        "(contexts longer than one document)",
    )
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (bfloat16, eager steps)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--variants", default="16x2,16x4", help="superpage_pages x oversample, comma-separated"
    )
    p.add_argument(
        "--fidelity", default=None, help="variants also decoded teacher-forced (default: all)"
    )
    p.add_argument("--host-pool-gb", type=float, default=1.0)
    p.add_argument(
        "--dense",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also decode dense (teacher-forced) as the fidelity reference",
    )
    p.add_argument(
        "--bytes-top-k",
        type=int,
        default=2048,
        help="top_k (tokens) of the byte table's 32K/128K/256K rows",
    )
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="also, per variant: which of exact's missing pages lie outside the candidates, "
        "and the selection with each head's log-sum-exp over every page (measured only)",
    )
    p.add_argument(
        "--sticky",
        action="store_true",
        help="also compare, per variant, candidates that add the pages the variant picked at "
        "the previous step (measured only: sticky_select_ref, normmax)",
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--pool",
        type=Path,
        nargs="+",
        default=None,
        help="no run: pool these runs' JSON (superpage vs exact, each against dense, paired "
        "by step, block-bootstrap 95%% intervals) and write --out",
    )
    args = p.parse_args(argv)
    if args.pool:
        return pool(args.pool, args.out)
    variants = [parse_variant(v) for v in args.variants.split(",")]
    fid = args.fidelity.split(",") if args.fidelity is not None else args.variants.split(",")
    fidelity = [parse_variant(v) for v in fid if v]
    cfg = engine_config(args)
    engine = load_engine(cfg, args.model)
    engine.keep_logits = True
    attn, ends = engine.attn, sorted(engine.eos_ids)
    text = "\n\n".join((args.corpus / d).read_text("utf-8") for d in args.doc.split(","))
    ids = engine.tokenizer.encode(text)[: args.tokens]
    if len(ids) < args.tokens:
        log(f"the documents hold {len(ids)} tokens, fewer than --tokens {args.tokens}")
    keys = [*variants, *[(sp, o, "sticky") for sp, o in variants if args.sticky]]
    keys += [(sp, o, "global lse") for sp, o in variants if args.diagnose]
    stats = {v: {"rows": 0, "same": 0, "sel": 0, "missing": 0} for v in keys}
    outside = {v: 0 for v in variants}  # ... of them, outside its candidates (--diagnose)
    prev: dict[tuple, torch.Tensor] = {}  # (variant, layer) -> last sticky selection
    select = attn.select

    def both(plan, layer, q, scores=None):
        exact = select(plan, layer, q, scores)
        meta, p_max = attn.cache.meta[layer], plan.block_table.shape[1]
        n = int(plan.num_pages[0])
        pages = plan.block_table[0, :n].long()
        a = unpack_bits(exact, p_max)
        for sp, o in variants:
            super_meta = superpage_meta_ref(meta, pages, sp)
            page_super = torch.full((meta.shape[0],), -1, dtype=torch.int32, device=meta.device)
            page_super[pages[::sp]] = torch.arange(
                super_meta.shape[0], dtype=torch.int32, device=meta.device
            )
            got = superpage_select_ref(
                q, meta, super_meta.clone(), page_super, plan.block_table, plan.num_pages,
                cfg.top_k_pages, cfg.sink_pages, cfg.window_pages, sp,
                num_candidates(cfg.top_k_pages, sp, o), cfg.group_combine, attn.scale,
            )  # fmt: skip
            picks = {(sp, o): unpack_bits(got, p_max)}
            if args.sticky:
                picks[(sp, o, "sticky")] = sticky = sticky_select_ref(
                    q, meta, super_meta, page_super, plan.block_table, plan.num_pages,
                    cfg.top_k_pages, cfg.sink_pages, cfg.window_pages, sp,
                    num_candidates(cfg.top_k_pages, sp, o), attn.scale,
                    prev.get((sp, o, layer)),
                )  # fmt: skip
                prev[(sp, o, layer)] = sticky
            if args.diagnose:
                cands: list[torch.Tensor] = []
                picks[(sp, o, "global lse")] = sticky_select_ref(
                    q, meta, super_meta, page_super, plan.block_table, plan.num_pages,
                    cfg.top_k_pages, cfg.sink_pages, cfg.window_pages, sp,
                    num_candidates(cfg.top_k_pages, sp, o), attn.scale, None,
                    lse_over_all=True, out_cand=cands,
                )  # fmt: skip
                missed = a & ~picks[(sp, o)]  # exact's pages the superpage rule lacks ...
                outside[(sp, o)] += int((missed & ~cands[0][..., : a.shape[-1]]).sum())
            for key, b in picks.items():
                st = stats[key]
                st["rows"] += a.shape[0] * a.shape[1]
                st["same"] += int((a == b).all(-1).sum())
                st["sel"] += int(a.sum())
                st["missing"] += int((a & ~b).sum())
        return exact

    attn.select = both
    t0 = time.time()
    req = engine.open_request(Job("x", tuple(ids), SamplingParams(max_tokens=args.steps + 2)))
    first = engine.prefill(req)
    log(f"prefill {len(ids)} tokens: {time.time() - t0:.0f} s")
    first_logits = req.logits.clone()
    keys, values = [], []
    n_pages = engine.cache.pages_for(len(ids))
    pg = torch.tensor(
        engine.cache.seqs[req.seq_id].pages[:n_pages], dtype=torch.long,
        device=engine.cache.pool[0].device,
    )  # fmt: skip
    for layer in range(engine.model_config.num_layers):
        rec = engine.cache.pool[layer][pg]
        _, hkv, _, s, d = rec.shape
        kv = rec.permute(2, 0, 3, 1, 4).reshape(2, n_pages * s, hkv, d)
        keys.append(kv[0, : len(ids)].clone())
        values.append(kv[1, : len(ids)].clone())

    def decode(req, forced: list[int] | None) -> tuple[list[int], list[torch.Tensor]]:
        tokens, logps = [first], []
        t = time.time()
        for i in range(args.steps):
            if i > 0:
                req.generated.append(forced[i] if forced else tokens[-1])
            engine.decode_step([req])
            logits = req.logits.float()
            logps.append(F.log_softmax(logits, -1))
            logits = logits.clone()
            logits[ends] = float("-inf")
            tokens.append(int(logits.argmax()))
            if i % 25 == 0:
                log(f"  step {i} ({(time.time() - t) / (i + 1):.2f} s/step)")
        return tokens, logps

    exact_tokens, exact_logps = decode(req, None)
    engine.close_request(req)
    attn.select = select

    def forced_run(cfg_run: EngineConfig, label: str) -> tuple[list[int], list[torch.Tensor]]:
        log(f"{label}: teacher-forced decode")
        use(engine, cfg_run)
        r = engine.open_request(Job(label, tuple(ids), SamplingParams(max_tokens=args.steps + 2)))
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            engine.cache.write_prefill(r.seq_id, layer, k, v, 0)
        engine.cache.seqs[r.seq_id].num_tokens = len(ids)
        r.phase, r.generated, r.logits = "decode", [first], first_logits
        try:
            return decode(r, exact_tokens)
        finally:
            engine.cache.check_integrity()
            engine.close_request(r)

    dense = forced_run(engine_config(args, attention="dense"), "dense") if args.dense else None
    runs = {}
    for sp, o in fidelity:
        got = forced_run(
            engine_config(args, page_metadata="superpage", superpage_pages=sp,
                          superpage_oversample=o), f"superpage {name(sp, o)}",
        )  # fmt: skip
        runs[name(sp, o)] = {"vs_exact": compare((exact_tokens, exact_logps), got)}
        if dense is not None:
            runs[name(sp, o)]["vs_dense"] = compare(dense, got)
    if dense is not None:
        runs["exact"] = {"vs_dense": compare(dense, (exact_tokens, exact_logps))}
        for sp, o in fidelity:
            runs[name(sp, o)]["paired_vs_exact_against_dense"] = paired_against_dense(
                [{"fidelity": runs}], name(sp, o)
            )
    model = engine.model_config
    result = {
        "what": "two-level superpage selection vs exact flat Quest (issue 20)",
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "doc": args.doc,
        "tokens": len(ids),
        "steps": args.steps,
        "top_k_tokens": args.top_k,
        "page_size": args.page_size,
        "group_combine": cfg.group_combine,
        "context_policy": "extend (yarn)",
        "selection": {
            name(*key[:2]) + (f" {key[2]}" if len(key) > 2 else ""): {
                "superpage_pages": key[0],
                "oversample": key[1],
                "num_candidates": num_candidates(cfg.top_k_pages, key[0], key[1]),
                "previous_step_pages_added": len(key) > 2 and key[2] == "sticky",
                "lse_over_every_page": len(key) > 2 and key[2] == "global lse",
                "rows_step_layer_head": st["rows"],
                "share_rows_same_page_set": st["same"] / max(st["rows"], 1),
                "share_exact_pages_missing": st["missing"] / max(st["sel"], 1),
                **(
                    {
                        "share_exact_pages_missing_outside_candidates": outside[key]
                        / max(st["sel"], 1)
                    }
                    if args.diagnose and len(key) == 2
                    else {}
                ),
            }
            for key, st in stats.items()
        },
        "fidelity": runs,
        "bytes_per_step_per_job": bytes_table(
            model, len(ids), args.top_k, args.bytes_top_k, args.page_size, variants
        ),
        "machine": (
            platform.node() + " (2-core CPU, shared with other agents: contended)"
            if args.device == "cpu"
            else f"{platform.node()} ({torch.cuda.get_device_name(args.device)})"
        ),
        "device": args.device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python scripts/measure_superpage.py " + " ".join(argv or sys.argv[1:]),
    }
    nan = {"greedy_agreement": float("nan"), "kl_mean_nats": float("nan")}
    print(f"{'variant':<13}{'C':>4}{'same set':>10}{'missing':>9}  vs exact: agree, KL"
          "   vs dense: agree, KL")  # fmt: skip
    for key in ["exact", *result["selection"]]:
        sel = result["selection"].get(key)
        f = runs.get(key, {})
        e, d = f.get("vs_exact", nan), f.get("vs_dense", nan)
        cells = (
            f"{sel['num_candidates']:>4}{sel['share_rows_same_page_set']:>10.2%}"
            f"{sel['share_exact_pages_missing']:>9.2%}"
            if sel
            else f"{'':>4}{'':>10}{'':>9}"
        )
        print(
            f"{key:<13}{cells}  {e['greedy_agreement']:>13.3f} {e['kl_mean_nats']:>7.4f}"
            f"  {d['greedy_agreement']:>13.3f} {d['kl_mean_nats']:>7.4f}"
        )
    for t, row in result["bytes_per_step_per_job"].items():
        cells = "  ".join(
            f"{k} {v['bytes'] / 2**20:.2f} MiB (KV/{v['kv_over']:.0f})"
            for k, v in row.items()
            if isinstance(v, dict)
        )
        print(f"{t:>7} tokens: {cells}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
