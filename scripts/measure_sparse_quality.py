"""Sparse vs dense quality on real documents, and policy replay of recorded selections.

Rung 5 of the correctness ladder (DESIGN.md): reported, not asserted. With the real model
(the embedded SmolLM2-135M-Instruct by default) on corpus documents (``$HISPARSE_CORPUS``
or ``../shared/corpus``), for each sparse config (``top_k`` tokens x ``page_size``):

* **agreement** — dense generates ``--steps`` greedy tokens; the same tokens are fed to
  the sparse engine (teacher forcing) and its per-step argmax is compared with dense's.
  The free-running exact-match prefix (tokens before sparse greedy decoding first departs
  from dense) is the index of the first teacher-forced disagreement: until then both runs
  feed identical tokens into a deterministic engine, so they are the same run;
* **KL** — mean over the steps of KL(dense || sparse) of the full next-token
  distributions (nats);
* **needle** — a sentence holding a random 6-digit number (fixed seed) is placed at 10%,
  50% and 90% depth of a cut corpus text and asked for (chat template, greedy, up to
  16 tokens); found = the number appears in the answer.

End-of-turn tokens are masked out of the argmax in the agreement runs, so every document
yields ``--steps`` tokens of text (KL uses the unmasked distributions).

The sparse configs run the quest indexer with each ``group_combine`` rule asked for
(``--rules`` for the needle, ``--quality-rules`` for agreement/KL) and, beside them, the
``oracle`` indexer (exact attention mass per page, same budget; ``--no-oracle`` drops it).
With ``--mass`` the needle runs also measure, at every decode step, layer and KV head, the
share of the true attention mass on the selected pages and its ratio to the oracle's
(:class:`MassProbe`).

It also records selection traces (:mod:`engine.measure.trace`) of the agreement runs at
``--trace-top-k`` and page 16 and replays them (:mod:`engine.measure.replay`) through LRU, FIFO,
random and Bélády at ``device_buffer`` in {1, 2, 4} x top_k.

Cost: prefill dominates (~1-2.5 min per 7K-token document on one core), so each
document is prefilled once, in the page-16 cache, and its per-layer K/V are written into
the page-32 and page-64 caches with ``KVCache.write_prefill`` (prefill attention runs on
the prompt's own K/V and does not depend on the page size or the sparse settings, so this
is exact). Decoding runs on one engine whose attention (``DecodeAttention``) and cache
are switched per config; sparse configs use the all-resident sparse path
(``hierarchical=False``), bit-identical to the hierarchical one (ladder rung 3).

Usage::

    OMP_NUM_THREADS=1 python scripts/measure_sparse_quality.py --out sparse_quality.json
    OMP_NUM_THREADS=1 python scripts/measure_sparse_quality.py --quick   # ~3 min smoke run
    OMP_NUM_THREADS=1 python scripts/measure_sparse_quality.py --skip quality,replay --mass \
        --top-k 1024,2048 --page-size 16,32 --out rules.json       # selection rules, needle
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import GROUP_COMBINES, EngineConfig, SamplingParams  # noqa: E402
from engine.decode.attention import DecodeAttention  # noqa: E402
from engine.events import Job  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.load import load_engine  # noqa: E402
from engine.measure.bench_kv import corpus_dir  # noqa: E402
from engine.measure.replay import POLICIES, capacities_from_multiples, replay_trace  # noqa: E402
from engine.measure.trace import TraceHeader, TraceWriter, read_header  # noqa: E402
from engine.serve.engine import Engine, Request  # noqa: E402
from kernels.bitmask import unpack_bits  # noqa: E402

QUALITY_DOCS = ("howto-logging.txt", "library-re.txt", "whatsnew-3.11.txt")
NEEDLE_DOC = "tutorial-controlflow.txt"
SUMMARY_PROMPT = "Summarize the following document in detail.\n\n"
NEEDLE_QUESTION = "What is the secret passcode mentioned in the text? Answer with the number only."
BUFFER_MULTIPLES = (1.0, 2.0, 4.0)
HOST_POOL_GB = 0.5


@dataclass(frozen=True)
class Variant:
    """One decode configuration: dense, or sparse with ``top_k`` tokens and ``page_size``
    selected by ``indexer`` (``quest`` with the GQA rule ``combine``, or ``oracle``)."""

    page_size: int
    top_k: int | None = None
    indexer: str = "quest"
    combine: str = EngineConfig.group_combine

    @property
    def rule(self) -> str:
        """``dense``, ``oracle`` or the quest indexer's ``group_combine``."""
        return (
            "dense"
            if self.top_k is None
            else self.combine
            if self.indexer == "quest"
            else self.indexer
        )

    @property
    def name(self) -> str:
        if self.top_k is None:
            return "dense"
        return f"k{self.top_k}/p{self.page_size} {self.rule}"


