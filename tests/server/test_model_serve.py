"""The real SmolLM2 with LOCRET behind the server: a conversation about a document, its second turn after a
restart, served from the saved compressed cache."""

from __future__ import annotations

import openai
import pytest

from localchat.bench.tasks import as_document, passkey, score_passkey
from localchat.engine.sampling import GenerationSettings
from localchat.planning.load import policy_for
from localchat.render import user_turn
from localchat.server.app import HEADER

pytestmark = pytest.mark.model


@pytest.fixture()
def locret(smollm2):
    before = smollm2.policy, smollm2.positions
    smollm2.set_policy(policy_for(smollm2, "locret", budget=512))
    yield smollm2
    smollm2.set_policy(*before)


def ask(service, messages):
    c = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=messages, max_tokens=16)
    return raw.parse(), raw.headers[HEADER]


def test_a_document_is_read_once_across_two_turns_and_a_restart(serve, locret):
    sample = passkey(locret.tokenizer, 2000, seed=11, depth=0.4)
    question = [{"role": "user", "content": user_turn("What is the pass key?", [as_document(sample.document)])}]
    service = serve(locret, defaults=GenerationSettings(max_new_tokens=16))
    first, name = ask(service, question)
    assert sample.answer in first.choices[0].message.content
    assert first.usage.prompt_tokens > 2000 and first.usage.prompt_tokens_details.cached_tokens == 0
    service.stop()

    restarted = serve(locret, defaults=GenerationSettings(max_new_tokens=16))
    follow = question + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Say the pass key once more."}]
    second, again = ask(restarted, follow)
    assert again == name
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the document came from the saved cache
    assert second.usage.prompt_tokens - cached < 40  # only the new question was read
    assert sample.answer in second.choices[0].message.content


@pytest.mark.slow
def test_eight_clients_on_eight_documents_each_get_their_own_pass_key(serve, locret):
    from concurrent.futures import ThreadPoolExecutor

    service = serve(locret, defaults=GenerationSettings(max_new_tokens=16), waiting=8, keep=3)
    samples = [passkey(locret.tokenizer, 800, seed=100 + i, depth=0.5) for i in range(8)]

    def client(i: int):
        question = [{"role": "user", "content": user_turn("What is the pass key?", [as_document(samples[i].document)])}]
        first, name = ask(service, question)
        follow = question + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "Say the pass key once more."}]
        second, again = ask(service, follow)
        return name, again, first.choices[0].message.content, second

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    assert len({name for name, *_ in results}) == 8
    for sample, (name, again, first, second) in zip(samples, results):
        assert again == name and sample.answer in first
        assert second.usage.prompt_tokens_details.cached_tokens > 800
        assert sample.answer in second.choices[0].message.content


def test_gemma3_reads_a_document_once_across_a_restart(serve):
    """The real Gemma 3 270M (a base model: the card's plain layout and its stop) behind the server with the card's
    policy (SirLLM b=512, original positions): the follow-up after a restart comes from the saved cache."""
    from localchat.engine.cards import find_card
    from localchat.engine.engine import Engine
    from localchat.engine.policies import make_policy

    card = find_card("gemma3-270m")
    gemma = Engine.load("gemma3-270m")
    gemma.set_policy(make_policy("sirllm", budget=512), positions="original")
    defaults = GenerationSettings(max_new_tokens=12, stop=card.stop)
    sample = passkey(gemma.tokenizer, 2000, seed=5)
    question = [{"role": "user", "content": user_turn(sample.question, [as_document(sample.document)])}]
    service = serve(gemma, defaults=defaults)
    first, name = ask(service, question)
    assert first.usage.prompt_tokens > 2000 and "\n" not in first.choices[0].message.content
    assert score_passkey(sample, first.choices[0].message.content), (sample.answers, first.choices[0].message.content)
    service.stop()
    restarted = serve(gemma, defaults=defaults)
    follow = question + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Say the pass key once more."}]
    second, again = ask(restarted, follow)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert again == name and cached >= first.usage.prompt_tokens and second.usage.prompt_tokens - cached < 40
