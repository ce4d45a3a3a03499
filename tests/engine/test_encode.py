"""engine/encode.py: a long text tokenized in pieces gives the ids of one call."""

from __future__ import annotations

import random

import pytest

from localchat.engine import encode


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(encode, "PIECE", 2_000)
    monkeypatch.setattr(encode, "WINDOW", 64)


def _text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta,", "gamma.", "délta", "中文", "x", "42", "(paren)", "it's", "naïve"]
    seps = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n "]
    return "".join(rng.choice(words) + rng.choice(seps) for _ in range(n_words))


def test_pieces_give_the_ids_of_one_call(tiny_tok, small_pieces):
    text = _text(6_000)
    assert len(text) > 10 * encode.PIECE
    cuts = list(encode.cuts(tiny_tok, text))
    assert len(cuts) >= 8  # it did cut
    assert all(text[c] == " " for c in cuts)
    assert encode.encode(tiny_tok, text) == encode.ids(tiny_tok, text)


def test_smollm2s_tokenizer_in_pieces_at_the_real_piece_size():
    from transformers import AutoTokenizer

    from localchat.engine.default_model import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    text = _text(60_000, seed=1)
    assert len(text) > 4 * encode.PIECE
    assert len(list(encode.cuts(tok, text))) >= 3
    assert encode.encode(tok, text) == encode.ids(tok, text)


def test_a_tokenizer_whose_tokens_cross_spaces_is_not_cut_there(small_pieces):
    """A BPE without a pre-tokenizer merges across spaces ("x " is one token): the window check refuses a cut that
    would split such a token, and the ids stay those of one call."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"x": 0, " ": 1, "y": 2, "x ": 3}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("x", " ")]))
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    text = "x y " * 3_000
    cuts = list(encode.cuts(tok, text))
    assert cuts and all(text[c - 1] == "y" for c in cuts)  # never inside an "x " token
    assert encode.encode(tok, text) == encode.ids(tok, text)
    assert list(encode.cuts(tok, "x " * 6_000)) == []  # no cut that keeps the tokens: one call


def test_a_short_text_is_one_call(tiny_tok, small_pieces, monkeypatch):
    calls = []
    monkeypatch.setattr(encode, "ids", lambda tok, text: calls.append(text) or [1])
    encode.encode(tiny_tok, "a b " * 400)  # 1,600 characters: under two pieces
    assert len(calls) == 1


def test_the_benchs_answer_tokens_read_offsets_piece_by_piece(tiny_tok, small_pieces):
    """bench/cell.py's answer_tokens (which prompt tokens hold the answer) gives the indices of one offsets call,
    from the encoder's pieces (a 1M-token prompt's offsets in one call took hundreds of MB)."""
    from localchat.bench.cell import answer_tokens

    text = _text(3_000, seed=2)
    text = text[:9_000] + " the key is 4242917 " + text[9_000:] + " and 4242917 again"
    ids = encode.encode(tiny_tok, text)
    assert len(list(encode.cuts(tiny_tok, text))) >= 3
    enc = tiny_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = [(i, i + 7) for i in (text.find("4242917"), text.rfind("4242917"))]
    want = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and b > s for s, e in spans)]
    assert len(want) == 14 and answer_tokens(tiny_tok, text, ids, ("4242917",)) == want
    assert answer_tokens(tiny_tok, text, ids[:-1], ("4242917",)) == []  # ids that are not this text's