class MassProbe(DecodeAttention):
    """:class:`DecodeAttention` that also measures, per layer and KV head, the share of the
    true attention mass (:func:`kernels.oracle_scores.oracle_scores_ref`, summed over the G
    query heads, divided by G) that its selection keeps, beside the oracle selection of the
    same budget (sink, window and ``top_k`` pages). ``kept`` / ``oracle_kept``: one float32
    ``[B, Hkv]`` per (step, layer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: list[torch.Tensor] = []
        self.oracle_kept: list[torch.Tensor] = []

    def select(self, plan, layer, q, scores=None):
        sel = super().select(plan, layer, q, scores)
        cfg, c = self.config, self.cache
        mass = self.ops.oracle_scores(q, c.pool[layer], plan.block_table, plan.seq_lens, self.scale)
        best = self.ops.select_topk(
            mass, plan.num_pages, cfg.top_k_pages, cfg.sink_pages, cfg.window_pages
        )
        p_max, g = mass.shape[-1], q.shape[1] // mass.shape[1]
        m = mass.clamp(min=0)  # -inf on unused pages
        for words, out in ((sel, self.kept), (best, self.oracle_kept)):
            out.append((m * unpack_bits(words, p_max)).sum(-1) / g)
        return sel

    def summary(self) -> dict:
        """Means over steps, layers and KV heads: ``mass_kept`` (share of the attention
        mass on the selected pages), ``oracle_mass_kept`` (the oracle's, same budget) and
        ``mass_vs_oracle`` (mean of the per-head ratio kept / oracle kept)."""
        if not self.kept:
            return {}
        kept, best = torch.stack(self.kept), torch.stack(self.oracle_kept)
        return {
            "mass_kept": float(kept.mean()),
            "oracle_mass_kept": float(best.mean()),
            "mass_vs_oracle": float((kept / best.clamp(min=1e-30)).mean()),
        }


@dataclass
class Prefilled:
    """A prompt after prefill: the first token, its logits, per-layer K/V ``[T, Hkv, D]``."""

    ids: tuple[int, ...]
    first_token: int
    first_logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class Harness:
    """One engine; a KV cache per page size; the decode attention switched per variant."""

    def __init__(self, model: str | None, page_sizes: list[int], sink: int, window: int):
        base = EngineConfig(
            attention="dense",
            hierarchical=False,
            page_size=16,
            host_pool_gb=HOST_POOL_GB,
            max_batch=1,
            sink_tokens=sink,
            local_window=window,
        )
        self.engine: Engine = load_engine(base, model)
        self.engine.keep_logits = True
        self.base = base
        eng = self.engine
        self.caches = {16: eng.cache}
        for s in page_sizes:
            if s not in self.caches:
                max_pages = -(-eng.context_limit // s)
                cfg = base.replace(page_size=s)
                self.caches[s] = KVCache(eng.model_config, cfg, eng.model.device, max_pages)
        self.end_ids = sorted(eng.eos_ids)

    def config_for(self, v: Variant) -> EngineConfig:
        if v.top_k is None:
            return self.base.replace(page_size=v.page_size)
        return self.base.replace(
            attention="sparse",
            page_size=v.page_size,
            top_k=v.top_k,
            indexer=v.indexer,
            group_combine=v.combine,
        )

    def use(self, v: Variant, tracer=None, probe: bool = False) -> DecodeAttention:
        """Point the engine at ``v``'s cache and a fresh decode attention for ``v`` (a
        :class:`MassProbe` when ``probe`` and ``v`` is sparse), and return it."""
        eng, cfg = self.engine, self.config_for(v)
        cfg.validate()
        eng.config, eng.cache, eng.tracer = cfg, self.caches[v.page_size], tracer
        cls = MassProbe if probe and v.top_k is not None else DecodeAttention
        eng.attn = cls(eng.cache, cfg, eng.ops, eng.model.scale, tracer)
        return eng.attn

    def prefill(self, ids: list[int], max_new: int) -> Prefilled:
        """Run the real prefill once (page-16 cache) and keep its K/V."""
        self.use(Variant(16))
        eng = self.engine
        req = eng.open_request(Job("prefill", tuple(ids), SamplingParams(max_tokens=max_new)))
        try:
            first = eng.prefill(req)
            keys, values = [], []
            seq = eng.cache.seqs[req.seq_id]
            n = eng.cache.pages_for(len(ids))
            pages = torch.tensor(seq.pages[:n], dtype=torch.long)
            for layer in range(eng.model_config.num_layers):
                rec = eng.cache.pool[layer][pages]  # [n, Hkv, 2, S, D]
                _, hkv, _, s, d = rec.shape
                kv = rec.permute(2, 0, 3, 1, 4).reshape(2, n * s, hkv, d)  # [2, T_pad, Hkv, D]
                keys.append(kv[0, : len(ids)].clone())
                values.append(kv[1, : len(ids)].clone())
            return Prefilled(tuple(ids), first, req.logits.clone(), keys, values)
        finally:
            eng.close_request(req)

    def open(
        self, pre: Prefilled, v: Variant, job_id: str, max_new: int, tracer=None, probe=False
    ) -> Request:
        """A request in decode phase for ``v``, its cache filled from ``pre``."""
        self.use(v, tracer, probe)
        eng = self.engine
        req = eng.open_request(Job(job_id, pre.ids, SamplingParams(max_tokens=max_new)))
        for layer, (k, val) in enumerate(zip(pre.keys, pre.values, strict=True)):
            eng.cache.write_prefill(req.seq_id, layer, k, val, 0)
        eng.cache.seqs[req.seq_id].num_tokens = len(pre.ids)
        req.phase, req.generated, req.logits = "decode", [pre.first_token], pre.first_logits
        return req

    def decode(
        self,
        pre: Prefilled,
        v: Variant,
        steps: int,
        forced: list[int] | None = None,
        job_id: str = "job",
        tracer=None,
        mask_end: bool = True,
        stop_at_end: bool = False,
        probe: bool = False,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """Decode ``steps`` tokens after the prefill token.

        Returns the greedy tokens (argmax with end-of-turn ids masked when ``mask_end``)
        including the prefill token, and the log-probabilities ``[V]`` of every step.
        ``forced`` (teacher forcing) feeds ``forced[i]`` at step ``i`` instead. ``probe``
        measures the attention mass kept (:class:`MassProbe`; read ``engine.attn``).
        """
        req = self.open(pre, v, job_id, steps + 2, tracer, probe)
        tokens, logps = [pre.first_token], []
        try:
            for i in range(steps):
                if stop_at_end and tokens[-1] in self.end_ids:
                    break
                if i > 0:  # step 0 feeds the prefill token, already in req.generated
                    req.generated.append(forced[i] if forced else tokens[-1])
                self.engine.decode_step([req])
                logits = req.logits.float()
                logps.append(F.log_softmax(logits, -1))
                if mask_end and self.end_ids:
                    logits = logits.clone()
                    logits[self.end_ids] = float("-inf")
                tokens.append(int(logits.argmax()))
            return tokens, logps
        finally:
            self.engine.close_request(req)
            self.engine.tracer = None




def cut_text(tok, text: str, num_tokens: int) -> tuple[str, int]:
    """The first ``num_tokens`` tokens of ``text`` as text, and the file's token count."""
    ids = tok.encode(text)
    return tok.decode(ids[:num_tokens]), len(ids)


