"""The `ollama` package as the client: chat streamed (its default) and not, the model list and card."""

from __future__ import annotations

import ollama
import pytest

DOC = "The lighthouse keeper logs every ship. " * 10 + "The pass key is 70514. " + "Gulls nest on the rocks. " * 10


def test_tags_and_show_describe_the_model(serve):
    c = ollama.Client(host=serve().url)
    assert [m.model for m in c.list().models] == ["tiny"]
    card = c.show("tiny")
    assert card.details.family == "llama" and card.modelinfo["general.parameter_count"] > 0


def test_chat_streamed_and_not_and_a_follow_up_from_the_cache(serve):
    c = ollama.Client(host=serve().url)
    first_q = [{"role": "user", "content": f"Read: {DOC}\nWhat is the pass key?"}]
    whole = c.chat(model="tiny", messages=first_q, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count > 0
    parts = list(c.chat(model="tiny", messages=first_q, stream=True))  # asked again: answered again
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts][-1] is True and parts[-1].prompt_eval_count == whole.prompt_eval_count
    follow = first_q + [{"role": "assistant", "content": whole.message.content},
                        {"role": "user", "content": "Who nests there?"}]
    second = c.chat(model="tiny", messages=follow, stream=False, options={"num_predict": 5, "temperature": 0})
    assert second.prompt_eval_count < 60 < whole.prompt_eval_count  # the document came from the cache
    assert second.eval_count <= 5


def test_ollama_errors_are_its_own_shape(serve):
    c = ollama.Client(host=serve().url)
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options={"temperature": "hot"})
    assert err.value.status_code == 400 and err.value.error == "`options.temperature` must be a number (got a string)"


def test_generate_answers_a_prompt(serve):
    c = ollama.Client(host=serve().url)
    whole = c.generate(model="tiny", prompt="Say hello.", system="Be brief.", stream=False)
    assert whole.done and whole.response and whole.prompt_eval_count > 0
    parts = list(c.generate(model="tiny", prompt="Say hello.", system="Be brief.", stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
