"""Text files of a fixed token length from the corpus, for `hisparse run` beside `hisparse bench`.

Concatenates the corpus documents (``$HISPARSE_CORPUS``, sorted), tokenizes them with the
embedded model's tokenizer, and writes ``--count`` files of ``--tokens`` tokens each,
windows starting ``--stride`` tokens apart (the token stream cycled), decoded back to text.
Used for "`hisparse run` vs the bench" in docs/performance.md (8 files of 31,000 tokens).

Usage: ``python scripts/make_long_docs.py OUT_DIR [--count 8] [--tokens 31000] [--stride 17000]``
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf

from engine.text.tokenizer import TextTokenizer
from engine.weights.embedded import default_model_path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=31000)
    ap.add_argument("--stride", type=int, default=17000)
    args = ap.parse_args()
    corpus = Path(os.environ.get("HISPARSE_CORPUS", ROOT.parent / "shared" / "corpus"))
    docs = sorted(corpus.glob("*.txt"))
    if not docs:
        raise SystemExit(f"no *.txt in {corpus} (set HISPARSE_CORPUS)")
    tok = TextTokenizer.from_gguf(gguf.GGUFReader(str(default_model_path())))
    ids = tok.encode("\n\n".join(p.read_text(encoding="utf-8") for p in docs))
    stream = ids * (1 + (args.count * args.stride + args.tokens) // max(1, len(ids)))
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        start = (i * args.stride) % max(1, len(ids))
        (args.out / f"doc{i}.txt").write_text(tok.decode(stream[start : start + args.tokens]))
    print(f"wrote {args.count} files of {args.tokens} tokens to {args.out}")


if __name__ == "__main__":
    main()