def kl(dense: torch.Tensor, sparse: torch.Tensor) -> float:
    """KL(dense || sparse) in nats from log-probabilities ``[V]``."""
    return float((dense.exp() * (dense - sparse)).sum())


# ----------------------------------------------------------------------------- quality


def run_quality(h: Harness, args, variants: list[Variant], trace_dir: Path) -> dict:
    tok = h.engine.tokenizer
    writers = {
        k: TraceWriter(
            trace_dir / f"trace_k{k}_p16.jsonl",
            TraceHeader.for_engine(
                h.engine.model_name, h.engine.model_config, h.config_for(Variant(16, k))
            ),
        )
        for k in args.trace_top_k
        if Variant(16, k) in variants
    }  # traces of the default rule only
    docs, results = [], []
    for name in args.docs:
        text, file_tokens = cut_text(tok, (args.corpus / name).read_text("utf-8"), args.doc_tokens)
        ids = tok.encode_chat([{"role": "user", "content": SUMMARY_PROMPT + text}])
        t0 = time.monotonic()
        pre = h.prefill(ids, args.steps + 2)
        prefill_s = time.monotonic() - t0
        t0 = time.monotonic()
        dense_tokens, dense_logps = h.decode(pre, Variant(16), args.steps)
        doc = {
            "file": name,
            "file_tokens": file_tokens,
            "cut_tokens": args.doc_tokens,
            "prompt_tokens": len(ids),
            "prefill_s": round(prefill_s, 1),
            "dense_decode_s": round(time.monotonic() - t0, 1),
            "dense_text": tok.decode(dense_tokens),
        }
        docs.append(doc)
        log(
            f"{name}: {file_tokens} tokens, cut to {args.doc_tokens}; prompt {len(ids)} "
            f"tokens, prefill {prefill_s:.0f} s"
        )
        for v in variants:
            t0 = time.monotonic()
            tracer = writers.get(v.top_k) if v == Variant(16, v.top_k) else None
            tokens, logps = h.decode(
                pre, v, args.steps, forced=dense_tokens, job_id=name, tracer=tracer
            )
            agree = [a == b for a, b in zip(tokens[1:], dense_tokens[1:], strict=True)]
            kls = [kl(d, s) for d, s in zip(dense_logps, logps, strict=True)]
            prefix = agree.index(False) if False in agree else len(agree)
            results.append(
                {
                    "file": name,
                    "config": v.name,
                    "rule": v.rule,
                    "top_k": v.top_k,
                    "page_size": v.page_size,
                    "agreement": sum(agree) / len(agree),
                    "exact_prefix": prefix,
                    "kl_mean": sum(kls) / len(kls),
                    "kl_max": max(kls),
                    "decode_s": round(time.monotonic() - t0, 1),
                }
            )
            r = results[-1]
            log(
                f"  {v.name:>18}: agree {100 * r['agreement']:5.1f}%  prefix {prefix:3d}  "
                f"KL {r['kl_mean']:.4f}  ({r['decode_s']:.0f} s)"
            )
    for w in writers.values():
        w.close()
    return {
        "docs": docs,
        "results": results,
        "traces": {k: str(w.path) for k, w in writers.items()},
    }


