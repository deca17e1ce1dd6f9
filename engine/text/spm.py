"""Sentencepiece-style vocabularies of GGUF files (``tokenizer.ggml.model = llama``) as a
``tokenizers`` BPE with byte fallback.

Source format: GGUF ``tokenizer.ggml.{tokens, scores, token_type, merges,
add_space_prefix}`` as llama.cpp's ``convert_hf_to_gguf.py`` writes them for sentencepiece
models (Llama 2, Mistral v0.1-v0.3, TinyLlama ...): tokens spelled with ``▁`` (U+2581) for
a space, the 256 byte tokens ``<0x00>`` .. ``<0xFF>`` typed byte (6), a score per token,
usually no merges.

The tokenizer reproduces transformers' GGUF conversion
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py`` ``sentencepiece_tokenizer``
-> ``LlamaTokenizer``), which the tests compare against token for token: BPE over the
vocabulary with ``byte_fallback`` (characters without a token become their UTF-8 byte
tokens) and ``fuse_unk``; merges from the file, else derived from the scores
(:func:`merges_from_scores`); ``Metaspace`` (``▁``, prefix only on the first section of
the text, no split) when ``add_space_prefix`` is true (the default), none otherwise;
decoder ``▁`` -> space, byte fallback, fuse and strip the one prefix space.

``merges_from_scores`` is written here rather than imported: the ``tokenizers`` library
builds BPE models from merges but has no scores-to-merges conversion (transformers'
``generate_merges`` does it; transformers is not a runtime dependency of the engine).
llama.cpp tokenizes such vocabularies with its own score-driven bigram merge
(``llm_tokenizer_spm``); this matches transformers, not llama.cpp, which was not run here
(llama.cpp also prefixes a space after each special token).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

SPACE = "\u2581"


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary.

    Every split ``(left, right)`` of a token into two vocabulary tokens is a merge, ranked by
    the merged token's score (highest first), then by the lengths of ``left`` and
    ``right`` (longer first), then by the ids of ``left`` and ``right`` (lower first) — the
    order of transformers' ``generate_merges`` with ``vocab_scores``.

    Parameters
    ----------
    tokens : the vocabulary, index = id
    scores : float score per token (sentencepiece log-probabilities)

    Returns
    -------
    list of (left, right) pairs, best first
    """
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    score_of: dict[str, float] = {}
    for t, s in zip(tokens, scores, strict=True):
        score_of[t] = float(s)  # a repeated token keeps its last score, as a dict would
    merges = []
    for token, score in score_of.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    # Stable sort, descending on (score, len(left), len(right)) as generate_merges does.
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float] | None,
    merges: Sequence[str] | None,
    add_space_prefix: bool = True,
) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of a GGUF sentencepiece vocabulary (no added tokens;
    the caller adds control / user-defined tokens).

    Parameters
    ----------
    tokens : ``tokenizer.ggml.tokens``
    scores : ``tokenizer.ggml.scores`` (needed when ``merges`` is empty)
    merges : ``tokenizer.ggml.merges`` (``"left right"`` strings) or None
    add_space_prefix : ``tokenizer.ggml.add_space_prefix`` (default true)

    Raises
    ------
    ValueError
        Neither merges nor scores, or scores of another length than tokens.
    """
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        if scores is None or len(scores) != len(tokens):
            raise ValueError(
                "tokenizer.ggml.scores is missing or not one per token "
                f"({None if scores is None else len(scores)} for {len(tokens)} tokens) and "
                "there are no tokenizer.ggml.merges: the merges cannot be derived"
            )
        pairs = merges_from_scores(tokens, scores)
    backend = Tokenizer(
        BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    backend.normalizer = None
    scheme = "first" if add_space_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPACE, prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend
