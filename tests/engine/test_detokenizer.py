"""The detokenizer's fast decode path gives the same text as the HF tokenizer's own decode."""

from __future__ import annotations

import random

import pytest

from kestrel.engine.detokenizer import IncrementalDetokenizer, fast_decode
from tests.checkpoints import tokenizer


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_decode_matches_the_tokenizer(skip_special_tokens):
    hf = tokenizer()
    decode = fast_decode(hf)
    assert decode is not hf.decode  # the test tokenizer is a fast one: the Rust path is taken
    rng = random.Random(0)
    special = hf.all_special_ids
    for _ in range(50):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))] + special[:1]
        assert decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        )


def test_incremental_text_is_the_decoded_output():
    hf = tokenizer()
    prompt = hf.encode("The prompt sets the context")
    output = hf.encode(" and the output follows, one token at a time.")
    detokenizer = IncrementalDetokenizer(hf, prompt, skip_special_tokens=True)
    pieces = [detokenizer.push(token) for token in output]
    assert "".join(pieces) == detokenizer.text == hf.decode(output, skip_special_tokens=True)


@pytest.mark.parametrize("streamed", [True, False])
def test_both_incremental_paths_rebuild_multibyte_text(streamed, monkeypatch):
    if not streamed:  # the two-decode path, for tokenizers without a DecodeStream
        monkeypatch.setattr("kestrel.engine.detokenizer._decode_stream", lambda context, skip: None)
    hf = tokenizer()
    text = " naïve café — 日本語 and emoji 🎉 done"
    output = hf.encode(text)
    detokenizer = IncrementalDetokenizer(hf, hf.encode("Prompt:"), skip_special_tokens=True)
    assert (detokenizer._stream is not None) == streamed
    pieces = [detokenizer.push(token) for token in output]
    assert "".join(pieces) == hf.decode(output, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)  # never half a character