# ----------------------------------------------------------------------------- needle


def needle_prompt(tok, filler: str, depth: float, code: int) -> tuple[list[int], float]:
    """Insert the needle at the line break nearest ``depth`` of ``filler`` (by tokens);
    returns the chat prompt ids and the needle's actual depth (token fraction)."""
    filler_ids = tok.encode(filler)
    at = len(tok.decode(filler_ids[: round(depth * len(filler_ids))]))
    breaks = [i for i, c in enumerate(filler) if c == "\n"] or [at]
    at = min(breaks, key=lambda i: abs(i - at))
    needle = f"\nThe secret passcode mentioned in this text is {code}. Remember it.\n"
    text = filler[:at] + needle + filler[at:]
    actual = len(tok.encode(filler[:at])) / len(filler_ids)
    ids = tok.encode_chat([{"role": "user", "content": text + "\n\n" + NEEDLE_QUESTION}])
    return ids, actual


def run_needle(h: Harness, args, variants: list[Variant]) -> dict:
    tok = h.engine.tokenizer
    rng = random.Random(args.seed)
    filler, file_tokens = cut_text(
        tok, (args.corpus / args.needle_doc).read_text("utf-8"), args.needle_tokens
    )
    rows = []
    for depth in args.depths:
        code = rng.randrange(100_000, 1_000_000)
        ids, actual = needle_prompt(tok, filler, depth, code)
        pre = h.prefill(ids, 18)
        row = {
            "depth": depth,
            "actual_depth": round(actual, 3),
            "code": code,
            "prompt_tokens": len(ids),
            "answers": {},
        }
        for v in [Variant(16), *variants]:
            t0 = time.monotonic()
            tokens, _ = h.decode(pre, v, 16, mask_end=False, stop_at_end=True, probe=args.mass)
            text = tok.decode(tokens)
            probe = h.engine.attn.summary() if isinstance(h.engine.attn, MassProbe) else {}
            row["answers"][v.name] = {
                "text": text,
                "found": str(code) in text,
                "rule": v.rule,
                "top_k": v.top_k,
                "page_size": v.page_size,
                "decode_s": round(time.monotonic() - t0, 1),
                **probe,
            }
            mass = f"  mass kept {100 * probe['mass_kept']:.1f}%" if probe else ""
            log(f"  {v.name:>18}: {'found' if str(code) in text else 'not found'}{mass}")
        rows.append(row)
        found = [n for n, a in row["answers"].items() if a["found"]]
        log(
            f"needle at {100 * depth:.0f}% ({code}): dense answered "
            f"{row['answers']['dense']['text']!r}; found by {len(found)}/{len(row['answers'])}"
        )
    return {
        "file": args.needle_doc,
        "file_tokens": file_tokens,
        "cut_tokens": args.needle_tokens,
        "rows": rows,
    }


