"""Text <-> token ids, chat templates and streaming detokenisation.

:class:`TextTokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` (the library does the
BPE) plus what the engine needs around it: the BOS flag, every end-of-generation id and
the chat template. It is built either from a GGUF file's metadata (GGUF spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, key names as written by
llama.cpp's ``convert_hf_to_gguf.py``) or from a Hugging Face model folder.

Rebuilding a byte-level BPE from GGUF follows transformers' GGUF conversion
(``transformers/integrations/gguf/gguf_tokenizer_mapping.py``), which the tests compare
against token for token. Where llama.cpp (and the model's original ``tokenizer.json``)
split text differently, ``reference="llama.cpp"`` selects their behaviour instead; see
:meth:`TextTokenizer.from_gguf`.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Strings of end-of-turn / end-of-text tokens across model families; those present in a
# vocabulary as added (special) tokens all end generation, besides the declared EOS.
END_TOKEN_NAMES = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
    "<|call|>",
)

REFERENCES = ("transformers", "llama.cpp")
# tokenizer.ggml.model values from_gguf rebuilds: byte-level BPE, sentencepiece (engine.text.spm).
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")

# Pre-tokenizer split patterns, keyed by tokenizer.ggml.pre (same strings as transformers'
# GGUF_PRE_TOKENIZER_SPLITS and llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_FAMILY = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
    | {"jina-v5-nano", "dbrx", "smaug-bpe"}
)
_QWEN2_FAMILY = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_GPT4O_FAMILY = frozenset({"gpt-4o", "llama4", "minimax-m2"})
_SPLITS = {
    **dict.fromkeys(_LLAMA3_FAMILY, _LLAMA3_SPLIT),
    **dict.fromkeys(_QWEN2_FAMILY, _QWEN2_SPLIT),
    **dict.fromkeys(_GPT4O_FAMILY, _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# GPT-2's own regex (tokenizers' ByteLevel). llama.cpp isolates every digit first for the
# StarCoder-style vocabularies, as their tokenizer.json does with Digits(individual).
_DIGIT_FAMILY = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
_GPT2_FAMILY = frozenset({"default", "gpt2", "mpt", "olmo", "jais"}) | _DIGIT_FAMILY
SUPPORTED_PRE = tuple(sorted({*_SPLITS, *_GPT2_FAMILY}))
# Converted tiktoken vocabularies: llama.cpp takes a pre-token that is in the vocabulary
# whole before merging (ignore_merges) and adds BOS when the file does not say.
_TIKTOKEN_FAMILY = (_LLAMA3_FAMILY - {"dbrx", "smaug-bpe"}) | {"tekken"}


class TextTokenizer:
    """Byte-level BPE tokenizer of one model, with its BOS/EOS ids and chat template.

    Build with :meth:`from_gguf` or :meth:`from_folder`. Token ids are Python ints in
    ``[0, vocab_size)``. Special-token strings such as ``<|im_start|>`` inside text are
    matched as single special tokens (as transformers does).

    Parameters
    ----------
    backend : tokenizers.Tokenizer
        Does the splitting and BPE; no post-processor is used (BOS is added here).
    bos_id : int or None
        Beginning-of-sequence id, if the model has one.
    eos_ids : Iterable[int]
        Every id that ends generation.
    add_bos : bool
        Whether the model expects BOS in front of a prompt.
    chat_template : str or None
        Jinja chat template as shipped with the model.
    special_tokens : Mapping[str, str], optional
        Template variables such as ``bos_token`` / ``eos_token`` (strings).
    vocab_size : int, optional
        Rows of the model's embedding; defaults to the backend's size with added tokens.
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        special_tokens: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ building

    @classmethod
    def from_gguf(cls, path_or_reader: Any, *, reference: str = "transformers") -> TextTokenizer:
        """Rebuild the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Reads ``tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id,
        eos_token_id, eot_token_id, eom_token_id, unknown_token_id, padding_token_id,
        add_bos_token, add_space_prefix}`` and ``tokenizer.chat_template`` (GGUF spec,
        "Tokenizer" section). Tokens typed control (3) become special tokens, user-defined
        (4) plain added tokens; both are matched whole in text. ``add_space_prefix`` only
        concerns sentencepiece vocabularies: llama.cpp and transformers ignore it for
        byte-level BPE, and so does this.

        Parameters
        ----------
        path_or_reader : str, os.PathLike or gguf.GGUFReader
            The ``.gguf`` file (opened with
            :class:`engine.weights.gguf_reader.FastGGUFReader`), or a reader already open
            on it (the engine shares the one its weights are read with).
        reference : {"transformers", "llama.cpp"}
            Whose conversion to reproduce where they differ. ``"transformers"`` (default)
            gives the ids of ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.
            ``"llama.cpp"`` matches llama.cpp (whose per-vocabulary splits mirror each
            model's original ``tokenizer.json``; checked against llama-cpp-python 0.3.36
            on the test corpus): it isolates each digit before the GPT-2 split for ``smollm`` and the other
            StarCoder-style vocabularies (transformers does not, so runs of spaces before
            a digit tokenize differently), and takes whole in-vocabulary pre-tokens before
            merging (``ignore_merges``) for Llama 3 and Tekken vocabularies.

        Returns
        -------
        TextTokenizer

        ``tokenizer.ggml.model = llama`` (sentencepiece: tokens, scores, byte fallback) is
        rebuilt by :func:`engine.text.spm.sentencepiece_bpe` as transformers converts it,
        for either ``reference`` (llama.cpp's own sentencepiece tokenizer was not run
        here; see :mod:`engine.text.spm`); ``add_bos_token`` defaults to true for it.

        Raises
        ------
        ValueError
            ``tokenizer.ggml.model`` is not ``gpt2`` (byte-level BPE) or ``llama``
            (sentencepiece), ``tokenizer.ggml.pre`` is unknown, required keys are
            missing (a sentencepiece vocabulary without merges needs its scores), or
            ``reference`` is not one of ``REFERENCES``.
        """
        if reference not in REFERENCES:
            raise ValueError(f"reference={reference!r}; expected one of {REFERENCES}")
        meta = _GGUFMetadata(path_or_reader)
        model_type = meta.get("tokenizer.ggml.model")
        if model_type not in GGUF_TOKENIZER_MODELS:
            raise ValueError(
                f"{meta.source}: tokenizer.ggml.model={model_type!r} is not supported; "
                "supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece BPE with byte "
                "fallback). Other models: load the model's Hugging Face folder (with its "
                "tokenizer.json) instead of a GGUF file."
            )
        pre = meta.get("tokenizer.ggml.pre") or "default"
        tokens = meta.require("tokenizer.ggml.tokens")
        token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = meta.get("tokenizer.ggml.merges") or []
        if model_type == "llama":
            from engine.text.spm import sentencepiece_bpe

            prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            try:
                backend = sentencepiece_bpe(
                    tokens, meta.get("tokenizer.ggml.scores"), merges, bool(prefix)
                )
            except ValueError as exc:
                raise ValueError(f"{meta.source}: {exc}") from None
            _add_gguf_added_tokens(backend, tokens, token_types, byte_level=False)
            settings = _gguf_settings(meta, tokens, backend, pre, default_bos=True)
            return cls(**settings, vocab_size=len(tokens))
        backend = _byte_level_bpe(tokens, merges, pre, reference)
        _add_gguf_added_tokens(backend, tokens, token_types)
        return cls(**_gguf_settings(meta, tokens, backend, pre), vocab_size=len(tokens))

    @classmethod
    def from_folder(cls, path: str | Path) -> TextTokenizer:
        """Load a Hugging Face model folder's tokenizer.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (``chat_template``,
        ``bos_token``, ``eos_token``, ``add_bos_token``), ``chat_template.jinja`` if present
        (newer transformers save the template there) and the declared ids
        ``eos_token_id`` / ``bos_token_id`` (an int or a list) from
        ``generation_config.json``, else from ``config.json`` (as transformers'
        ``GenerationConfig.from_model_config`` falls back). Generation ends at every
        declared id, the tokenizer's ``eos_token`` and the known end-of-turn added tokens.
        When ``add_bos_token`` is absent it is read off the tokenizer's post-processor
        (does it put BOS in front).

        Parameters
        ----------
        path : str or pathlib.Path
            The model folder.

        Returns
        -------
        TextTokenizer

        Raises
        ------
        FileNotFoundError
            No ``tokenizer.json`` in the folder.
        """
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json in this model folder (a Hugging Face model "
                "folder holds config.json, tokenizer.json and its weights as *.safetensors; "
                "or give a GGUF file)"
            )
        try:
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library's own error: "Model missing. ..."
            raise ValueError(f"{folder / 'tokenizer.json'}: not a tokenizer this reads: {exc}") from None
        config = read_json_object(folder / "tokenizer_config.json")
        generation = read_json_object(folder / "generation_config.json")
        model_config = read_json_object(folder / "config.json")
        names = {key: _token_content(config.get(key)) for key in _SPECIAL_KEYS}
        specials = {key: value for key, value in names.items() if value is not None}
        bos_declared = _declared(generation, model_config, "bos_token_id")
        bos_id = _token_id(backend, specials.get("bos_token"), bos_declared)
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        eos = [_token_id(backend, specials.get("eos_token"), None)]
        eos += _as_list(_declared(generation, model_config, "eos_token_id"))
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=_end_ids(backend, eos),
            add_bos=bool(add_bos),
            chat_template=_folder_chat_template(folder, config),
            special_tokens=specials,
        )

    # ------------------------------------------------------------------ text <-> ids

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on ``len(self.encode(text))``, found without tokenising.

        Each token stands for at most :attr:`max_token_bytes` bytes of the text, and bytes
        the vocabulary lacks are dropped, so the other UTF-8 bytes of ``text`` need at
        least ``ceil(bytes / max_token_bytes)`` tokens. Linear in ``text`` and far cheaper
        than :meth:`encode`, but loose (about 20x below the real count on English prose
        with SmolLM2's 81-byte longest token): enough to refuse a document that cannot
        fit a context.

        Returns
        -------
        int or None
            ``None`` where no bound is known (see :attr:`max_token_bytes`).
        """
        bound = self._token_bound
        if bound is None:
            return None
        longest, dropped = bound
        kept = len(text.encode("utf-8", "surrogatepass").translate(None, dropped))
        return -(-kept // longest)

    @property
    def max_token_bytes(self) -> int | None:
        """Most bytes of input text one token can stand for, or ``None`` where unknown.

        Known for a byte-level BPE that drops or shrinks no text (every GGUF vocabulary
        :meth:`from_gguf` builds; ``tokenizer.json`` files of Llama 3, Qwen2, SmolLM): each
        token is then the bytes of one run of the text, so the bound is the longest
        vocabulary token (one character per byte) or added token (its UTF-8 text). A
        normalizer, a pre-tokenizer other than ByteLevel, Digits and non-removing Split,
        a model other than BPE, or an added token that swallows the whitespace beside it
        (``lstrip``/``rstrip``) gives ``None``.
        """
        bound = self._token_bound
        return None if bound is None else bound[0]

    @cached_property
    def _token_bound(self) -> tuple[int, bytes] | None:
        """(:attr:`max_token_bytes`, the bytes without a vocabulary token, which BPE drops),
        or ``None``."""
        if self.backend.normalizer is not None or not _byte_level_keeps_text(_steps(self.backend)):
            return None
        added = list(self.backend.get_added_tokens_decoder().values())
        if any(t.lstrip or t.rstrip for t in added):
            return None
        vocab = self.backend.get_vocab(with_added_tokens=False)
        dropped = bytes(b for b, char in bytes_to_unicode().items() if char not in vocab)
        longest = [*(len(t) for t in vocab), *(len(t.content.encode("utf-8")) for t in added)]
        return max(longest), dropped

    def encode(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text`` (``[T]`` ints).

        Parameters
        ----------
        text : str
        add_bos : bool
            Put :attr:`bos_id` in front. Pass ``tok.add_bos`` to follow the model.
        special : bool
            Whether special-token strings in ``text`` (``<|im_end|>``) map to their control
            ids (default, as transformers does) or are encoded as the plain text they spell
            (``False``: for text from users and documents, see :meth:`encode_text`).

        Raises
        ------
        ValueError
            ``add_bos`` is set but the model has no BOS token.
        """
        backend = self.backend if special else self._literal_backend
        ids = backend.encode(text, add_special_tokens=False).ids
        return self._bos_prefix(add_bos) + ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token matching off: a document containing
        ``<|im_start|>system`` gets the ids of those characters, never control ids."""
        return self.encode(text, special=False)

    @cached_property
    def _literal_backend(self) -> Tokenizer:
        """A copy of the backend that encodes special-token strings as plain text."""
        backend = Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        """Alternation of every special (control) added token's text, longest first."""
        added = self.backend.get_added_tokens_decoder().values()
        texts = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """:meth:`encode` of many texts, run in parallel by the ``tokenizers`` library."""
        prefix = self._bos_prefix(add_bos)
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [prefix + e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form valid UTF-8 become U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string as spelled in the vocabulary (``<|im_end|>``), or None."""
        return self.backend.token_to_id(token)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh :class:`IncrementalDecoder` for one generated sequence."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def _bos_prefix(self, add_bos: bool) -> list[int]:
        if not add_bos:
            return []
        if self.bos_id is None:
            raise ValueError("add_bos=True but this model has no BOS token")
        return [self.bos_id]

    # ------------------------------------------------------------------ chat

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, through the model's chat template.

        Rendered in a sandboxed Jinja environment like transformers'
        ``apply_chat_template(..., tokenize=False)``: ``trim_blocks`` and
        ``lstrip_blocks`` on, ``raise_exception`` / ``strftime_now`` globals, a ``tojson``
        that keeps non-ASCII, and ``bos_token`` / ``eos_token`` (and ``unk_token`` /
        ``pad_token`` when known) as variables.

        Without a template the fallback is plain text: each message as
        ``"<Role>: <content>"`` (role capitalised), messages joined by a blank line, and
        with ``add_generation_prompt`` a final ``"\\n\\nAssistant:"``.

        Parameters
        ----------
        messages : list of dict
            ``{"role": "system" | "user" | "assistant", "content": str}`` items.
        add_generation_prompt : bool
            Append the header that opens the assistant's turn.

        Raises
        ------
        jinja2.TemplateError
            The template raised (``raise_exception``) or is invalid.
        jinja2.sandbox.SecurityError
            The template tried something the sandbox forbids.
        """
        if self.chat_template is None:
            return _plain_chat(messages, add_generation_prompt)
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`render_chat`; only the template's own markers are control
        tokens.

        The messages' ``content`` (documents, questions) is encoded with special-token
        matching off, so a document containing ``<|im_end|>\n<|im_start|>system`` cannot
        open a turn of its own: it gets the ids of those characters. The template's text
        is split at its special tokens, as the ``tokenizers`` library splits at added
        tokens, and each stretch between them (template text and content together) is
        encoded as one text, so a prompt whose content holds no special-token string gets
        exactly the ids of ``encode(render_chat(...))``. BOS goes in front only if the
        model's :attr:`add_bos` flag asks for it and the rendered text does not already
        begin with the BOS token (never two BOS).

        Where the content sits in the rendered text is found by rendering once more with
        a unique marker in place of each content; a template that trims the content is
        followed. If the template changes the content otherwise, the content is placed
        as given at its marker.
        """
        pieces = self._chat_pieces(messages, add_generation_prompt)
        text = "".join(piece for piece, _ in pieces)
        bos_text = self.special_tokens.get("bos_token")
        already = bos_text is not None and text.startswith(bos_text)
        ids = self._bos_prefix(self.add_bos and not already)
        pattern = self._special_pattern
        stretch: list[str] = []
        for piece, is_content in pieces:
            if is_content or pattern is None:
                stretch.append(piece)
                continue
            at = 0
            for match in pattern.finditer(piece):
                stretch.append(piece[at : match.start()])
                ids += self._encode_stretch(stretch)
                ids.append(self.backend.token_to_id(match.group()))
                stretch, at = [], match.end()
            stretch.append(piece[at:])
        return ids + self._encode_stretch(stretch)

    def _encode_stretch(self, parts: list[str]) -> list[int]:
        text = "".join(parts)
        return self.encode(text, special=False) if text else []

    def _chat_pieces(
        self, messages: list[dict], add_generation_prompt: bool
    ) -> list[tuple[str, bool]]:
        """The rendered prompt as ``(text, is message content)`` pieces, in order."""
        text = self.render_chat(messages, add_generation_prompt)
        tag = secrets.token_hex(8)
        marks = {f"\ue000{tag}.{i}\ue001": i for i, m in enumerate(messages)}
        masked = [
            {**m, "content": mark} if isinstance(m.get("content"), str) else m
            for m, mark in zip(messages, marks, strict=True)
        ]
        skeleton = self.render_chat(masked, add_generation_prompt)
        parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", skeleton)
        contents = [str(messages[marks[p]]["content"]) if p in marks else None for p in parts]
        pieces = _align_contents(text, parts, contents)
        if pieces is None:  # the template changed the content beyond trimming
            pairs = zip(parts, contents, strict=True)
            pieces = [(c, True) if c is not None else (p, False) for p, c in pairs]
        return [(piece, is_content) for piece, is_content in pieces if piece]

    @cached_property
    def _compiled_template(self):
        return _sandboxed_template(self.chat_template)


class IncrementalDecoder:
    """Streaming detokenisation: feed ids one at a time, get the newly completed text.

    Text is held back while the ids so far end inside a multi-byte UTF-8 character (the
    decoded tail is U+FFFD), so no replacement character is emitted for a character whose
    bytes span several tokens. The concatenation of every :meth:`push` result and the
    final :meth:`flush` equals ``tokenizer.decode(all_ids)``.

    Works with any ``tokenizers`` decoder: each step decodes a short window of ids
    starting at the last point where the text was complete (the prefix/read-offset
    scheme of Hugging Face TGI and vLLM), so leading-space rules of the decoder apply
    the same way as in a whole decode.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already emitted

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is partial)."""
        self._ids.append(int(token_id))
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Text still held back at the end of the sequence (invalid bytes as U+FFFD)."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(done) :]

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)


def find_stop(text: str, stops: Iterable[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in ``text[start:]``, as an index into ``text``.

    Parameters
    ----------
    text : str
        Generated text so far.
    stops : Iterable[str]
        Stop strings; empty ones are ignored.
    start : int
        Where to begin searching. When streaming, pass
        ``max(0, old_len - max(len(s) for s in stops) + 1)`` so that a stop string split
        across two chunks is still found.

    Returns
    -------
    int or None
        Position of the first character of the earliest match, or None.
    """
    hits = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


# ---------------------------------------------------------------------- GGUF helpers


class _GGUFMetadata:
    """Metadata values of one GGUF file, read with ``gguf.GGUFReader`` (a path is opened
    with :class:`engine.weights.gguf_reader.FastGGUFReader`, the same fields sooner)."""

    def __init__(self, path_or_reader: Any) -> None:
        import gguf

        from engine.weights.gguf_reader import FastGGUFReader

        if isinstance(path_or_reader, gguf.GGUFReader):
            self.reader = path_or_reader
            self.source = str(getattr(path_or_reader.data, "filename", "GGUF"))
        else:
            self.reader = FastGGUFReader(path_or_reader)
            self.source = str(path_or_reader)

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"{self.source}: missing GGUF metadata key {key}")
        return value


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = [b for b in range(256) if b not in table]
    table |= {b: chr(256 + n) for n, b in enumerate(extra)}
    return dict(sorted(table.items()))


