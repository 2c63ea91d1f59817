"""Tokenizers: the byte-level default, and an HF tokenizer.json built here (no downloads)."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_audit.data import ByteTokenizer, HFTokenizer, PrepareConfig, TokenizerSpec, TokenStore, prepare
from titan_audit.data.synthetic import make_record


def make_hf_tokenizer(path, special=("<|endoftext|>",)):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([make_record(0, i).text for i in range(500)], trainer)
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "Sort: 3 1 2 -> 1 2 3 é漢"
    (ids,) = tok.encode_batch([text])
    assert ids.dtype == np.uint32 and ids.max() < 256 and len(ids) == len(text.encode())
    assert tok.decode(np.append(ids, tok.eos_id)) == text  # EOS is not a byte


def test_hf_tokenizer_from_tokenizer_json(tmp_path, corpus):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert tok.eos_id == tok.pad_id == 0 and tok.identity.startswith("hf:")
    text = make_record(0, 3).text
    (ids,) = tok.encode_batch([text])
    assert len(ids) < len(text.encode())  # merges learnt
    assert tok.decode(ids) == text
    info = prepare(
        PrepareConfig(sources=(str(corpus),), out=str(tmp_path / "hf.zarr"), tokenizer=TokenizerSpec(str(path)))
    )
    store = TokenStore(tmp_path / "hf.zarr")
    assert info.tokenizer == tok.identity and info.eos_id == 0
    assert store.origin.extra["tokenizer"] == tok.identity
    first = store.doc(0)
    assert np.array_equal(first, tok.encode_batch([make_record(7, 0).text])[0])  # corpus is seed 7
    # negative control: another tokenizer file gives another identity
    other = HFTokenizer(make_hf_tokenizer(tmp_path / "other.json", special=("</s>",)))
    assert other.identity != tok.identity


def test_hf_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.json: no such tokenizer file"):
        HFTokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"bad\.json: not a valid tokenizer\.json"):
        HFTokenizer(tmp_path / "bad.json")
    path = make_hf_tokenizer(tmp_path / "noeos.json", special=("[PAD]",))
    with pytest.raises(ValueError, match=r"noeos\.json: no end-of-text token"):
        HFTokenizer(path)
    assert HFTokenizer(path, eos_token="[PAD]").eos_id == 0
    with pytest.raises(ValueError, match=r"eos token '<x>' is not in the vocabulary"):
        HFTokenizer(path, eos_token="<x>")
