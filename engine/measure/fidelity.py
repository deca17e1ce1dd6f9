"""``hisparse eval``: the :mod:`engine.measure.ruler` suite run under dense attention and
every sparse configuration asked for, on the same prompts, and scored.

How it runs (all through :class:`engine.serve.engine.Engine` over ONE placed model):

1. **Prefill once.** Each prompt is prefilled by a dense, all-resident engine
   (:meth:`Engine.prefill`); its per-layer K/V ``[T, Hkv, D]`` and first token are kept.
   Prefill attention runs on the prompt's own K/V and does not depend on the page size or
   the sparse settings, so every configuration continues from the same state (as
   ``scripts/measure_sparse_quality.py`` and the bench's master KV do).
2. **Decode each configuration as a batch.** Each configuration has its own engine and KV
   cache (its page size, hierarchy and hot buffer); up to ``max_batch`` prompts are loaded
   into it (:meth:`KVCache.write_prefill`: records and page metadata) and decoded
   greedily together with :meth:`Engine.decode_step` (on CUDA a graph replay), until each
   stops at an end-of-turn token or its ``max_tokens``.
3. **Score.** :func:`engine.measure.ruler.score` per answer; a cell's accuracy (task x
   length x configuration) is the mean over its samples, in percent.

Configurations (:func:`parse_configs`): ``dense``; ``sparse`` (the base settings); or
``key=value`` pairs joined by ``:`` on top of the base sparse settings, keys
:data:`CONFIG_KEYS` (``top_k=2048:page=16``, ``top_k=512:combine=sum``, ``indexer=oracle``,
``host=fp8``).
"""

from __future__ import annotations

import datetime
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ConfigError, EngineConfig, SamplingParams
from engine.measure.ruler import Sample, score

if TYPE_CHECKING:
    import torch

    from engine.load import PlacedModel
    from engine.serve.engine import Engine, Request

CONFIG_KEYS: dict[str, tuple[str, type]] = {
    "top_k": ("top_k", int),
    "page": ("page_size", int),
    "page_size": ("page_size", int),
    "indexer": ("indexer", str),
    "combine": ("group_combine", str),
    "sink": ("sink_tokens", int),
    "window": ("local_window", int),
    "buffer": ("device_buffer", int),
    "hierarchical": ("hierarchical", bool),
    "host": ("kv_host_dtype", str),  # host-pool records: bf16 or fp8
    "meta": ("page_metadata", str),
    "superpage": ("superpage_pages", int),
    "oversample": ("superpage_oversample", float),
}
"""Keys of a sparse configuration spec -> (``EngineConfig`` field, type)."""

REPORT_FILE = "eval.json"


@dataclass(frozen=True)
class EvalConfig:
    """One decode configuration of an eval: its ``name`` (the spec as given) and the
    ``EngineConfig`` changes it makes to the base settings."""

    name: str
    changes: tuple[tuple[str, Any], ...]

    @property
    def dense(self) -> bool:
        return dict(self.changes).get("attention") == "dense"

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """``base`` with this configuration's changes, validated.

        Raises
        ------
        ConfigError
            Naming the configuration and the bad setting.
        """
        try:
            cfg = base.replace(**dict(self.changes))
            cfg.validate()
        except ConfigError as e:
            raise ConfigError(f"config {self.name!r}: {e}") from None
        return cfg


