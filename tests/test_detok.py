"""Incremental detokenization (helpers/server/tokens.py): the streamed pieces add up to the
full decode, a character split over tokens comes out whole, and each token decodes a window of
bounded size however long the answer."""

import random

import pytest

from helpers import load_tokenizer
from helpers.server.tokens import IncrementalDecoder


@pytest.fixture(scope="module")
def tokenizer():
    """The bundled model's tokenizer (byte-level BPE: some tokens are single bytes)."""
    return load_tokenizer()


def stream(tokenizer, ids, **kwargs):
    decoder = IncrementalDecoder(tokenizer, **kwargs)
    pieces = [decoder.add(token) for token in ids]
    return decoder, pieces


@pytest.mark.parametrize("seed", range(5))
def test_pieces_add_up_to_the_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(120)]   # every kind of token, bytes too
    decoder = IncrementalDecoder(tokenizer)
    for n, token in enumerate(ids, start=1):
        decoder.add(token)
        full = tokenizer.decode(ids[:n])
        # What was handed out is final: the full decode starts with it, and it never ends
        # inside a character.
        assert full.startswith(decoder.text)
        assert not decoder.text.endswith("\ufffd") or full == decoder.text
    decoder.flush()
    assert decoder.text == tokenizer.decode(ids)
    assert decoder.ids == ids and decoder.pending == 0


def test_an_ordinary_answer_comes_out_token_by_token(tokenizer):
    ids = tokenizer("The quick brown fox jumped over the lazy dog.")["input_ids"]
    decoder, pieces = stream(tokenizer, ids)
    assert all(pieces)                                    # no token held back
    assert pieces == [tokenizer.decode(ids[:n + 1])[len(tokenizer.decode(ids[:n])):]
                      for n in range(len(ids))]
    assert decoder.flush() == ""


def test_a_character_split_over_tokens_comes_out_whole(tokenizer):
    ids = tokenizer("a 🙂 b")["input_ids"]
    smile = tokenizer("🙂")["input_ids"]
    assert len(smile) > 1, "the emoji should take several byte tokens"
    decoder, pieces = stream(tokenizer, ids)
    assert "🙂" in pieces or " 🙂" in pieces              # in one piece, never in halves
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_an_incomplete_character_is_held_back_then_flushed(tokenizer):
    smile = tokenizer("🙂")["input_ids"]
    decoder, pieces = stream(tokenizer, smile[:-1])
    assert pieces == [""] * (len(smile) - 1) and decoder.pending == len(smile) - 1
    rest = decoder.flush()                               # the answer ended there
    assert rest == tokenizer.decode(smile[:-1]) and rest.endswith("\ufffd")
    assert decoder.flush() == ""


def test_special_tokens_can_be_skipped(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer("Jack and Jill")["input_ids"] + [eos]
    assert stream(tokenizer, ids)[0].text.endswith(tokenizer.decode([eos]))
    skipped, pieces = stream(tokenizer, ids, skip_special_tokens=True)
    assert pieces[-1] == "" and skipped.flush() == ""
    assert skipped.text == tokenizer.decode(ids, skip_special_tokens=True)


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_token_decodes_a_small_window_however_long_the_answer(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer("The rain in Spain falls mainly on the plain. " * 20)["input_ids"]
    assert len(ids) > 150
    decoder, _ = stream(counting, ids)
    assert decoder.text == tokenizer.decode(ids)
    assert len(counting.sizes) == 2 * len(ids)           # two small decodes per token
    assert max(counting.sizes) <= 4                      # not the whole answer


@pytest.mark.parametrize("bad", [-1, 1.5, "3", None, True])
def test_a_bad_token_is_refused(tokenizer, bad):
    with pytest.raises(ValueError, match="a token must be a non-negative integer id"):
        IncrementalDecoder(tokenizer).add(bad)


def test_a_tokenizer_without_decode_is_refused():
    with pytest.raises(ValueError, match="the tokenizer must have a decode method"):
        IncrementalDecoder(object())
