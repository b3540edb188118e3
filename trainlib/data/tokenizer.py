"""Tokenizers used by the data pipeline.

Three implementations share one small protocol (``vocab_size``, ``bos_id``,
``eos_id``, ``encode``, ``decode``):

* :class:`ByteTokenizer` -- raw UTF-8 bytes, needs no files (the default).
* :class:`HFTokenizer` -- a Hugging Face ``tokenizer.json`` (``pip install tokenizers``).
* :class:`TiktokenTokenizer` -- a Llama 3 style ``tokenizer.model`` (``pip install tiktoken``).

``encode`` never adds BOS/EOS; the dataset adds them around each document.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, Sequence, runtime_checkable

from trainlib.errors import ConfigError

__all__ = [
    "Tokenizer",
    "TokenizerConfig",
    "ByteTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "build_tokenizer",
    "TIKTOKEN_SPLIT_PATTERN",
    "TIKTOKEN_NUM_SPECIAL_TOKENS",
]


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:  # no BOS/EOS added
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class TokenizerConfig:
    kind: Literal["byte", "hf", "tiktoken"] = field(
        default="byte", metadata={"help": "byte (UTF-8 bytes, no files), hf (tokenizer.json) or tiktoken (a BPE tokenizer.model, with 256 special tokens after its ranks)"}
    )
    path: str | None = field(
        default=None, metadata={"help": "tokenizer.json for kind=hf; tiktoken tokenizer.model for kind=tiktoken; unused for byte"}
    )


# --------------------------------------------------------------------------- byte


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS=256, EOS=257."""

    vocab_size: int = 258
    bos_id: int = 256
    eos_id: int = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special ids (and anything out of byte range) are dropped from the text.
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


# --------------------------------------------------------------------------- helpers


def _require_file(path: str | None, kind: str, what: str) -> str:
    if not path:
        raise ConfigError(
            f"tokenizer.path is required for tokenizer.kind={kind!r}: set tokenizer.path to {what}"
        )
    if not os.path.isfile(path):
        raise ConfigError(
            f"tokenizer.path={path!r} does not exist or is not a file: set tokenizer.path to {what}"
        )
    return path


# --------------------------------------------------------------------------- hf

_HF_SPECIAL_PAIRS = (
    ("<|begin_of_text|>", "<|end_of_text|>"),
    ("<s>", "</s>"),
    ("<|endoftext|>", "<|endoftext|>"),
)


class HFTokenizer:
    """Wraps a ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``."""

    def __init__(self, path: str):
        path = _require_file(path, "hf", "a Hugging Face tokenizer.json file")
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:  # the environment lacks an optional package: the user's to install
            raise ConfigError(f"tokenizer.kind='hf' needs the 'tokenizers' package ({e}): "
                              "pip install tokenizers") from e
        self.path = path
        try:  # parsed here first: a damaged file is the user's to fix, and tokenizers' own error names no file
            text = Path(path).read_bytes().decode("utf-8")
            if not isinstance(json.loads(text), dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
            raise ConfigError(f"tokenizer.path={path!r} is not a tokenizer.json (damaged or another file: {e}); "
                              "set tokenizer.path to a Hugging Face tokenizer.json file") from None
        self._tok = _HFTok.from_str(text)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        for bos, eos in _HF_SPECIAL_PAIRS:
            bos_id, eos_id = self._tok.token_to_id(bos), self._tok.token_to_id(eos)
            if bos_id is not None and eos_id is not None:
                self.bos_id, self.eos_id = int(bos_id), int(eos_id)
                break
        else:
            raise ConfigError(
                f"tokenizer.path={path!r} defines no BOS/EOS special tokens: expected one of "
                "<|begin_of_text|>/<|end_of_text|>, <s>/</s> or <|endoftext|>"
            )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- tiktoken

# Llama 3 pre-tokenization: contractions, letter runs with an optional leading
# non-letter/non-digit, digit groups of at most 3, punctuation runs, newlines and whitespace.
TIKTOKEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)
TIKTOKEN_NUM_SPECIAL_TOKENS = 256
# The named specials of Llama 3.x, in id order right after the base vocabulary; the
# remaining slots up to 256 are <|reserved_special_token_N|>.
_TIKTOKEN_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
# tiktoken's regex engine gets slow on enormous inputs; encode long texts in pieces.
_MAX_ENCODE_CHARS = 400_000


def _tiktoken_special_names() -> list[str]:
    names = list(_TIKTOKEN_NAMED_SPECIALS)
    k = 2
    while len(names) < TIKTOKEN_NUM_SPECIAL_TOKENS:
        names.append(f"<|reserved_special_token_{k}|>")
        k += 1
    return names


def _read_bpe_ranks(path: str) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one ``<base64 token> <rank>`` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(
                    f"tokenizer.path={path!r} line {lineno} is not '<base64 token> <rank>': "
                    "set tokenizer.path to a tiktoken tokenizer.model file"
                )
            try:
                ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
            except (binascii.Error, ValueError):
                raise ConfigError(
                    f"tokenizer.path={path!r} line {lineno} is not '<base64 token> <rank>' (damaged?): "
                    "set tokenizer.path to a tiktoken tokenizer.model file") from None
    if not ranks:
        raise ConfigError(f"tokenizer.path={path!r} holds no tokens: set tokenizer.path to a tiktoken tokenizer.model file")
    return ranks


class TiktokenTokenizer:
    """Llama 3 tokenizer: tiktoken BPE ranks + Llama 3 split regex + 256 special tokens."""

    def __init__(self, path: str):
        path = _require_file(path, "tiktoken", "a tiktoken BPE tokenizer.model file (ranks, as Meta ships them)")
        try:
            import tiktoken
        except ImportError as e:  # the environment lacks an optional package: the user's to install
            raise ConfigError(f"tokenizer.kind='tiktoken' needs the 'tiktoken' package ({e}): "
                              "pip install tiktoken") from e
        self.path = path
        ranks = _read_bpe_ranks(path)
        base = len(ranks)
        self.special_tokens = {name: base + i for i, name in enumerate(_tiktoken_special_names())}
        self._enc = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=TIKTOKEN_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = base + TIKTOKEN_NUM_SPECIAL_TOKENS
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]

    def encode(self, text: str) -> list[int]:
        # Special-token text inside documents is encoded as ordinary text.
        out: list[int] = []
        for i in range(0, max(len(text), 1), _MAX_ENCODE_CHARS):
            out.extend(self._enc.encode(text[i : i + _MAX_ENCODE_CHARS], allowed_special=set(), disallowed_special=()))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- factory


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    kind = cfg.kind
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        return HFTokenizer(cfg.path)  # type: ignore[arg-type]
    if kind == "tiktoken":
        return TiktokenTokenizer(cfg.path)  # type: ignore[arg-type]
    raise ConfigError(f"tokenizer.kind={kind!r} is unknown: use one of 'byte', 'hf', 'tiktoken'")