# ----------------------------------------------------------------------------- replay


def run_replay(traces: dict) -> list[dict]:
    out = []
    for k, path in traces.items():
        t0 = time.monotonic()
        header = read_header(path)
        caps = capacities_from_multiples(header, BUFFER_MULTIPLES)
        _, results = replay_trace(path, caps, POLICIES)
        for r in results:
            out.append(
                {
                    "top_k": k,
                    "page_size": header.page_size,
                    "multiple": r.capacity_pages / header.top_k_pages,
                    **r.to_dict(),
                }
            )
        log(f"replay of {path}: {time.monotonic() - t0:.0f} s")
    return out


# ----------------------------------------------------------------------------- report


def markdown(report: dict) -> str:
    """Markdown tables of a report (what goes into docs/performance.md)."""
    lines = []
    q = report.get("quality")
    if q:
        lines += [
            "| document | file tokens | used (cut) | prompt tokens | prefill s |",
            "|---|---:|---:|---:|---:|",
        ]
        for d in q["docs"]:
            lines.append(
                f"| {d['file']} | {d['file_tokens']} | first {d['cut_tokens']} | "
                f"{d['prompt_tokens']} | {d['prefill_s']} |"
            )
        files = [d["file"] for d in q["docs"]]
        lines += [
            "",
            "| config | agreement "
            + " / ".join(files)
            + " | mean | exact prefix "
            + " / ".join(files)
            + " | mean KL (nats) |",
            "|---|---|---:|---|---:|",
        ]
        by = {}
        for r in q["results"]:
            by.setdefault(r["config"], []).append(r)
        for name, rs in by.items():
            agree = " / ".join(f"{100 * r['agreement']:.1f}%" for r in rs)
            mean = sum(r["agreement"] for r in rs) / len(rs)
            prefix = " / ".join(str(r["exact_prefix"]) for r in rs)
            klm = sum(r["kl_mean"] for r in rs) / len(rs)
            lines.append(f"| {name} | {agree} | {100 * mean:.1f}% | {prefix} | {klm:.4f} |")
    n = report.get("needle")
    if n:
        depths = [f"{100 * r['depth']:.0f}% ({r['code']})" for r in n["rows"]]
        lines += ["", "| config | " + " | ".join(depths) + " |", "|---|" + "---|" * len(depths)]
        for name in n["rows"][0]["answers"]:
            cells = [_needle_cell(r["answers"][name]) for r in n["rows"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += needle_summary(n["rows"])
    rp = report.get("replay")
    if rp:
        mults = sorted({r["multiple"] for r in rp})
        lines += [
            "",
            "| trace | policy | " + " | ".join(f"B = {m:g}x top_k" for m in mults) + " |",
            "|---|---|" + "---:|" * len(mults),
        ]
        keys = list(dict.fromkeys((r["top_k"], r["page_size"], r["policy"]) for r in rp))
        for k, s, p in keys:
            cells = [
                f"{100 * r['miss_rate']:.1f}% ({100 * r['warm_miss_rate']:.1f}%)"
                for m in mults
                for r in rp
                if (r["top_k"], r["page_size"], r["policy"], r["multiple"]) == (k, s, p, m)
            ]
            lines.append(f"| k{k}/p{s} | {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def needle_summary(rows: list[dict]) -> list[str]:
    """Markdown: per rule, the depths found in each (top_k, page) cell and in all; then,
    where measured, the attention mass kept (mean over the needle answer's steps, layers
    and KV heads) and its ratio to the oracle's, per rule and cell, over all depths."""
    answers = [a for r in rows for a in r["answers"].values() if a.get("top_k")]
    if not answers:
        return []
    rules = list(dict.fromkeys(a["rule"] for a in answers))
    cells = list(dict.fromkeys((a["top_k"], a["page_size"]) for a in answers))

    def of(rule: str, cell: tuple) -> list[dict]:
        return [a for a in answers if a["rule"] == rule and (a["top_k"], a["page_size"]) == cell]

    head = "| rule | " + " | ".join(f"k{k}/p{s}" for k, s in cells) + " | all |"
    lines = ["", "Needle found (depths of " + str(len(rows)) + "):", "", head]
    lines.append("|---|" + "---:|" * (len(cells) + 1))
    for rule in rules:
        found = [sum(a["found"] for a in of(rule, c)) for c in cells]
        total = sum(len(of(rule, c)) for c in cells)
        lines.append(f"| {rule} | " + " | ".join(map(str, found)) + f" | {sum(found)}/{total} |")
    if all("mass_kept" in a for a in answers):
        lines += ["", "Attention mass kept, mean over depths (kept / oracle's kept):", "", head]
        lines.append("|---|" + "---:|" * (len(cells) + 1))
        for rule in rules:
            row = []
            for group in [of(rule, c) for c in cells] + [[a for a in answers if a["rule"] == rule]]:
                kept = sum(a["mass_kept"] for a in group) / len(group)
                ratio = sum(a["mass_vs_oracle"] for a in group) / len(group)
                row.append(f"{100 * kept:.1f}% ({100 * ratio:.1f}%)")
            lines.append(f"| {rule} | " + " | ".join(row) + " |")
    return lines


def _needle_cell(answer: dict) -> str:
    """ "found", or "not found" with the number (or the start of the text) answered."""
    if answer["found"]:
        return "found"
    numbers = re.findall(r"\d{4,}", answer["text"])
    said = numbers[0] if numbers else repr("..." + answer["text"].strip()[-30:])
    return f"not found ({said})".replace("|", "/")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    def floats(s: str) -> list[float]:
        return [float(x) for x in s.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF / HF folder (default: embedded).")
    p.add_argument("--corpus", type=Path, default=corpus_dir())
    p.add_argument("--docs", type=lambda s: s.split(","), default=list(QUALITY_DOCS))
    p.add_argument("--doc-tokens", type=int, default=7000, help="Cut documents to N tokens.")
    p.add_argument("--steps", type=int, default=128, help="Generated tokens compared.")
    p.add_argument("--top-k", type=ints, default=[512, 1024, 2048])
    p.add_argument("--page-size", type=ints, default=[16, 32, 64])
    p.add_argument(
        "--rules",
        type=lambda s: s.split(","),
        default=list(GROUP_COMBINES),
        help="Quest group_combine rules of the needle runs (the oracle runs beside them).",
    )
    p.add_argument(
        "--quality-rules",
        type=lambda s: s.split(","),
        default=[EngineConfig.group_combine],
        help="Quest group_combine rules of the agreement/KL runs.",
    )
    p.add_argument("--no-oracle", action="store_true", help="Leave out the oracle indexer's runs.")
    p.add_argument(
        "--mass",
        action="store_true",
        help="Needle runs also measure the attention mass each selection keeps (MassProbe).",
    )
    p.add_argument("--sink-tokens", type=int, default=EngineConfig.sink_tokens)
    p.add_argument("--local-window", type=int, default=EngineConfig.local_window)
    p.add_argument("--needle-doc", default=NEEDLE_DOC)
    p.add_argument("--needle-tokens", type=int, default=6000)
    p.add_argument("--depths", type=floats, default=[0.1, 0.5, 0.9])
    p.add_argument("--trace-top-k", type=ints, default=[512, 1024])
    p.add_argument("--trace-dir", type=Path, default=None, help="Default: beside --out.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--skip",
        type=lambda s: s.split(","),
        default=[],
        help="Sections to skip: quality, needle, replay.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="Smoke run: one 2K-token document, 16 steps, k512 x p16/p64, one depth.",
    )
    p.add_argument("--out", type=Path, default=Path("sparse_quality.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.docs, args.doc_tokens, args.steps = args.docs[:1], 2000, 16
        args.top_k, args.page_size, args.trace_top_k = [512], [16, 64], [512]
        args.needle_tokens, args.depths = 2000, [0.5]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    trace_dir = args.trace_dir or args.out.parent
    trace_dir.mkdir(parents=True, exist_ok=True)
    bad = sorted(set(args.rules + args.quality_rules) - set(GROUP_COMBINES))
    if bad:
        raise SystemExit(f"unknown rule(s) {bad}; choose from {', '.join(GROUP_COMBINES)}")

    def grid(rules: list[str]) -> list[Variant]:
        """Every (top_k, page) with each quest rule, then the oracle (unless --no-oracle)."""
        out = []
        for k in args.top_k:
            for s in args.page_size:
                out += [Variant(s, k, combine=r) for r in rules]
                out += [] if args.no_oracle else [Variant(s, k, indexer="oracle")]
        return out

    variants = grid(args.quality_rules)
    t_start = time.monotonic()
    h = Harness(args.model, args.page_size, args.sink_tokens, args.local_window)
    report: dict = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
        "model": h.engine.model_name,
        "sink_tokens": args.sink_tokens,
        "local_window": args.local_window,
        "steps": args.steps,
    }
    if "quality" not in args.skip:
        report["quality"] = run_quality(h, args, variants, trace_dir)
        if "replay" not in args.skip:
            report["replay"] = run_replay(report["quality"]["traces"])
    if "needle" not in args.skip:
        report["needle"] = run_needle(h, args, grid(args.rules))
    report["total_s"] = round(time.monotonic() - t_start, 1)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    log(f"wrote {args.out} and {args.out.with_suffix('.md')} in {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
