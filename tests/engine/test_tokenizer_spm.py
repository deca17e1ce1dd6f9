"""Sentencepiece GGUF vocabularies (``tokenizer.ggml.model = llama``) against transformers.

No sentencepiece model ships with the test environment, so one is trained here on the
corpus with ``tokenizers``' ``SentencePieceBPETokenizer`` and laid out as llama.cpp writes
Llama 2's vocabulary: ``<unk>`` (type 2), ``<s>``, ``</s>`` (control, 3), the 256 byte
tokens ``<0x00>``..``<0xFF>`` (byte, 6), then the pieces (normal, 1) with score minus their
rank; no merges, so both sides derive them from the scores. transformers' GGUF tokenizer
conversion (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) is the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.text.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing   ",
    "line one\nline two\r\n\ttabbed\t\tcode(x) = [1, 2, 3]",
    "In 2024, 3.14159 * 1e-10 = 0.000314159; call 555-0100.",
    "日本語のテキスト、中文文本和한국어 텍스트。",  # byte fallback
    "Emoji: 😀👍🏽 🇫🇷 and text",
    "nul\x00del\x7fnbsp\u00a0zwsp\u200bend",
    "[INST] What is the capital of France? [/INST] Paris.</s>",
    "<s>text after bos</s><s> again",
    "e\u0301 a\u0308 n\u0303",
    "",
    " ",
]
EXTRA_CONTROL = ("[INST]", "[/INST]")
USER_DEFINED = ("<tool>",)


def _train_pieces(size: int = 1200) -> list[str]:
    """Pieces of a sentencepiece BPE trained on this repository's engine sources (prose
    docstrings and code; always present, unlike the corpus)."""
    from tokenizers import SentencePieceBPETokenizer

    import engine

    files = sorted(str(f) for f in Path(engine.__file__).parent.rglob("*.py"))
    spm = SentencePieceBPETokenizer()
    spm.train(files, vocab_size=size, min_frequency=2, show_progress=False)
    by_id = sorted(spm.get_vocab().items(), key=lambda kv: kv[1])
    return [t for t, _ in by_id]


def write_spm_gguf(path: Path, pieces: list[str], add_space_prefix: bool | None = None):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for t in [*EXTRA_CONTROL, *USER_DEFINED]:
        tokens.append(t)
        types.append(3 if t in EXTRA_CONTROL else 4)
        scores.append(0.0)
    seen = set(tokens)
    for rank, piece in enumerate(p for p in pieces if p not in seen):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def pieces():
    return _train_pieces()


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory, pieces):
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", pieces)


def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_sentencepiece_gguf_matches_transformers(spm_gguf, corpus_dir):
    ours = TextTokenizer.from_gguf(spm_gguf, reference="llama.cpp")
    theirs = _reference(spm_gguf)
    docs = [f.read_text(encoding="utf-8")[:8000] for f in sorted(corpus_dir.glob("*.txt"))[:3]]
    for text in [*TEXTS, *docs]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), repr(text[:60])
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), repr(text[:60])
    assert ours.add_bos and ours.bos_id == 1 and 2 in ours.eos_ids
    assert ours.encode("hi", add_bos=True) == theirs.encode("hi")  # BOS added by default
    # Byte fallback: a character without a piece is its UTF-8 bytes.
    assert ours.encode("語")[-3:] == [3 + b for b in "語".encode()]
    assert len(ours.encode("[INST]")) == 1  # control token matched whole


def test_sentencepiece_without_space_prefix(tmp_path, pieces):
    path = write_spm_gguf(tmp_path / "np.gguf", pieces, add_space_prefix=False)
    ours = TextTokenizer.from_gguf(path)
    first = ours.encode("hello world")
    with_prefix = write_spm_gguf(tmp_path / "p.gguf", pieces, add_space_prefix=True)
    assert first != TextTokenizer.from_gguf(with_prefix).encode("hello world")
    assert ours.decode(first) == "hello world"


def test_sentencepiece_streaming_decode_equals_whole(spm_gguf):
    tok = TextTokenizer.from_gguf(spm_gguf)
    ids = tok.encode("  Streaming 日本 text, with spaces  and 😀 emoji.")
    dec = tok.incremental_decoder()
    text = "".join(dec.push(i) for i in ids) + dec.flush()
    assert text == tok.decode(ids)


def test_sentencepiece_without_scores_or_merges_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "\u2581a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"bad\.gguf: tokenizer\.ggml\.scores is missing"):
        TextTokenizer.from_gguf(tmp_path / "bad.gguf")


def test_tokenizer_is_checked_before_weights_are_read(tmp_path, monkeypatch):
    """load_weights refuses an unsupported GGUF tokenizer without reading a weight."""
    import engine.weights.gguf as gguf_loader
    from engine.load import load_weights

    w = gguf.GGUFWriter(str(tmp_path / "t5.gguf"), arch="llama")
    w.add_tokenizer_model("t5")
    w.add_token_list(["<pad>", "</s>", "\u2581a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    def no_weights(path):
        raise AssertionError("weights were read before the tokenizer was checked")

    monkeypatch.setattr(gguf_loader, "load_gguf", no_weights)
    with pytest.raises(ValueError, match=r"t5\.gguf: tokenizer\.ggml\.model='t5'"):
        load_weights(str(tmp_path / "t5.gguf"))


@pytest.mark.parametrize("prefix", [True, False])
def test_a_document_tokenised_in_pieces_has_the_ids_of_the_whole(tmp_path, pieces, prefix):
    """``--context-policy chunk`` tokenises a huge document in pieces
    (:func:`engine.text.context.piece_ids`): a sentencepiece vocabulary puts its ``▁``
    prefix in front of every text it encodes, so each piece is encoded after the
    character before it, whose ids are taken off; the ids are the whole document's."""
    from engine.text.context import _piece_end, piece_ids

    tok = TextTokenizer.from_gguf(write_spm_gguf(tmp_path / "s.gguf", pieces, prefix))
    document = "\n".join([*TEXTS, "def f(x):\n    return x\nA\r\nB \nC\n\nD end"] * 4)
    whole = tok.encode_text(document)
    ids = piece_ids(tok.encode_text, document, 97)
    assert len(ids.pieces) > 4 and ids.take(0, len(ids)) == whole
    alone, at = [], 0  # the same pieces, each encoded alone
    while at < len(document):
        end = _piece_end(document, at, 97)
        alone += tok.encode_text(document[at:end])
        at = end
    assert (alone != whole) == prefix  # the prefix's ▁ at each piece's start
