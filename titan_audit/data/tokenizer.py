"""Tokenizers: a built-in byte-level tokenizer (the default, nothing to download) and HF `tokenizers`.

Guarantees:
- `encode_batch(texts)` returns one uint32 numpy array per text, a pure function of the text and
  the tokenizer file: no special tokens are added (the packer adds EOS between documents).
- `identity` names the tokenizer exactly ("byte-v1", "hf:<xxh3-128 of tokenizer.json>:eos=<id>"
  (+ ":pad=<id>" when a PAD token is named), or for a directory "hf-dir:<xxh3-128 of its
  files>:eos=<id>:pad=<id>"), and is recorded in every token store (and an RL run's manifest), so
  a store never silently mixes tokenizers.

ByteTokenizer: token = UTF-8 byte value (0..255), EOS = 256, PAD = 257, vocab 258.
HFTokenizer: `tokenizers.Tokenizer.from_file(path)`; EOS is `eos_token` when given, otherwise the
first of `EOS_CANDIDATES` found in the vocabulary (else a ValueError naming the file); PAD is
`pad_token` when given, else EOS. A tokenizer.json that is not UTF-8 is a ValueError naming the
file and line (data/textio.py).
PretrainedTokenizer: an HF tokenizer directory (tokenizer.json + tokenizer_config.json, as
`save_pretrained` writes it) through `transformers.AutoTokenizer` (local files only), for its chat
template: `chat_prompt(prompt)` applies it with `add_generation_prompt=True`. EOS / PAD are the
given tokens, else the tokenizer's own `eos_token` / `pad_token` (PAD falls back to EOS); its
identity hashes every file of the directory. `load_tokenizer(path)` picks the class: a file ->
HFTokenizer, a directory -> PretrainedTokenizer.
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

    def decode(self, ids: list[int] | np.ndarray, skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    identity: str = "byte-v1"
    vocab_size: int = 258
    eos_id: int = 256
    pad_id: int = 257

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for text in texts]

    def decode(self, ids: list[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: str | os.PathLike, eos_token: str | None = None, pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ValueError(f"{path}: a tokenizer.json needs HF tokenizers (pip install tokenizers)") from None
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
        if pad_token is not None and pad_token not in vocab:
            raise ValueError(f"{path}: pad token {pad_token!r} is not in the vocabulary")
        self.path = path
        self.eos_token = eos_token
        self.eos_id = int(vocab[eos_token])
        self.pad_id = self.eos_id if pad_token is None else int(vocab[pad_token])
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        pad = "" if pad_token is None else f":pad={self.pad_id}"
        self.identity = f"hf:{xxhash.xxh3_128_hexdigest(data)}:eos={self.eos_id}{pad}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: list[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class PretrainedTokenizer:
    """An HF tokenizer directory through transformers (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, eos_token: str | None = None, pad_token: str | None = None) -> None:
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"{path}: no such tokenizer directory")
        files = sorted(f for f in path.iterdir() if f.is_file())
        try:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except ImportError:
            raise ValueError(f"{path}: a tokenizer directory needs transformers (pip install transformers)") from None
        except Exception as error:  # transformers raises OSError, ValueError, its own types
            raise ValueError(
                f"{path}: not a loadable HF tokenizer directory ({type(error).__name__}: {error})"
            ) from None
        vocab = self._tok.get_vocab()
        eos_token = eos_token if eos_token is not None else self._tok.eos_token
        if eos_token is None:
            raise ValueError(f"{path}: the tokenizer has no eos_token; pass one")
        if eos_token not in vocab:
            raise ValueError(f"{path}: eos token {eos_token!r} is not in the vocabulary")
        pad_token = pad_token if pad_token is not None else (self._tok.pad_token or eos_token)
        if pad_token not in vocab:
            raise ValueError(f"{path}: pad token {pad_token!r} is not in the vocabulary")
        self.path = path
        self.eos_token, self.pad_token = eos_token, pad_token
        self.eos_id, self.pad_id = int(vocab[eos_token]), int(vocab[pad_token])
        self.vocab_size = max(len(self._tok), max(vocab.values()) + 1)
        digest = xxhash.xxh3_128()
        for f in files:
            digest.update(f"{f.name}\n{f.stat().st_size}\n".encode())
            digest.update(f.read_bytes())
        self.identity = f"hf-dir:{digest.hexdigest()}:eos={self.eos_id}:pad={self.pad_id}"

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def chat_prompt(self, prompt: str | list[dict]) -> str:
        """The chat template applied to a prompt (a string: one user message; or a list of
        {"role", "content"} messages), ending with the generation prompt (text, not ids)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(self._tok.encode(t, add_special_tokens=False), dtype=np.uint32) for t in texts]

    def decode(self, ids: list[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(
    path: str | os.PathLike, eos_token: str | None = None, pad_token: str | None = None
) -> HFTokenizer | PretrainedTokenizer:
    """A tokenizer.json file (HFTokenizer) or an HF tokenizer directory (PretrainedTokenizer)."""
    if Path(path).is_dir():
        return PretrainedTokenizer(path, eos_token, pad_token)
    return HFTokenizer(path, eos_token, pad_token)


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer (picklable, so process workers can rebuild it)."""

    path: str | None = None  # a tokenizer.json; None = the byte tokenizer
    eos_token: str | None = None

    def build(self) -> ByteTokenizer | HFTokenizer:
        return ByteTokenizer() if self.path is None else HFTokenizer(self.path, self.eos_token)
