"""Task generators: the answer is really in the text, at the stated depth and length, per seed."""

from __future__ import annotations

from localchat.bench.tasks import PASSKEY_FILLER, passkey, score_passkey


def _count(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_passkey_is_deterministic_and_placed(tiny_tok):
    a, b = passkey(tiny_tok, 2000, seed=3), passkey(tiny_tok, 2000, seed=3)
    assert a == b and passkey(tiny_tok, 2000, seed=4).answer != a.answer
    assert a.document.count(a.answer) == 2 and len(a.answer) == 5 and a.answer.isdigit()
    assert 1900 <= a.n_tokens <= 2000
    ids = tiny_tok(a.document, add_special_tokens=False)["input_ids"]
    assert tiny_tok.decode(ids[a.needle_token:]).startswith("The pass key is " + a.answer)
    filler = _count(tiny_tok, PASSKEY_FILLER)
    for depth in (0.0, 0.25, 0.5, 1.0):
        s = passkey(tiny_tok, 1000, seed=1, depth=depth)
        needle = _count(tiny_tok, f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key. ")
        assert abs(s.needle_token - depth * (s.n_tokens - needle)) <= filler


def test_passkey_scoring(tiny_tok):
    s = passkey(tiny_tok, 300, seed=0)
    assert score_passkey(s, f"The pass key is {s.answer}.") and not score_passkey(s, "I do not know.")