_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Digits", "Split")


def _byte_level_keeps_text(spec: dict[str, Any]) -> bool:
    """Whether a serialised ``tokenizers.Tokenizer`` is a BPE over a ByteLevel
    pre-tokenizer whose other steps only split (never remove) text."""
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    removes = any(s.get("type") == "Split" and s.get("behavior") == "Removed" for s in steps)
    keeps = all(kind in _KEEPING_PRE_TOKENIZERS for kind in kinds)
    return "ByteLevel" in kinds and keeps and not removes


def _steps(backend: Tokenizer) -> dict[str, Any]:
    """The parts of ``backend.to_str()``'s JSON that :func:`_byte_level_keeps_text` reads
    (the model's type and the pre-tokenizer), without serialising the vocabulary and
    merges (1.5 MB of JSON for SmolLM2, 0.3-0.8 s to write and parse)."""
    pre = backend.pre_tokenizer
    return {
        "model": {"type": type(backend.model).__name__},
        "pre_tokenizer": None if pre is None else json.loads(pre.__getstate__()),
    }


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, reference: str) -> Tokenizer:
    """BPE model + pre-tokenizer + ByteLevel decoder, as transformers' GPT2Tokenizer."""
    if pre not in SUPPORTED_PRE:
        raise ValueError(
            f"tokenizer.ggml.pre={pre!r} is not a known pre-tokenizer; supported: "
            f"{', '.join(SUPPORTED_PRE)}"
        )
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {_spell(t, alphabet, spelling): i for i, t in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges]
    ignore = reference == "llama.cpp" and pre in _TIKTOKEN_FAMILY
    model = BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore)
    backend = Tokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(pre, reference)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merge_pair(merge: str) -> tuple[str, str]:
    """``"Ġ t"`` -> ``("Ġ", "t")`` (byte-level tokens never hold a literal space)."""
    left, right = merge.split(" ", 1)
    return left, right


