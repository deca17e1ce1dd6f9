"""CPU speed against llama.cpp: prefill and decode tokens/s of hisparse and llama-cpp-python
on the same GGUF, the same prompt tokens and the same thread count, in one process.

The prompt is the chat-templated summarisation request of a corpus document
(``$HISPARSE_CORPUS``, default ``tutorial-controlflow.txt``) whose text is cut so the
templated prompt holds about ``--prompt-tokens`` tokens (default 8000: with the decoded
tokens it stays inside SmolLM2's trained 8192, so neither engine extends its context).
Both engines get the very same token ids (hisparse's tokenizer, which matches llama.cpp's).

hisparse runs through the engine API exactly as ``hisparse run`` drives it on the CPU
(``resolve_config`` of the preset, ``load_engine``; ``prefill`` then one ``decode_step`` per
token, greedy). llama-cpp-python (``pip install -e .[bench]``) runs ``Llama.eval`` over the
prompt (``n_batch`` 512) and then one ``eval`` per greedy token. Load times are excluded.

The engines alternate (hisparse, llama.cpp, hisparse, llama.cpp, ...: ``--rounds``), so
contention from other processes on a shared box hits both; each row records the 1-minute
load average and this process's CPU share (CPU seconds / (wall seconds x threads)). The run
is labelled ``contended`` when a share fell below 0.9 or the load average exceeded the
threads by more than 0.5. The table reports the best round of each engine and the ratios
hisparse / llama.cpp.

Usage::

    python scripts/bench_cpu_llamacpp.py [--threads 2] [--prompt-tokens 8000]
        [--decode-tokens 32] [--rounds 2] [--preset cpu] [--set weight_format=bf16 ...]
        [--variant weight_format=int4,dtype=bfloat16 ...] [--profile-steps 8]
        [--out docs/bench/cpu_llamacpp.json]

``--variant`` adds a hisparse engine with those overrides (on top of ``--set``) to the same
process and rotation, named ``hisparse[overrides]``; every hisparse engine gets its ratios.

``--profile-steps N`` adds, per hisparse engine, the breakdown of N decode steps after the
rounds (same prompt, a fresh prefill): the phases of the eager step (``hisparse bench``'s
instrumented pass: weights, attention, select, append, other, in ms per step; only for an
engine off the CPU direct chain, which runs outside the ops that pass wraps), the LM head
alone (``model.logits`` of one hidden row, timed in a loop), and the PyTorch profiler's
ATen ops of plain steps — calls per step and self CPU ms per step, the top ``--profile-top``
ops and the total — which is where the per-step dispatch overhead shows.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from engine.config import SamplingParams
from engine.events import Job
from engine.load import load_engine
from engine.measure.bench_kv import corpus_dir
from engine.presets import resolve_config
from engine.weights.embedded import default_model_path

CORPUS = corpus_dir()  # $HISPARSE_CORPUS, ../shared/corpus, else examples/


def build_prompt(tokenizer, doc: Path, target: int) -> list[int]:
    """Chat-templated ``Summarize this document`` prompt of at most ``target`` tokens: the
    document's text is cut at a token boundary (binary search on the kept doc tokens)."""
    text = doc.read_text(encoding="utf-8")
    doc_ids = tokenizer.encode(text)

    def prompt(n: int) -> list[int]:
        body = tokenizer.decode(doc_ids[:n])
        return tokenizer.encode_chat(
            [{"role": "user", "content": "Summarize this document:\n\n" + body}]
        )

    lo, hi = 0, len(doc_ids)
    if len(prompt(hi)) <= target:
        return prompt(hi)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(prompt(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return prompt(lo)


class Meter:
    """Wall time, this process's CPU time and the load average around one phase."""

    def __init__(self, threads: int):
        self.threads = threads

    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.w0
        self.cpu = time.process_time() - self.c0
        self.load = os.getloadavg()[0]
        self.share = self.cpu / max(1e-9, self.wall * self.threads)


def parse_sets(items: list[str]) -> dict:
    """``key=value`` strings -> EngineConfig overrides (ints, floats, booleans parsed)."""
    out = {}
    for item in items:
        key, _, raw = item.partition("=")
        value: object = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                pass
        if raw in ("true", "false"):
            value = raw == "true"
        out[key] = value
    return out


class Hisparse:
    name = "hisparse"

    def __init__(
        self,
        preset: str,
        threads: int,
        prompt_len: int,
        n_decode: int,
        sets: dict,
        name: str = "hisparse",
    ):
        self.name = name
        overrides = {"num_threads": threads, "max_batch": 1, "host_pool_gb": 1.0}
        overrides.update(sets)
        self.config = resolve_config(preset, cli_overrides=overrides)
        self.engine = load_engine(self.config)
        self.n_decode = n_decode
        self.label = f"hisparse ({preset}: {self.engine.weight_format} weights, "
        self.label += (
            f"{self.config.attention}"
            + (f" top_k {self.config.top_k}" if self.config.attention == "sparse" else "")
            + ")"
        )

    def run(self, ids: list[int], threads: int) -> dict:
        eng = self.engine
        req = eng.open_request(
            Job("bench", tuple(ids), SamplingParams(max_tokens=self.n_decode + 1))
        )
        with Meter(threads) as pre:
            eng.prefill(req)
        with Meter(threads) as dec:
            for _ in range(self.n_decode):
                req.generated.append(eng.decode_step([req])[0])
        tokens = list(req.generated)
        eng.close_request(req)
        return row(len(ids), self.n_decode, pre, dec, tokens)


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, prompt_len: int, n_decode: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=prompt_len + n_decode + 16,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.n_decode = n_decode
        self.label = f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"

    def run(self, ids: list[int], threads: int) -> dict:
        import numpy as np

        llm = self.llm
        n_vocab = llm.n_vocab()

        def greedy() -> int:  # the last position's logits (Llama.scores holds them only
            # with logits_all=True, which would compute every prompt position's)
            return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

        llm.reset()
        with Meter(threads) as pre:
            llm.eval(ids)
            tok = greedy()
        tokens = [tok]
        with Meter(threads) as dec:
            for _ in range(self.n_decode):
                llm.eval([tok])
                tok = greedy()
                tokens.append(tok)
        return row(len(ids), self.n_decode, pre, dec, tokens)


def profile(h: Hisparse, ids: list[int], steps: int, top: int) -> dict:
    """The decode-step breakdown of ``h``'s engine at the end of ``ids``' prefill (see the
    module docstring): phases, LM head ms, and the ATen ops of ``steps`` plain steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine.measure.bench import _profile_eager

    eng = h.engine
    n_steps = 2 + 2 * steps
    req = eng.open_request(Job("profile", tuple(ids), SamplingParams(max_tokens=n_steps + 2)))
    try:
        eng.prefill(req)
        for _ in range(2):  # warm-up
            req.generated.append(eng.decode_step([req])[0])
        # The instrumented pass wraps each op, so it times the op-by-op route; the
        # engine's own CPU route is the direct chain (engine.decode.cpu_direct), which
        # only the ATen table below sees.
        phases = (
            None if eng.attn.chain_direct else _profile_eager(eng, [req], steps)["breakdown_ms"]
        )
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                req.generated.append(eng.decode_step([req])[0])
            wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        eng.close_request(req)
    ops = [
        (e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps)
        for e in prof.key_averages()
        if e.key.startswith("aten::")
    ]
    ops.sort(key=lambda x: -x[2])
    hidden = torch.randn(1, eng.model.config.hidden_size, dtype=eng.model.dtype)
    with torch.inference_mode():
        for _ in range(3):
            eng.model.logits(hidden)
        t0 = time.perf_counter()
        for _ in range(20):
            eng.model.logits(hidden)
        lm_head_ms = (time.perf_counter() - t0) * 1e3 / 20
    return {
        "steps": steps,
        "phases_ms": {k: round(v, 3) for k, v in phases.items()} if phases else None,
        "chain_direct": eng.attn.chain_direct,
        "lm_head_ms": round(lm_head_ms, 3),
        "profiled_step_ms": round(wall_ms, 3),
        "aten_calls_per_step": round(sum(c for _, c, _ in ops), 1),
        "aten_self_ms_per_step": round(sum(ms for _, _, ms in ops), 3),
        "top_ops": [(k, round(c, 1), round(ms, 3)) for k, c, ms in ops[:top]],
    }


def print_profile(name: str, p: dict) -> None:
    ph = p["phases_ms"]
    print(f"\n{name}: decode step breakdown over {p['steps']} steps (ms per step)")
    if ph:
        print("  phases (eager, instrumented): " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    else:
        print("  phases: none (the CPU direct chain runs outside the ops the pass instruments)")
    print(
        f"  LM head alone: {p['lm_head_ms']:.2f} ms; profiled step {p['profiled_step_ms']:.2f} "
        f"ms: {p['aten_calls_per_step']:.0f} ATen calls, {p['aten_self_ms_per_step']:.2f} ms "
        "of their self time"
    )
    print(f"  {'ATen op':40s} {'calls/step':>10s} {'self ms/step':>13s}")
    for key, calls, ms in p["top_ops"]:
        print(f"  {key:40s} {calls:10.1f} {ms:13.3f}")


def row(n_prompt: int, n_decode: int, pre: Meter, dec: Meter, tokens: list[int]) -> dict:
    return {
        "prefill_tok_s": n_prompt / pre.wall,
        "decode_tok_s": n_decode / dec.wall,
        "prefill_s": pre.wall,
        "decode_s": dec.wall,
        "cpu_share": [round(pre.share, 3), round(dec.share, 3)],
        "loadavg_1m": [round(pre.load, 2), round(dec.load, 2)],
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--doc", type=Path, default=CORPUS / "tutorial-controlflow.txt")
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="cpu")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        help="EngineConfig override for hisparse, key=value (repeatable)",
    )
    ap.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        help="another hisparse engine: comma-separated key=value overrides",
    )
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="decode steps of the per-engine breakdown after the rounds (0: none)",
    )
    ap.add_argument("--profile-top", type=int, default=25, help="ATen ops listed per profile")
    ap.add_argument("--out", type=Path, default=Path("bench_cpu_llamacpp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    ours = Hisparse(
        args.preset, args.threads, args.prompt_tokens, args.decode_tokens, parse_sets(args.sets)
    )
    ids = build_prompt(ours.engine.tokenizer, args.doc, args.prompt_tokens)
    engines = [ours]
    for v in args.variants:
        sets = {**parse_sets(args.sets), **parse_sets(v.split(","))}
        engines.append(
            Hisparse(
                args.preset,
                args.threads,
                args.prompt_tokens,
                args.decode_tokens,
                sets,
                name=f"hisparse[{v}]",
            )
        )
    if not args.skip_llamacpp:
        engines.append(LlamaCpp(default_model_path(), args.threads, len(ids), args.decode_tokens))
    runs: dict[str, list[dict]] = {e.name: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            res = e.run(ids, args.threads)
            runs[e.name].append(res)
            print(
                f"round {r} {e.name}: prefill {res['prefill_tok_s']:.1f} tok/s, decode "
                f"{res['decode_tok_s']:.2f} tok/s, cpu share {res['cpu_share']}, "
                f"load {res['loadavg_1m']}",
                flush=True,
            )
    best = {
        name: {
            "prefill_tok_s": max(x["prefill_tok_s"] for x in rs),
            "decode_tok_s": max(x["decode_tok_s"] for x in rs),
        }
        for name, rs in runs.items()
    }
    shares = [s for rs in runs.values() for x in rs for s in x["cpu_share"]]
    loads = [v for rs in runs.values() for x in rs for v in x["loadavg_1m"]]
    contended = min(shares) < 0.9 or max(loads) > args.threads + 0.5
    label = "contended" if contended else "quiet"
    print(
        f"\n{args.doc.name}: {len(ids)} prompt tokens, {args.decode_tokens} decode tokens, "
        f"{args.threads} threads, best of {args.rounds} rounds, {label} "
        f"(load {min(loads):.1f}-{max(loads):.1f}, cpu share >= {min(shares):.2f})"
    )
    print(f"{'engine':62s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for e in engines:
        b = best[e.name]
        print(f"{e.label:62s} {b['prefill_tok_s']:14.1f} {b['decode_tok_s']:13.2f}")
    ratios = None
    variant_ratios = {}
    if "llama.cpp" in best:
        for e in engines:
            if e.name == "llama.cpp":
                continue
            r = {k: best[e.name][k] / best["llama.cpp"][k] for k in best[e.name]}
            print(
                f"{'ratio ' + e.name + ' / llama.cpp':62s} {r['prefill_tok_s']:14.2f} "
                f"{r['decode_tok_s']:13.2f}"
            )
            a, b = runs[e.name][0]["tokens"], runs["llama.cpp"][0]["tokens"]
            same = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            print(
                f"  {e.name}: greedy tokens identical to llama.cpp's for the first {same} of "
                f"{len(a)}"
            )
            if e.name != "hisparse":
                c = runs["hisparse"][0]["tokens"]
                same = next(
                    (i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y),
                    min(len(a), len(c)),
                )
                print(f"  {e.name}: greedy tokens identical to hisparse's for the first {same}")
            if e.name == "hisparse":
                ratios = r
            else:
                variant_ratios[e.name] = r
    profiles = {}
    if args.profile_steps > 0:
        for e in engines:
            if isinstance(e, Hisparse):
                profiles[e.name] = profile(e, ids, args.profile_steps, args.profile_top)
                print_profile(e.name, profiles[e.name])
    report = {
        "doc": args.doc.name,
        "prompt_tokens": len(ids),
        "decode_tokens": args.decode_tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "preset": args.preset,
        "overrides": parse_sets(args.sets),
        "engines": {e.name: e.label for e in engines},
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "loadavg_before": load_before,
        "contended": contended,
        "best": best,
        "ratios": ratios,
        "variant_ratios": variant_ratios,
        "runs": runs,
        "profiles": profiles,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
