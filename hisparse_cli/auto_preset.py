"""``--preset auto``: the built-in preset that matches the CUDA devices of this machine.

:func:`choose_preset` is pure (it takes the devices' memory); the runner and ``hisparse
bench`` feed it from the probes :func:`hisparse_cli.runner.cuda_device_count` and
:func:`hisparse_cli.runner.cuda_device_memory_gib`, which tests replace to fake devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

AUTO = "auto"

LARGE_GIB = 100.0
"""A card this big (in GiB as CUDA reports it; an H200 reads ~139.8) runs the h200 presets."""
CARD_48_GIB = 40.0
"""Two cards of at least this much run ``dual4090`` (48 GB RTX 4090s read ~47.4 GiB)."""
CARD_24_GIB = 20.0
"""Two cards of at least this much run ``dual4090-24`` (stock 24 GB RTX 4090s read ~23.6)."""


@dataclass(frozen=True)
class AutoChoice:
    """The preset ``auto`` stands for here, and why (one line, shown to the user);
    ``read_by``: how the devices were read (``read through NVML in 0.03 s``, empty
    where no probe ran)."""

    name: str
    reason: str
    read_by: str = ""


def choose_preset(memories_gib: Sequence[float], devices_flag: Sequence[str] = ()) -> AutoChoice:
    """The preset for CUDA devices of ``memories_gib`` (one entry per device, GiB).

    No device (or ``devices_flag``, the ``--device``/``--devices`` values, naming only
    ``cpu``) -> ``cpu``. Two or more cards: ``h200x2`` (each >= 100 GiB), ``dual4090``
    (>= 40), ``dual4090-24`` (>= 20); the smallest card decides, and with more than two
    only the first two are used. Otherwise (one card, or two smaller than 20 GiB) the
    single-GPU preset ``h200`` on ``cuda:0``; under 100 GiB its reason says to pass
    ``--memory-budget`` so the pool and batch are sized for the card.
    """
    asked = [d.split(":")[0] for d in devices_flag]
    if asked and all(kind == "cpu" for kind in asked):
        return AutoChoice("cpu", "--device cpu")
    count = len(memories_gib)
    if count == 0:
        return AutoChoice("cpu", "no CUDA device")
    smallest = min(memories_gib)
    cards = f"{count} CUDA device(s), smallest {smallest:.1f} GiB"
    if count >= 2 and len(asked) != 1:
        extra = f"; uses cuda:0 and cuda:1 of {count} (--devices for others)" if count > 2 else ""
        for floor, name in (
            (LARGE_GIB, "h200x2"),
            (CARD_48_GIB, "dual4090"),
            (CARD_24_GIB, "dual4090-24"),
        ):
            if smallest >= floor:
                return AutoChoice(name, cards + extra)
    index = _index(devices_flag[0]) if len(asked) == 1 and asked[0] == "cuda" else 0
    first = memories_gib[min(index, count - 1)]
    if first >= LARGE_GIB:
        return AutoChoice("h200", f"1 CUDA device used, {first:.1f} GiB")
    return AutoChoice(
        "h200",
        f"1 CUDA device used, {first:.1f} GiB: no preset for this card, so h200's settings; "
        f"pass --memory-budget {int(first)} to size the pool and batch for it",
    )


def rules() -> str:
    """:func:`choose_preset`'s rule in one line, from the thresholds above (for ``hisparse
    presets``)."""
    return (
        f"no CUDA device (or --device cpu) -> cpu; two or more cards, the smaller of the "
        f"first two deciding: >= {LARGE_GIB:g} GiB -> h200x2, >= {CARD_48_GIB:g} -> "
        f"dual4090, >= {CARD_24_GIB:g} -> dual4090-24; one card (or --device cuda:N) -> "
        f"h200, with --memory-budget advised under {LARGE_GIB:g} GiB"
    )


def name_auto(message: str) -> str:
    """``engine.presets``' unknown-preset message (``...; known presets: cpu, h200``) with
    ``auto`` among the names, which only the CLI resolves; other messages unchanged."""
    return message.replace(
        "known presets: ", f"known presets: {AUTO} (picks one for this machine), ", 1
    )


def _index(device: str) -> int:
    """N of ``cuda:N`` (0 for ``cuda`` or a malformed index, reported elsewhere)."""
    tail = device.partition(":")[2]
    return int(tail) if tail.isdigit() else 0
