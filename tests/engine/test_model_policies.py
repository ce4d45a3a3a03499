"""SAGE-KV, OmniKV, RoCo and CORM on the real SmolLM2-135M-Instruct: each finds a pass key in a 4K document
within its budget.

The budgets are where each method answers on this 135M model (checked by hand, seed 5): at b=512 with the
needle mid-document only OmniKV and LOCRET do (see bench/results/policies-smollm2-cpu). SAGE-KV needs 3072
(its last-token selection misses digits of the key below that), RoCo 2048. CORM's rule runs once the prompt
is in (the last 256 prompt queries vote), but at 4K it wants most of the cache per head and the cap ranks by
votes, which the filler wins; it keeps a needle the recent queries still see (depth 0.95).
"""

from __future__ import annotations

import pytest

from localchat.bench.tasks import passkey, prompt_messages, score_passkey
from localchat.cli import main
from localchat.engine.events import Done, Token
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings

pytestmark = [pytest.mark.model, pytest.mark.slow]

NEW = 12
LOCAL = 96


def test_omnikv_answers_through_ask_reading_512_units_per_sparse_layer(smollm2, tmp_path, capsys):
    sample = passkey(smollm2.tokenizer, 4000, seed=5, depth=0.5)
    doc = tmp_path / "doc.txt"
    doc.write_text(sample.document)
    argv = ["ask", "--file", str(doc), "--policy", "omnikv", "--budget", "512", "--max-new-tokens", "16",
            "--stats", "What is the pass key? Answer with the number only."]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert score_passkey(sample, out), out
    assert int(err.split("kept ")[1].split(" units")[0].replace(",", "")) > sample.n_tokens  # nothing dropped


def test_omnikv_sparse_prefill_answers_through_ask(smollm2, tmp_path, capsys):
    """docs/methods/omnikv.md §2.8: reading too, the sparse layers see only 2 x 512 earlier tokens the filter
    layers chose."""
    sample = passkey(smollm2.tokenizer, 4000, seed=5, depth=0.5)
    doc = tmp_path / "doc.txt"
    doc.write_text(sample.document)
    argv = ["ask", "--file", str(doc), "--policy", "omnikv", "--budget", "512", "--sparse-prefill", "2",
            "--max-new-tokens", "16", "What is the pass key? Answer with the number only."]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert score_passkey(sample, out), out


@pytest.mark.parametrize(("name", "budget", "depth"), [("sagekv", 3072, 0.5), ("roco", 2048, 0.5), ("corm", 1024, 0.95)])
def test_policy_finds_the_pass_key_at_4k_within_its_budget(smollm2, name, budget, depth):
    sample = passkey(smollm2.tokenizer, 4000, seed=5, depth=depth)
    before = smollm2.policy, smollm2.positions
    smollm2.set_policy(make_policy(name, budget=budget, local=LOCAL))
    try:
        events = list(smollm2.chat(prompt_messages(sample), GenerationSettings(max_new_tokens=NEW)))
    finally:
        smollm2.set_policy(*before)
    answer = "".join(e.text for e in events if isinstance(e, Token))
    done = events[-1]
    assert isinstance(done, Done) and score_passkey(sample, answer), answer
    assert done.kv_tokens <= budget + (LOCAL + NEW if name == "roco" else 0) < sample.n_tokens
