"""Selection traces: what the indexer selected, per (job, decode step, layer, KV head).

A :class:`TraceWriter` is the ``tracer`` of :class:`engine.decode.attention.DecodeAttention`:
the engine calls ``tracer.bind({seq_id: job_id})`` before each decode step and
``tracer(plan, layer, selection)`` in every layer, and :meth:`TraceWriter.close` when
``Engine.run`` ends. :mod:`engine.measure.replay` replays a trace through cache policies.

File format (JSON Lines, UTF-8; gzip-compressed when the name ends in ``.gz``)
-------------------------------------------------------------------------------
Line 1, the header (:class:`TraceHeader`)::

    {"format": "hisparse-trace", "version": 1, "model": "SmolLM2-135M-Instruct.Q4_1",
     "page_size": 16, "top_k": 512, "top_k_pages": 32, "num_layers": 30,
     "num_kv_heads": 3, "sink_pages": 1, "window_pages": 4,
     "device_buffer_pages": 64, "indexer": "quest"}

``top_k`` is in tokens, the other budgets in pages. A pipeline stage's file adds
``"layers": [start, end]``, the model layers it records (absent: every layer). Then one
line per (request, decode step, layer) (:class:`TraceRecord`)::

    {"job": "doc-a", "seq": 0, "step": 7, "layer": 12, "num_pages": 40,
     "words": [[-1, 255], [15, 128], [3, 240]]}

* ``job`` — the job id (``str(seq)`` when the engine did not bind one);
* ``seq`` — the engine's sequence id (unique per engine; a job id run twice gets two);
* ``step`` — the engine's global decode step (monotonic; steps of one request are
  increasing but need not be consecutive when requests join and leave the batch);
* ``num_pages`` — P, pages of the request's context at this step (the new token included);
* ``words`` — per KV head, the selection bitmask trimmed to ``ceil(P / 32)`` words: page
  ``i`` is bit ``i % 32`` of word ``i // 32``; the words are the engine's ``int32``
  values, so bit 31 makes a word negative (``w & 0xFFFFFFFF`` gives the unsigned value).

Lines of one step appear in layer order (in a pipeline stage, per micro-batch); the file
is flushed once per decode step.

Several devices write one file per worker (:func:`engine.serve.workers.worker_config`:
``run.jsonl`` -> ``run.w0.jsonl``, ``run.w1.jsonl``): data-parallel workers each hold
their jobs, pipeline stages each their layers of every job. :func:`read_traces` reads
them together as one trace (``hisparse replay run.w0.jsonl run.w1.jsonl``).
Tracing copies each layer's selection to the host, so it synchronises a GPU: it is an
analysis tool, not for timing runs.
"""

from __future__ import annotations

import atexit
import dataclasses
import gzip
import json
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, cast

import torch

from engine.config import EngineConfig, ModelConfig
from kernels.bitmask import num_words

TRACE_FORMAT = "hisparse-trace"
TRACE_VERSION = 1


@dataclass(frozen=True)
class TraceHeader:
    """First line of a trace: the model and the sparse settings it was recorded with."""

    model: str
    page_size: int
    top_k: int
    top_k_pages: int
    num_layers: int
    num_kv_heads: int
    sink_pages: int = 0
    window_pages: int = 0
    device_buffer_pages: int = 0
    indexer: str = ""
    layers: tuple[int, int] | None = None

    @classmethod
    def for_engine(
        cls,
        model_name: str,
        model: ModelConfig,
        config: EngineConfig,
        layers: tuple[int, int] | None = None,
    ) -> TraceHeader:
        """Header for an engine running ``model`` under ``config``; ``layers`` is the
        ``[start, end)`` of a pipeline stage's layers (``None``: every layer)."""
        return cls(
            model=model_name,
            page_size=config.page_size,
            top_k=config.top_k,
            top_k_pages=config.top_k_pages,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            sink_pages=config.sink_pages,
            window_pages=config.window_pages,
            device_buffer_pages=config.buffer_pages,
            indexer=config.indexer,
            layers=tuple(layers) if layers is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        out = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **asdict(self)}
        if self.layers is None:
            del out["layers"]  # every layer: the version-1 header, unchanged
        else:
            out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class TraceRecord:
    """One (request, decode step, layer): ``words[h]`` is KV head ``h``'s bitmask."""

    job: str
    seq: int
    step: int
    layer: int
    num_pages: int
    words: tuple[tuple[int, ...], ...]

    def pages(self, head: int) -> list[int]:
        """Selected pages of KV head ``head``, ascending."""
        return pages_from_words(self.words[head])


