"""Every registered policy on every architecture the engine supports: one registry row enrols a policy here.

Architectures are tiny random models built from the real configs in tests/data/configs (Llama-3.1: q/k/v
projections; Qwen2.5: q/k/v biases; Phi-3: one fused qkv projection) or transformers' own configs (Mistral;
Qwen3: q/k norms), shrunk to two layers; and the hybrids (tests/tiny.py HYBRIDS), four layers of their patterns:
Gemma 3's sliding and global layers, gpt-oss's with sinks, Qwen3.5's gated linear-attention layers (from the real
configs of Gemma-3-12B-IT, gpt-oss-20b and Qwen3.6-27B), Qwen3-Next's and SmolLM3's layers without RoPE
(transformers' own configs).
A policy that cannot serve a hybrid is refused in one line. Each policy reads
a 1.4K-token document in chunks and answers, then answers a follow-up on the same session (the compressed
cache carried across turns): both turns finish, an evicting policy's cache stays inside its bound, and the
follow-up reads only its own tokens.
"""

from __future__ import annotations

import pytest
from tiny import ARCHITECTURES, HYBRIDS, tiny_architecture, tiny_tokenizer

from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.heads import RetainingHeads
from localchat.engine.kvzap_scorer import KVzapScorer
from localchat.engine.layer_kinds import has_sinks, hybrid
from localchat.engine.policies import POLICIES, make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.session import Session

BUDGET, LOCAL, CHUNK = 96, 16, 128


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


CORE = ("full", "locret", "kvzap", "sirllm", "streaming", "omnikv")  # on the hybrids by default; the others with -m slow
PAIRS = [pytest.param(arch, name, marks=[pytest.mark.slow] if arch in HYBRIDS and name not in CORE else [])
         for arch in sorted(ARCHITECTURES) for name in sorted(POLICIES)]
_MODELS: dict[str, object] = {}


def _model(arch: str, tok):
    if arch not in _MODELS:
        _MODELS.clear()  # one architecture at a time (PAIRS are ordered by architecture)
        _MODELS[arch] = tiny_architecture(arch, len(tok))
    return _MODELS[arch]


def build(name: str, model):
    cls = POLICIES[name]
    scorer = KVzapScorer.random(model, hidden_dim=8) if name == "kvzap" else RetainingHeads.random(model, d_r=32)
    extra = {"heads": scorer} if "heads" in cls.fields() else {}
    settings = {"budget": BUDGET, "local": LOCAL} if cls.uses_budget() else {}
    if "stabilizers" in cls.fields():
        settings["stabilizers"] = BUDGET // 4
    return make_policy(name, **settings, **extra)


@pytest.mark.parametrize(("arch", "name"), PAIRS)
def test_every_policy_reads_and_follows_up_on_every_architecture(arch, name, tok):
    model = _model(arch, tok)
    engine = Engine(model, tok, chunk=CHUNK)
    policy = build(name, model)
    if not policy.hybrid and hybrid(engine.kinds):  # refused in one line, before anything is read
        with pytest.raises(UserError, match=f"^{name} cannot serve .*layers\\); choose another --policy"):
            engine.set_policy(policy)
        return
    if policy.attention_function and has_sinks(model.config):  # gpt-oss: SDPA cannot compute its sinks
        with pytest.raises(UserError, match=f"^{name} cannot serve .*attention sinks; choose another --policy"):
            engine.set_policy(policy)
        return
    engine.set_policy(policy)
    session = Session(engine)
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    document = "The quick brown fox jumps over the lazy dog. " * 32
    first = list(session.send(f"{document}\nWhat jumps?", settings=settings))[-1]
    assert isinstance(first, Done), first
    assert first.prompt_tokens > 1400 and first.new_tokens == 4
    second = list(session.send("And then?", settings=settings))[-1]
    assert isinstance(second, Done), second
    assert second.prompt_tokens < 40  # the follow-up reads its own tokens, not the document again
    if policy.bounded():
        assert first.kv_tokens <= BUDGET + LOCAL + first.new_tokens + policy.decode_window
        assert second.kv_tokens <= BUDGET + LOCAL + second.new_tokens + policy.decode_window
    elif not policy.evicts:
        assert second.kv_tokens == session.fed  # every token the conversation has put through
