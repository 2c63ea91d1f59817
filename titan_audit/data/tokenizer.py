"""Tokenizers: a built-in byte-level tokenizer (the default, nothing to download) and HF `tokenizers`.

Guarantees:
- `encode_batch(texts)` returns one uint32 numpy array per text, a pure function of the text and
  the tokenizer file: no special tokens are added (the packer adds EOS between documents).
- `identity` names the tokenizer exactly ("byte-v1", or "hf:<xxh3-128 of tokenizer.json>:eos=<id>"),
  and is recorded in every token store, so a store never silently mixes tokenizers.

ByteTokenizer: token = UTF-8 byte value (0..255), EOS = 256, PAD = 257, vocab 258.
HFTokenizer: `tokenizers.Tokenizer.from_file(path)`; EOS is `eos_token` when given, otherwise the
first of `EOS_CANDIDATES` found in the vocabulary (else a ValueError naming the file); PAD = EOS.
A tokenizer.json that is not UTF-8 is a ValueError naming the file and line (data/textio.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from titan_audit.data.textio import decode_utf8

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")


class Tokenizer(Protocol):
    identity: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int] | np.ndarray) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    identity: str = "byte-v1"
    vocab_size: int = 258
    eos_id: int = 256
    pad_id: int = 257

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for text in texts]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | os.PathLike, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such tokenizer file")
        data = path.read_bytes()
        text = decode_utf8(data, path)  # a bad byte: ValueError naming its line
        try:
            self._tok = _HF.from_str(text)
        except Exception as error:  # tokenizers raises its own Exception type
            raise ValueError(f"{path}: not a valid tokenizer.json ({error})") from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if eos_token is not None:
            if eos_token not in vocab:
                raise ValueError(f"{path}: eos token {eos_token!r} is not in the vocabulary")
        else:
            eos_token = next((t for t in EOS_CANDIDATES if t in vocab), None)
            if eos_token is None:
                raise ValueError(
                    f"{path}: no end-of-text token found (tried {', '.join(EOS_CANDIDATES)}); pass eos_token"
                )
        self.path = path
        self.eos_token = eos_token
        self.eos_id = int(vocab[eos_token])
        self.pad_id = self.eos_id
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.identity = f"hf:{xxhash.xxh3_128_hexdigest(data)}:eos={self.eos_id}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: list[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer (picklable, so process workers can rebuild it)."""

    path: str | None = None  # a tokenizer.json; None = the byte tokenizer
    eos_token: str | None = None

    def build(self) -> ByteTokenizer | HFTokenizer:
        return ByteTokenizer() if self.path is None else HFTokenizer(self.path, self.eos_token)