def parse_configs(text: str) -> list[EvalConfig]:
    """``"dense,sparse,top_k=512:page=32"`` -> the configurations, in order.

    ``dense``: dense attention, KV all resident. ``sparse``: the base sparse settings. A
    ``key=value[:key=value]`` spec: sparse with :data:`CONFIG_KEYS` changes; a ``top_k``
    without ``buffer`` sets ``device_buffer`` to its default (2 x top_k).

    Raises
    ------
    ValueError
        An empty list, a repeated name, an unknown key, or a value of the wrong type.
    """
    out: list[EvalConfig] = []
    errors: list[str] = []  # every bad spec at once
    for spec in (s.strip() for s in text.split(",")):
        if not spec:
            continue
        if spec == "dense":
            changes: dict[str, Any] = {"attention": "dense", "hierarchical": False}
        elif spec == "sparse":
            changes = {"attention": "sparse"}
        else:
            try:
                changes = {"attention": "sparse", **_spec_changes(spec)}
            except ValueError as exc:
                errors.append(str(exc))
                continue
        if any(c.name == spec for c in out):
            errors.append(f"config {spec!r} given twice")
            continue
        out.append(EvalConfig(spec, tuple(changes.items())))
    if errors:
        raise ValueError("\n--configs: ".join(errors))
    if not out:
        raise ValueError("no configurations given (e.g. --configs dense,sparse)")
    return out


TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _spec_changes(spec: str) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for item in spec.split(":"):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in CONFIG_KEYS:
            raise ValueError(
                f"config {spec!r}: {item!r} is not key=value with a key among "
                f"{', '.join(CONFIG_KEYS)} (or the names dense, sparse)"
            )
        name, kind = CONFIG_KEYS[key]
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                changes[name] = value.lower() in ("true", "1")
            else:
                changes[name] = kind(value)
        except ValueError:
            raise ValueError(
                f"config {spec!r}: {key}={value!r} is not {TYPE_NAMES[kind]}"
            ) from None
    superpage_only = [k for k in ("superpage", "oversample") if k in _keys_of(spec)]
    if superpage_only and changes.get("page_metadata") != "superpage":
        raise ValueError(
            f"config {spec!r}: {' and '.join(superpage_only)} "
            f"{'work' if len(superpage_only) > 1 else 'works'} only with meta=superpage "
            "(add it to this config)"
        )
    if "top_k" in changes and "device_buffer" not in changes:
        changes["device_buffer"] = None  # 2 x top_k (EngineConfig's default)
    return changes


def _keys_of(spec: str) -> list[str]:
    return [item.partition("=")[0].strip() for item in spec.split(":")]


# ----------------------------------------------------------------------------- running


