"""What page-locking the host pool costs (issue 16, "start in seconds"); needs CUDA.

Two measurements, each variant in its own process (fresh memory):

* ``register``: ``cudaHostRegister`` of 4 GiB in four 1 GiB calls on memory that is
  fresh (never touched), advised for transparent huge pages, touched (zeroed), populated
  with ``MADV_POPULATE_WRITE``, or both advised and populated; the preparation's seconds
  and the registration's GB/s.
* ``pool``: :class:`engine.kv.host_pool.HostPool` (30 layers x 17,476 pages of
  ``[3, 2, 16, 64]`` bf16: 6 GiB, the embedded SmolLM2 at 16-token pages) grown by
  ``ensure_pinned`` in 8 steps 0.5 s apart (a job's prefill between admissions), with the
  madvise calls (``after``) and without them (``before``: registration faults the pages
  in itself); seconds spent inside ``ensure_pinned``.

Usage: ``python scripts/measure_pinning.py [--out pinning.json]``. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGISTER = ["fresh", "hugepage", "touched", "populate", "hugepage+populate"]
GIB = 1 << 30


def register_variant(name: str) -> dict:
    import torch

    from engine.kv.host_pool import advise_hugepages, populate

    cudart = torch.cuda.cudart()
    torch.cuda.init()
    t = torch.empty(4 * GIB, dtype=torch.uint8)
    t0 = time.perf_counter()
    if "hugepage" in name:
        advise_hugepages(t)
    if name == "touched":
        t.zero_()
    if "populate" in name:
        populate(t.data_ptr(), t.numel())
    prep = time.perf_counter() - t0
    ptr, c = t.data_ptr(), GIB
    t0 = time.perf_counter()
    for i in range(4):
        err = cudart.cudaHostRegister(ptr + i * c, c, 3)
        assert getattr(err, "value", err) == 0, err
    seconds = time.perf_counter() - t0
    for i in range(4):
        cudart.cudaHostUnregister(ptr + i * c)
    return {"variant": name, "prep_s": prep, "register_GBps": 4 * GIB / seconds / 1e9}


def pool_variant(name: str) -> dict:
    import torch

    import engine.kv.host_pool as hp

    if name == "before":
        hp.populate = lambda addr, size: False
        hp.advise_hugepages = lambda t: False
    torch.cuda.init()
    pages = 17476
    pool = hp.HostPool(30, (pages, 3, 2, 16, 64), torch.bfloat16, pin=True)
    spent = []
    for i in range(1, 9):
        time.sleep(0.5)
        t0 = time.perf_counter()
        pool.ensure_pinned(pages * i // 8)
        spent.append(time.perf_counter() - t0)
    return {"variant": name, "pinned_gib": pool.pinned_bytes / GIB, "ensure_s": spent,
            "total_s": sum(spent)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("pinning.json"))
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # kind, variant: child process
    args = ap.parse_args()
    if args.one:
        kind, name = args.one
        print(json.dumps(register_variant(name) if kind == "register" else pool_variant(name)))
        return
    rows = []
    for kind, names in (("register", REGISTER), ("pool", ["before", "after"] * 2)):
        for name in names:
            out = subprocess.run(
                [sys.executable, __file__, "--one", kind, name], cwd=ROOT,
                capture_output=True, text=True, check=True,
            ).stdout.strip().splitlines()[-1]
            rows.append({"kind": kind, **json.loads(out)})
            print(kind, name, {k: v for k, v in rows[-1].items() if k not in ("kind", "variant")})
    import torch

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    doc = {
        "command": " ".join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "thp": thp.read_text().strip() if thp.exists() else None,
        "runs": rows,
    }
    print("| measurement | variant | prep (s) | register (GB/s) | ensure_pinned total (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['variant']} | {r.get('prep_s', 0):.3f} | "
              f"{r.get('register_GBps', 0):.1f} | {r.get('total_s', 0):.3f} |")
    args.out.write_text(json.dumps(doc, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