def pages_from_words(words: tuple[int, ...] | list[int]) -> list[int]:
    """Indices of the set bits of a bitmask given as 32-bit words, ascending."""
    out = []
    for i, word in enumerate(words):
        w = word & 0xFFFFFFFF
        while w:
            low = w & -w
            out.append(32 * i + low.bit_length() - 1)
            w ^= low
    return out


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return cast(IO[str], gzip.open(path, mode + "t", encoding="utf-8"))
    return path.open(mode, encoding="utf-8")


class TraceWriter:
    """Records selections to a JSON Lines trace (format in the module docstring).

    Parameters
    ----------
    path : output file (``.gz`` for gzip); replaced on the first record, appended to
        if records arrive after :meth:`close`
    header : :class:`TraceHeader` written as the first line

    The file opens lazily on the first record; :meth:`bind` flushes it once per step,
    :meth:`close` (idempotent; also registered with ``atexit`` while open) closes it.
    """

    def __init__(self, path: str | Path, header: TraceHeader):
        self.path = Path(path)
        self.header = header
        self.num_records = 0
        self._jobs: dict[int, str] = {}
        self._file: IO[str] | None = None
        self._started = False

    def bind(self, jobs: Mapping[int, str]) -> None:
        """Name the sequences of the coming decode step (``{seq_id: job_id}``)."""
        self._jobs = dict(jobs)
        if self._file is not None:
            self._file.flush()

    def __call__(self, plan, layer: int, selection: torch.Tensor) -> None:
        """Record one layer's selection.

        Parameters
        ----------
        plan : :class:`engine.decode.attention.StepPlan` (``seq_ids``, ``num_pages [B]``, ``step``)
        layer : layer index
        selection : int32 ``[B, Hkv, W]`` bitmask
        """
        f = self._open()
        words = selection.cpu()
        num_pages = plan.num_pages.cpu().tolist()
        for b, seq in enumerate(plan.seq_ids):
            n = int(num_pages[b])
            record = {
                "job": self._jobs.get(seq, str(seq)),
                "seq": int(seq),
                "step": int(plan.step),
                "layer": int(layer),
                "num_pages": n,
                "words": words[b, :, : num_words(n)].tolist(),
            }
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
            self.num_records += 1

    def close(self) -> None:
        """Flush and close the file (a later record reopens it in append mode)."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        atexit.unregister(self.close)

    def _open(self) -> IO[str]:
        if self._file is None:
            if not self._started:  # --trace out/sel.jsonl before out/ exists
                self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = _open_text(self.path, "a" if self._started else "w")
            if not self._started:
                self._file.write(json.dumps(self.header.to_json()) + "\n")
                self._started = True
            atexit.register(self.close)
        return self._file


def read_header(path: str | Path) -> TraceHeader:
    """The header of a trace file.

    Raises
    ------
    ValueError
        If the file is empty, unreadable (a cut-off gzip stream), not text (a binary
        file) or not a hisparse trace of a known version; the message names the file.
    """
    with _open_text(Path(path), "r") as f:
        return _read_header_line(f, path)


def _read_header_line(f: IO[str], path: str | Path) -> TraceHeader:
    """The header: the first line of ``f``, the open trace ``path``."""
    try:
        line = f.readline()
    except UnicodeDecodeError:
        raise ValueError(_not_text(path)) from None
    except (EOFError, OSError) as exc:  # gzip: cut off or corrupt
        raise ValueError(f"{path}:1: cannot read: {exc}") from None
    return _parse_header(line, path)


def _not_text(path: str | Path) -> str:
    return f"{path}: not a hisparse selection trace (not UTF-8 text; a binary file?)"


def read_trace(path: str | Path) -> Iterator[TraceRecord]:
    """The records of a trace file, in file order (the header is checked, not yielded).

    Raises
    ------
    ValueError
        Naming ``file:line``: a line that is not valid JSON (such as a last line cut off
        when the run was killed while writing), not a selection record, or a compressed
        file that ends early; naming the file: bytes that are not UTF-8 text.
    """
    with _open_text(Path(path), "r") as f:
        _read_header_line(f, path)
        number = 1
        try:
            for number, line in enumerate(f, start=2):
                if line.strip():
                    yield _parse_record(line, path, number)
        except UnicodeDecodeError:  # decoded ahead in blocks: no line number to give
            raise ValueError(_not_text(path)) from None
        except (EOFError, OSError) as exc:  # gzip: cut off or corrupt
            raise ValueError(f"{path}:{number + 1}: cannot read: {exc}") from None


def _parse_record(line: str, path: str | Path, number: int) -> TraceRecord:
    """One record line -> :class:`TraceRecord`; a ``ValueError`` names ``path:number``."""
    try:
        d = json.loads(line)
        return TraceRecord(
            job=d["job"],
            seq=d["seq"],
            step=d["step"],
            layer=d["layer"],
            num_pages=d["num_pages"],
            words=tuple(tuple(w) for w in d["words"]),
        )
    except json.JSONDecodeError as exc:
        cut = (
            ""
            if line.endswith("\n")
            else "; the line is cut off (was the run killed while writing?)"
        )
        raise ValueError(
            f"{path}:{number}: not valid JSON: {exc.msg} (column {exc.colno}){cut}"
        ) from None
    except KeyError as exc:
        raise ValueError(f"{path}:{number}: not a selection record (no {exc})") from None
    except TypeError:
        raise ValueError(f"{path}:{number}: not a selection record") from None


def _parse_header(line: str, path: str | Path) -> TraceHeader:
    try:
        d = json.loads(line) if line.strip() else {}
    except json.JSONDecodeError:
        d = {}
    if d.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a hisparse selection trace (no header line)")
    if d.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: trace version {d.get('version')} is not {TRACE_VERSION}")
    names = {f.name for f in fields(TraceHeader)}
    values = {k: v for k, v in d.items() if k in names}
    if values.get("layers") is not None:
        values["layers"] = tuple(values["layers"])
    return TraceHeader(**values)


def merge_headers(headers: list[TraceHeader], paths: list[str | Path]) -> TraceHeader:
    """One header for traces recorded together (the workers of one run: data-parallel
    workers hold every layer of their jobs, pipeline stages some layers of every job).

    Every field but ``layers`` must agree; the result's ``layers`` is ``None`` (every
    layer) when any file holds every layer or the files' layers cover the model,
    otherwise the ``(lowest, highest + 1)`` the files hold.

    Raises
    ------
    ValueError
        Two headers differ in another field (the message names it and the files), or
        no header is given.
    """
    if not headers:
        raise ValueError("no trace given")
    first = headers[0]
    for h, path in zip(headers[1:], paths[1:], strict=True):
        for f in fields(TraceHeader):
            if f.name != "layers" and getattr(h, f.name) != getattr(first, f.name):
                raise ValueError(
                    f"{path}: {f.name}={getattr(h, f.name)!r} but {paths[0]} has "
                    f"{getattr(first, f.name)!r}; replay traces of one run together"
                )
    spans = [h.layers for h in headers]
    if any(s is None for s in spans):
        return dataclasses.replace(first, layers=None)
    held = {i for a, b in spans for i in range(a, b)}
    if held == set(range(first.num_layers)):
        return dataclasses.replace(first, layers=None)
    return dataclasses.replace(first, layers=(min(held), max(held) + 1))


def read_traces(paths: list[str | Path]) -> tuple[TraceHeader, Iterator[TraceRecord]]:
    """Several trace files of one run as one: the merged header (:func:`merge_headers`)
    and the records of every file, file by file.

    Raises
    ------
    ValueError
        A file is not a trace, the headers disagree, or a file is given twice.
    """
    resolved = [Path(p).resolve() for p in paths]
    if len(set(resolved)) != len(resolved):
        raise ValueError("a trace file is given twice (its selections would count twice)")
    header = merge_headers([read_header(p) for p in paths], list(paths))

    def records() -> Iterator[TraceRecord]:
        for p in paths:
            yield from read_trace(p)

    return header, records()
