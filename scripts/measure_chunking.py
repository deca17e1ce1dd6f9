"""Peak memory and wall time of a huge document under ``--context-policy chunk`` (or
``truncate``), with the embedded model's tokenizer and no model.

Steps (``--step``):

* ``chunk``: :func:`engine.text.context.chunk_document` alone (``--read``: then every
  chunk's text is read and its prompt tokenised, one at a time, as the runner builds map
  jobs); ``truncate``: :func:`engine.text.context.fit_prompt` under ``truncate``.
* ``run``: ``hisparse run --context-policy chunk`` in this process on the document, with
  an engine that answers each job as soon as it is drawn (the test suite's fake engine,
  given the real tokenizer and context limit, drawing one job at a time as the real
  engine does): the runner's whole path, map jobs and reduce included, without a model.

The document is a synthetic log (``--mb`` MiB of lines with timestamps, levels, services
and numbers; seeded), written to ``--doc`` (default ``/tmp/hisparse-log-<mb>.txt``) once
and reused. The peak is the process's resident peak (``VmHWM``) over the step alone: it
is reset (``/proc/self/clear_refs``) once the document is in memory, and the resident
size then is given too. One JSON line on stdout.

Usage::

    python scripts/measure_chunking.py --mb 100 [--step chunk|truncate|run|write] [--read]
        [--limit 8192] [--max-new-tokens 8] [--separator-lines K]

Run it against another tree with ``PYTHONPATH=<tree>`` (the tree's ``engine`` and
``hisparse_cli`` are imported first).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

LEVELS = ("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR")
SERVICES = ("api", "worker", "scheduler", "db-proxy", "auth", "cache")
MESSAGES = (
    "request {a} served GET /api/v1/items/{b} in {c}.{d} ms status=200",
    "job {a} started on node-{b} with {c} shards",
    "cache miss for key user:{a}:profile (ttl {b}s)",
    "retrying connection to 10.0.{b}.{c}:5432 after {d} ms (attempt {e})",
    "user {a} logged in from 192.168.{b}.{c}",
    "flushed {a} records to segment {b} ({c} bytes)",
    'payload {{"id": {a}, "items": [{b}, {c}, {d}], "ok": true}}',
    "timeout waiting for lock /tmp/locks/{a}.lock after {b} s",
)


def make_log(path: Path, mib: int, seed: int = 0, separators: int = 0) -> None:
    """Write ``mib`` MiB of synthetic log lines to ``path`` (1 MiB at a time), each
    followed by ``separators`` lines of 79 ``-`` (a log of few tokens a character: about
    27 characters a token with 99 of them)."""
    rng = random.Random(seed)
    target, written, t = mib << 20, 0, 1_764_806_400
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            lines = []
            size = 0
            while size < 1 << 20:
                t += rng.randrange(0, 3)
                n = [rng.randrange(1, 100_000) for _ in range(5)]
                msg = rng.choice(MESSAGES).format(
                    a=n[0], b=n[1] % 256, c=n[2], d=n[3] % 1000, e=n[4] % 9
                )
                line = (
                    f"2026-12-{1 + t // 86400 % 28:02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:"
                    f"{t % 60:02d}.{n[4] % 1000:03d}Z {rng.choice(LEVELS):5} "
                    f"{rng.choice(SERVICES)}[{n[0] % 4000}]: {msg}\n"
                ) + ("-" * 79 + "\n") * separators
                lines.append(line)
                size += len(line)
            block = "".join(lines)[: target - written]
            f.write(block)
            written += len(block)


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak() -> None:
    """Reset the resident peak (``VmHWM``) to the current resident size."""
    Path("/proc/self/clear_refs").write_text("5")


def load_tokenizer():
    import gguf

    from engine.text.tokenizer import TextTokenizer
    from engine.weights.embedded import default_model_path

    return TextTokenizer.from_gguf(gguf.GGUFReader(str(default_model_path())))


def step_chunk(tok, document: str, limit: int, max_tokens: int, read: bool) -> dict:
    from engine.text.context import chunk_document
    from hisparse_cli.tasks import TaskSpec, build_messages

    def messages_of(text: str) -> list[dict]:
        return build_messages(TaskSpec("summarize"), text, "log", "log.txt")

    chunks = chunk_document(tok, messages_of, document, limit, max_tokens)
    out = {"chunks": len(chunks), "result": type(chunks).__name__}
    if read:
        out["map_prompt_tokens"] = sum(len(tok.encode_chat(messages_of(c))) for c in chunks)
    return out


def step_truncate(tok, document: str, limit: int, max_tokens: int) -> dict:
    from engine.config import EngineConfig
    from engine.text.context import fit_prompt
    from hisparse_cli.tasks import TaskSpec, build_messages

    def messages_of(text: str) -> list[dict]:
        return build_messages(TaskSpec("summarize"), text, "log", "log.txt")

    config = EngineConfig(context_policy="truncate", truncate_keep="head")
    ids, cut = fit_prompt(tok, messages_of, document, limit, max_tokens, config)
    return {"prompt_tokens": len(ids), "kept_tokens": cut.kept_tokens if cut else None}


def step_run(tok, doc: Path, limit: int, max_tokens: int) -> dict:
    """``hisparse run`` on ``doc`` with an engine that answers at once (see the module
    docstring); the CLI test fixture's stand-ins for what a fake engine lacks."""
    import tempfile

    from typer.testing import CliRunner

    from hisparse_cli import runner, settings, testing
    from hisparse_cli.main import app

    class OneAtATime(testing.FakeEngine):
        """Draws one job, answers it, then draws the next (keeps none)."""

        def run(self, jobs):
            for job in jobs:
                if job is not None:
                    yield from testing.FakeEngine.run(self, [job])
                    self.seen.clear()

    engines = []

    def load(config, model, job_tokens=None):
        engines.append(OneAtATime(config=config, tokenizer=tok, limit=limit))
        return engines[-1]

    settings.preset_overrides = lambda name: {}
    runner.cuda_device_count = lambda: 0
    runner.warm_cuda = lambda config, marks: None
    runner.import_engine_modules = lambda: None
    runner.free_cpu_threads = lambda config: None
    runner.load_engine = load
    with tempfile.TemporaryDirectory() as out:
        args = ["run", str(doc), "--context-policy", "chunk", "--max-new-tokens", str(max_tokens)]
        result = CliRunner().invoke(app, [*args, "--output-dir", out])
        lines = (Path(out) / "results.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    return {
        "exit_code": result.exit_code,
        "ok": record.get("ok"),
        "chunked": {k: record.get("chunked", {}).get(k) for k in ("chunks", "levels")},
        "prompt_tokens": record.get("prompt_tokens"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, required=True, help="MiB of synthetic log")
    ap.add_argument("--doc", type=Path, help="where the log is written (and reused)")
    ap.add_argument(
        "--step",
        choices=("chunk", "truncate", "run", "write"),
        default="chunk",
        help="write: only write the log (for a real `hisparse run` on it) and print its path",
    )
    ap.add_argument(
        "--separator-lines", type=int, default=0, help="lines of 79 '-' after each log line"
    )
    ap.add_argument("--read", action="store_true", help="chunk: read every chunk's prompt")
    ap.add_argument("--limit", type=int, default=8192, help="context limit (tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    args = ap.parse_args()
    sep = f"-sep{args.separator_lines}" if args.separator_lines else ""
    doc = args.doc or Path(f"/tmp/hisparse-log-{args.mb}{sep}.txt")
    if not doc.exists() or doc.stat().st_size != args.mb << 20:
        make_log(doc, args.mb, separators=args.separator_lines)
    if args.step == "write":
        print(doc)
        return
    import engine

    tok = load_tokenizer()
    document = doc.read_text(encoding="utf-8") if args.step != "run" else ""
    rss_before = status_kib("VmRSS")
    reset_peak()
    t0 = time.monotonic()
    if args.step == "chunk":
        out = step_chunk(tok, document, args.limit, args.max_new_tokens, args.read)
    elif args.step == "truncate":
        out = step_truncate(tok, document, args.limit, args.max_new_tokens)
    else:
        out = step_run(tok, doc, args.limit, args.max_new_tokens)
    wall = time.monotonic() - t0
    print(
        json.dumps(
            {
                "tree": str(Path(engine.__file__).resolve().parents[1]),
                "step": args.step + (" --read" if args.read else ""),
                "mib": args.mb,
                "chars": len(document) or None,
                "limit": args.limit,
                "max_new_tokens": args.max_new_tokens,
                **out,
                "wall_s": round(wall, 1),
                "rss_before_gib": round(rss_before / 2**20, 2),
                "peak_rss_gib": round(status_kib("VmHWM") / 2**20, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