def _spell(token: str, alphabet: set[str], spelling: dict[int, str]) -> str:
    """Tokens already in the byte alphabet stay; others are respelled byte by byte."""
    if set(token) <= alphabet:
        return token
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str, reference: str):
    split = _SPLITS.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if reference == "llama.cpp" and pre in _DIGIT_FAMILY:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    return byte_level


def _add_gguf_added_tokens(
    backend: Tokenizer, tokens: list[str], types: list[int], byte_level: bool = True
) -> None:
    """Control tokens -> special added tokens; user-defined -> plain added tokens.

    In a byte-level vocabulary a control token spelled outside the byte alphabet is a
    llama.cpp mislabel and is skipped, as transformers does (it could not be a real
    byte-level token); ``byte_level=False`` (sentencepiece) keeps every control token.
    """
    alphabet = set(bytes_to_unicode().values())
    pairs = list(zip(tokens, types, strict=True))
    control = [
        t for t, k in pairs if k == TOKEN_TYPE_CONTROL and (not byte_level or set(t) <= alphabet)
    ]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [t for t, k in pairs if k == TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _gguf_settings(
    meta: _GGUFMetadata, tokens: list[str], backend: Tokenizer, pre: str, default_bos=None
) -> dict:
    """Constructor arguments besides the backend: ids, flags, template, template variables.

    ``default_bos``: whether to add BOS when ``tokenizer.ggml.add_bos_token`` is absent
    (sentencepiece vocabularies: True, as llama.cpp and transformers do); by default True
    only for the converted-tiktoken pre-tokenizers."""

    def token_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    ids = {key: token_id(name) for key, name in _GGUF_SPECIAL_IDS.items()}
    specials = {key: tokens[i] for key, i in ids.items() if i is not None}
    if default_bos is None:
        default_bos = pre in _TIKTOKEN_FAMILY
    add_bos = meta.get("tokenizer.ggml.add_bos_token", default_bos)
    ends = [ids["eos_token"], token_id("eot_token_id"), token_id("eom_token_id")]
    return {
        "backend": backend,
        "bos_id": ids["bos_token"],
        "eos_ids": _end_ids(backend, ends),
        "add_bos": bool(add_bos),
        "chat_template": meta.get("tokenizer.chat_template"),
        "special_tokens": specials,
    }


_GGUF_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_SPECIAL_KEYS = tuple(_GGUF_SPECIAL_IDS)


def _end_ids(backend: Tokenizer, declared: Iterable[int | None]) -> frozenset[int]:
    """Declared end ids plus every known end-of-turn token that is an added token."""
    added = set(backend.get_added_tokens_decoder())
    named = (backend.token_to_id(name) for name in END_TOKEN_NAMES)
    ends = {i for i in declared if i is not None}
    ends |= {i for i in named if i is not None and i in added}
    return frozenset(ends)


# ---------------------------------------------------------------------- folder helpers


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (``{}`` where there is none).

    Raises
    ------
    ValueError
        The file is not JSON or not an object (the message names it).
    """
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` (AddedToken serialisation) -> ``"<s>"``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: Tokenizer, token: str | None, fallback: Any) -> int | None:
    """Id of ``token`` in the vocabulary, else the first of ``fallback`` (int or list)."""
    token_id = backend.token_to_id(token) if token is not None else None
    return token_id if token_id is not None else next(iter(_as_list(fallback)), None)


def _declared(generation: dict, model_config: dict, key: str) -> Any:
    """``key`` of ``generation_config.json`` when it sets one, else of ``config.json``."""
    value = generation.get(key)
    return model_config.get(key) if value is None else value


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _folder_chat_template(folder: Path, config: dict) -> str | None:
    """``chat_template.jinja``, else ``tokenizer_config.json``'s (a string or named list)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


# ---------------------------------------------------------------------- chat helpers


def _align_contents(
    text: str, parts: list[str], contents: list[str | None]
) -> list[tuple[str, bool]] | None:
    """Split ``text`` (the real rendering) like ``parts`` (the rendering with markers:
    template text, and a marker where ``contents`` holds that message's content): each
    content as it appears in ``text`` (as is or trimmed). ``None`` if it does not fit."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for n, (part, content) in enumerate(zip(parts, contents, strict=True)):
        if content is None:
            if not text.startswith(part, pos):
                return None
            pieces.append((part, False))
            pos += len(part)
            continue
        after = parts[n + 1] if n + 1 < len(parts) else ""
        for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if text.startswith(shown + after, pos):
                pieces.append((shown, True))
                pos += len(shown)
                break
        else:
            return None
    return pieces if pos == len(text) else None



def _plain_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    turns = [f"{str(m['role']).capitalize()}: {m['content']}" for m in messages]
    if add_generation_prompt:
        turns.append("Assistant:")
    return "\n\n".join(turns)


def _sandboxed_template(source: str):
    """Compile a chat template in an immutable sandbox, set up as transformers does."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """Accept ``{% generation %}...{% endgeneration %}`` and render its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
