"""The chat window's main story on the real SmolLM2-135M-Instruct: paste a 20K-token file's path, ask for
the pass key, see the progress bar and the streamed answer, then a follow-up that does not re-read."""

from __future__ import annotations

import pytest
from tui_helpers import answers, chips, make_app, paste, record_events, run, settle, type_text, wait_for

from localchat.bench.tasks import passkey
from localchat.engine.events import Done, Progress
from localchat.engine.sampling import GenerationSettings
from localchat.tui.widgets.progress import PrefillProgress


def _document(path, sample):
    """`sample`'s document written to `path`: (sample, path)."""
    path.write_text(sample.document)
    return sample, path


async def _drop(app, pilot, path):
    """Paste `path` into the prompt as a user drops a file; the events seen from here on."""
    seen = record_events(app)
    await paste(pilot, f"'{path}'")
    await settle(pilot, timeout=60)
    return seen


@pytest.mark.model
@pytest.mark.slow
def test_twenty_thousand_token_pass_key_and_a_follow_up(smollm2, tmp_path):
    from localchat.planning.load import policy_for

    smollm2.set_policy(policy_for(smollm2, None))  # the default: LOCRET with the shipped heads
    assert smollm2.policy.name == "locret"
    sample, path = _document(tmp_path / "long notes.txt", passkey(smollm2.tokenizer, 20_000, seed=3, depth=0.5))

    async def scenario(app, pilot):
        seen = await _drop(app, pilot, path)
        assert chips(app) == [f"long notes.txt · {smollm2.count_tokens(sample.document):,} tokens ✕"]
        await type_text(pilot, sample.question)
        await wait_for(pilot, lambda: app.screen.query_one(PrefillProgress).display
                       and any(isinstance(e, Progress) for e in seen), timeout=120)
        await settle(pilot, timeout=900)
        first = [e for e in seen if isinstance(e, Done)][-1]
        assert first.stop_reason != "cancelled" and first.prompt_tokens > 19_000
        assert sum(isinstance(e, Progress) for e in seen) > 5
        assert sample.answer in answers(app)[0].text
        seen.clear()
        await type_text(pilot, "Thank you. Repeat the pass key once more.")
        await settle(pilot, timeout=300)
        second = [e for e in seen if isinstance(e, Done)][-1]
        assert second.prompt_tokens < 100 and second.new_tokens > 0  # the document was not read again
        assert second.ttft_s < first.ttft_s / 10
        assert len(answers(app)) == 2 and answers(app)[1].text.strip()

    run(scenario, make_app(smollm2, settings=GenerationSettings(max_new_tokens=24)))


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_answers_about_a_dropped_document_and_a_follow_up(tmp_path):
    """The chat window on the real Gemma 3 270M (a hybrid: 3 global and 15 sliding layers) with its card's policy:
    a 3K-token document's pass key, then a follow-up that reads only itself."""
    from localchat.engine.cards import find_card
    from localchat.engine.engine import Engine
    from localchat.engine.policies import make_policy

    gemma = Engine.load("gemma3-270m")
    gemma.set_policy(make_policy("sirllm", budget=512), positions="original")
    sample, path = _document(tmp_path / "notes.txt", passkey(gemma.tokenizer, 3000, seed=5))

    async def scenario(app, pilot):
        seen = await _drop(app, pilot, path)
        await type_text(pilot, sample.question)
        await settle(pilot, timeout=600)
        first = [e for e in seen if isinstance(e, Done)][-1]
        assert first.prompt_tokens > 2900 and first.kv_tokens < 700  # the global layers keep about 1/5 of 3K
        assert sample.answer in answers(app)[0].text
        seen.clear()
        await type_text(pilot, "Say the pass key once more.")
        await settle(pilot, timeout=300)
        second = [e for e in seen if isinstance(e, Done)][-1]
        assert second.prompt_tokens < 40 and second.new_tokens > 0

    stop = find_card("gemma3-270m").stop
    run(scenario, make_app(gemma, settings=GenerationSettings(max_new_tokens=12, stop=stop)))
