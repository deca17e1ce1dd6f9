"""The bytes each token id stands for: what a byte-level constraint on generated text
(:mod:`engine.decode.json_constraint`) needs to know about a vocabulary.

Two spellings are read, the two that :class:`engine.text.tokenizer.TextTokenizer` builds:

* byte-level BPE (GPT-2 / Llama 3 / Qwen2 / SmolLM2 ``tokenizer.json`` and GGUF ``gpt2``):
  each character of a token is one byte through GPT-2's ``bytes_to_unicode`` table;
* sentencepiece with byte fallback (GGUF ``llama``, Llama 2 / Mistral ``tokenizer.json``):
  ``<0xXX>`` is the byte ``XX``, other tokens are UTF-8 text with ``▁`` (U+2581) for a
  space.

Added tokens (special or user-defined: ``<|im_start|>``, ``<|im_end|>``, tool tags ...) have
no bytes here (``None``): a constraint never lets them through, so document text and
generated data cannot turn into control tokens. Ids the tokenizer does not define (rows of
a padded embedding) are ``None`` too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.text.spm import SPACE
from engine.text.tokenizer import bytes_to_unicode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """Bytes of every id in ``[0, vocab_size)``.

    Parameters
    ----------
    tokenizer
        A :class:`~engine.text.tokenizer.TextTokenizer` (or one of its subclasses, such
        as the synthetic models' tokenizer that maps ids ``id % text_vocab_size``).
    vocab_size
        ``V``, the rows of the model's logits (may exceed the tokenizer's size).

    Returns
    -------
    list of (bytes or None), length ``V``
        ``None`` for added (special or user-defined) tokens and undefined ids.

    Raises
    ------
    ValueError
        The tokenizer has no ``tokenizers`` backend, or its decoder is neither byte-level
        nor sentencepiece-with-byte-fallback (the bytes of its tokens are not known).
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} has no vocabulary of text")
    kinds = _decoder_kinds(json.loads(backend.to_str()).get("decoder"))
    if "ByteLevel" in kinds:
        spell = _byte_level_speller()
    elif "ByteFallback" in kinds or "Metaspace" in kinds:
        spell = _sentencepiece_bytes
    else:
        raise ValueError(
            f"the tokenizer's decoder ({', '.join(sorted(kinds)) or 'none'}) is neither "
            "byte-level nor sentencepiece with byte fallback: token bytes are unknown"
        )
    by_id: dict[int, str] = {i: t for t, i in backend.get_vocab(with_added_tokens=False).items()}
    for i in backend.get_added_tokens_decoder():
        by_id.pop(int(i), None)
    text_size = getattr(tokenizer, "text_vocab_size", None)  # synthetic: id % text size
    out: list[bytes | None] = []
    for i in range(vocab_size):
        token = by_id.get(i % text_size if text_size else i)
        out.append(None if token is None else spell(token))
    return out


def _decoder_kinds(spec: dict | None) -> set[str]:
    """Types of a serialised ``tokenizers`` decoder, through ``Sequence`` steps."""
    if not spec:
        return set()
    kinds = {spec.get("type", "")}
    for step in spec.get("decoders") or ():
        kinds |= _decoder_kinds(step)
    return kinds


def _byte_level_speller():
    table = {ch: b for b, ch in bytes_to_unicode().items()}

    def spell(token: str) -> bytes | None:
        try:
            return bytes(table[ch] for ch in token)
        except KeyError:  # a character outside the byte alphabet: not a byte-level token
            return None

    return spell


def _sentencepiece_bytes(token: str) -> bytes | None:
    match = _BYTE_TOKEN.fullmatch(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(SPACE, " ").encode("utf-8")