@dataclass
class Prefilled:
    """A prompt after prefill: the first token and per-layer K/V ``[T, Hkv, D]``."""

    first_token: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class EvalRunner:
    """Engines over one placed model: a dense one that prefills, one per configuration
    that decodes (see the module notes).

    Parameters
    ----------
    placed : the model (:func:`engine.load.place_model`)
    base : resolved settings; each configuration's changes apply on top
    configs : the configurations
    max_length : longest sample length (tokens); sizes every cache
    max_batch : prompts decoded together (default ``base.max_batch``)
    """

    def __init__(
        self,
        placed: PlacedModel,
        base: EngineConfig,
        configs: Sequence[EvalConfig],
        max_length: int,
        max_batch: int | None = None,
    ):
        from engine.kv.cache import KVCache
        from engine.serve.engine import Engine

        self.placed, self.base = placed, base
        self.batch = max_batch or base.max_batch
        self.max_length = max_length
        m = placed.model
        mk = self._engine
        pre = base.replace(
            attention="dense", hierarchical=False, max_batch=1, memory_budget_gb=None
        )
        self.prefiller = mk(pre, 1, KVCache, Engine)
        self.engines = {
            c.name: mk(
                c.engine_config(base).replace(max_batch=self.batch), self.batch, KVCache, Engine
            )
            for c in configs
        }
        self.end_ids = frozenset(getattr(placed.tokenizer, "eos_ids", ()) or ())
        self.device = m.device

    def _engine(self, cfg: EngineConfig, jobs: int, cache_cls, engine_cls) -> Engine:
        m = self.placed.model
        pages = -(-self.max_length // cfg.page_size)
        cache = cache_cls(m.config, cfg, m.device, pages, num_pool_pages=jobs * pages)
        p = self.placed
        return engine_cls(
            m, p.tokenizer, cfg, p.ops, self.max_length, cache=cache, model_name=p.name
        )

    def prefill(self, sample: Sample) -> Prefilled:
        """Prefill ``sample`` once; keep its K/V and first (greedy) token."""
        import torch

        from engine.events import Job

        eng = self.prefiller
        job = Job(sample.id, sample.prompt_ids, SamplingParams(max_tokens=sample.max_tokens))
        req = eng.open_request(job)
        try:
            first = eng.prefill(req)
            cache = eng.cache
            cache.synchronize()
            t = len(sample.prompt_ids)
            n = cache.pages_for(t)
            pages = torch.tensor(cache.seqs[req.seq_id].pages[:n], dtype=torch.long)
            keys, values = [], []
            for pool in cache.pool:
                rec = pool[pages.to(pool.device)]  # [n, Hkv, 2, S, D]
                _, hkv, _, s, d = rec.shape
                kv = rec.permute(2, 0, 3, 1, 4).reshape(2, n * s, hkv, d)[:, :t]
                keys.append(kv[0].to(self.device).clone())
                values.append(kv[1].to(self.device).clone())
            return Prefilled(first, keys, values)
        finally:
            eng.close_request(req)

    def decode(self, name: str, samples: Sequence[Sample], pre: Sequence[Prefilled]) -> list[str]:
        """Decode ``samples`` (at most ``max_batch``) together under configuration
        ``name``, from their prefills; returns each answer's text (end-of-turn dropped)."""
        from engine.events import Job

        eng = self.engines[name]
        reqs: list[Request] = []
        try:
            for s, p in zip(samples, pre, strict=True):
                job = Job(f"{name}:{s.id}", s.prompt_ids, SamplingParams(max_tokens=s.max_tokens))
                req = eng.open_request(job)
                reqs.append(req)
                for layer, (k, v) in enumerate(zip(p.keys, p.values, strict=True)):
                    eng.cache.write_prefill(req.seq_id, layer, k, v, 0)
                eng.cache.seqs[req.seq_id].num_tokens = len(s.prompt_ids)
                req.phase, req.generated, req.t_first = "decode", [p.first_token], time.monotonic()
            active = [r for r in reqs if not self._done(r)]
            while active:
                for r, tok in zip(active, eng.decode_step(active), strict=True):
                    r.generated.append(tok)
                active = [r for r in active if not self._done(r)]
            tok = self.placed.tokenizer
            return [tok.decode([t for t in r.generated if t not in self.end_ids]) for r in reqs]
        finally:
            for r in reqs:
                eng.close_request(r)

    def _done(self, req: Request) -> bool:
        return (
            req.generated[-1] in self.end_ids or len(req.generated) >= req.job.sampling.max_tokens
        )

    def close(self) -> None:
        """Free every engine's cache."""
        for eng in (self.prefiller, *self.engines.values()):
            eng.close()


def run_eval(
    placed: PlacedModel,
    base: EngineConfig,
    configs: Sequence[EvalConfig],
    samples: Sequence[Sample],
    max_batch: int | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run ``samples`` under every configuration; returns the report (see
    :func:`accuracy_table` for its ``table``).

    Samples are taken ``max_batch`` at a time (in order): each group is prefilled once,
    then decoded as one batch per configuration, so at most ``max_batch`` prefills are held.

    Raises
    ------
    ValueError
        A sample longer than the model's context limit (check with :func:`too_long` first).
    """
    over = too_long(samples, placed.context_limit)
    if over:
        raise ValueError(f"samples over the context limit of {placed.context_limit}: {over[0]}")
    runner = EvalRunner(placed, base, configs, max(s.length for s in samples), max_batch)
    rows: list[dict[str, Any]] = []
    prefill_s, decode_s = 0.0, {c.name: 0.0 for c in configs}
    try:
        b = runner.batch
        for start in range(0, len(samples), b):
            group = list(samples[start : start + b])
            t0 = time.monotonic()
            pre = [runner.prefill(s) for s in group]
            prefill_s += time.monotonic() - t0
            answers: dict[str, list[str]] = {}
            for c in configs:
                t0 = time.monotonic()
                answers[c.name] = runner.decode(c.name, group, pre)
                decode_s[c.name] += time.monotonic() - t0
            del pre
            for i, s in enumerate(group):
                rows.append(_row(s, {n: a[i] for n, a in answers.items()}))
            log(_progress(rows[-len(group) :], start + len(group), len(samples)))
    finally:
        runner.close()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "device": str(placed.model.device),
        "model": placed.name,
        "context_limit": placed.context_limit,
        "context_policy": base.context_policy,
        "configs": [
            {"name": c.name, "settings": _settings(c.engine_config(base))} for c in configs
        ],
        "max_batch": runner.batch,
        "prefill_s": round(prefill_s, 2),
        "decode_s": {k: round(v, 2) for k, v in decode_s.items()},
        "samples": rows,
        "table": accuracy_table(rows, [c.name for c in configs]),
    }


def too_long(samples: Sequence[Sample], limit: int) -> list[str]:
    """Messages for the samples whose length is over ``limit`` tokens (one per length)."""
    lengths = sorted({s.length for s in samples if s.length > limit})
    return [
        f"length {n} is over the model's context limit of {limit} tokens (use "
        f"--context-policy extend --max-context {max(lengths)} to extend RoPE)"
        for n in lengths
    ]


def _row(s: Sample, answers: dict[str, str]) -> dict[str, Any]:
    return {
        "id": s.id,
        "task": s.task,
        "length": s.length,
        "depth": s.depth,
        "needle_depths": list(s.needle_depths),
        "prompt_tokens": len(s.prompt_ids),
        "expected": list(s.expected),
        "answers": {n: {"text": a, "score": score(s.expected, a)} for n, a in answers.items()},
    }


def _progress(rows: list[dict[str, Any]], done: int, total: int) -> str:
    names = list(rows[0]["answers"])
    mean = {n: sum(r["answers"][n]["score"] for r in rows) / len(rows) for n in names}
    cells = ", ".join(f"{n} {100 * v:.0f}%" for n, v in mean.items())
    return f"{done}/{total} samples; this batch: {cells}"


def _settings(cfg: EngineConfig) -> dict[str, Any]:
    keys = ("attention", "hierarchical", "indexer", "group_combine", "page_size", "top_k")
    out = {k: getattr(cfg, k) for k in keys}
    out |= {
        "device_buffer": cfg.device_buffer_tokens,
        "sink_tokens": cfg.sink_tokens,
        "local_window": cfg.local_window,
        "kv_host_dtype": cfg.kv_host_dtype,
        "page_metadata": cfg.page_metadata,
    }
    if cfg.page_metadata == "superpage":
        out |= {
            "superpage_pages": cfg.superpage_pages,
            "superpage_oversample": cfg.superpage_oversample,
        }
    return out


def accuracy_table(rows: Sequence[dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    """Accuracy per (task, length, configuration): mean score x 100 over the samples,
    with the dense configuration's beside it (``dense``: ``None`` without one) and the
    number of samples; in order of first appearance."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["task"], r["length"]), []).append(r)
    dense = next((c for c in configs if c == "dense"), None)
    out = []
    for (task, length), rs in cells.items():
        acc = {c: 100 * sum(r["answers"][c]["score"] for r in rs) / len(rs) for c in configs}
        for c in configs:
            out.append(
                {
                    "task": task,
                    "length": length,
                    "config": c,
                    "accuracy": round(acc[c], 2),
                    "dense": round(acc[dense], 2) if dense else None,
                    "samples": len(rs),
                }
            )
    return out
