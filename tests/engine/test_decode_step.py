"""engine/decode_step.py: a decoded token without transformers' forward gives transformers' logits and cache."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHITECTURES, read_attached, tiny_architecture, tiny_tokenizer

from localchat.engine import decode_step
from localchat.engine.decode_step import DecodeStep
from localchat.engine.engine import Decoding, Engine
from localchat.engine.events import Done
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.prefill import forward
from localchat.engine.sampling import GenerationSettings
from localchat.kernels import cpu_decode

LEAN = ["llama", "mistral", "qwen2", "qwen3"]  # Llama's layer layout; Phi-3 fuses q/k/v and keeps transformers'


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _locret(model):
    heads = RetainingHeads.random(model, d_r=32)
    return make_policy("locret", budget=48, stabilizers=8, local=8, decode_window=4, heads=heads)


PATHS = decode_step.WAYS  # a C++ call per layer; C++ attention and norms between torch ops; torch only


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", LEAN)
def test_a_step_gives_transformers_logits_and_cache(arch, path, tok):
    """Steps after a LOCRET read at compact positions (so RoPE slots, not true positions): logits, keys, values,
    positions and the retaining heads' scores of the new units as transformers' forward leaves them, step after
    step, on each way through a step (Qwen3's per-head q/k norms keep torch's ops)."""
    assert cpu_decode.kernels() is not None, cpu_decode.reason()  # the C++ kernels must build here
    model = tiny_architecture(arch, len(tok))
    engine = Engine(model, tok, chunk=32, policy=_locret(model))
    ids = torch.randint(3, len(tok) - 3, (1, 200), generator=torch.Generator().manual_seed(1))
    ours, _ = read_attached(engine, model, ids)
    theirs, _ = read_attached(engine, model, ids)
    assert decode_step.supported(model, ours)
    policy = engine.policy
    lean = DecodeStep(model, ours, on_qkv=policy.qkv_sink(), way=path)
    assert lean.took == ("torch" if arch == "qwen3" else path)
    for i, token in enumerate([5, 17, 9, 40]):
        step = torch.tensor([[token]])
        a = lean.step(step, 200 + i)  # q/k/v reach the retaining heads through `qkv_sink`
        policy._flush(ours)
        b = forward(model, theirs, step, 200 + i)  # through the hooked projections
        policy._flush(theirs)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.values, y.values, rtol=1e-5, atol=1e-6)
        assert torch.equal(x.positions, y.positions)
        assert x.scores[:, -4:].abs().sum() > 0  # the decoded units were scored
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)
    policy.detach()


@pytest.mark.parametrize(("policy", "arch"), [  # H2O cannot serve gpt-oss (its sinks): the policy matrix checks that
    (p, a) for p in ("locret", "sirllm", "full", "h2o") for a in sorted(ARCHITECTURES) if (p, a) != ("h2o", "gpt_oss")])
def test_the_engine_answers_the_same_with_and_without_it(arch, policy, tok, monkeypatch):
    """Whole answers, greedy, with evictions while decoding: the same tokens either way. It runs where it can
    (Llama-layout models on the plain cache with plain SDPA), and never for a policy that switched the attention
    function (H2O) or for Phi-3's fused projections."""
    model = tiny_architecture(arch, len(tok))
    steps = []
    real = DecodeStep.step
    monkeypatch.setattr(DecodeStep, "step", lambda self, *a: steps.append(1) or real(self, *a))
    answers = {}
    for lean in (True, False):
        built = _locret(model) if policy == "locret" else make_policy(policy, **({} if policy == "full" else
                                                                                 {"budget": 48, "local": 8}))
        engine = Engine(model, tok, chunk=32, policy=built, decoding=Decoding(lean=lean))
        ids = engine.encode("the quick brown fox jumps over the lazy dog " * 8)
        *_, done = engine.generate(ids, GenerationSettings(max_new_tokens=20, ignore_eos=True))
        assert isinstance(done, Done) and done.new_tokens == 20
        answers[lean] = (done.text, done.kv_tokens)
    assert answers[True] == answers[False]
    expected = 19 if arch in LEAN and policy != "h2o" else 0  # the first token comes from the prefill
    assert len(steps) == expected


def test_a_quantized_cache_keeps_its_fused_decode(tok):
    model = tiny_architecture("llama", len(tok))
    engine = Engine(model, tok, chunk=32, kv="int8", policy=make_policy("streaming", budget=48, local=8))
    assert not decode_step.supported(model, engine.new_cache(100, 4))


def test_packed_int4_layers_give_the_forward_logits(tok):
    """int4 weights (engine/packed_store.py) through the whole-layer C++ step (on AVX2 CPUs its q/k/v and gate/up
    products in one parallel region each): transformers' forward through the same packed layers, step after
    step."""
    from localchat.engine import packed_store
    from localchat.kernels.packed import PackedLinear

    native = cpu_decode.kernels()
    assert native is not None, cpu_decode.reason()
    model = tiny_architecture("llama", len(tok))
    packed_store.pack(model, 4)
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    engine = Engine(model, tok, chunk=32, policy=_locret(model))
    ids = torch.randint(3, len(tok) - 3, (1, 150), generator=torch.Generator().manual_seed(2))
    ours, _ = read_attached(engine, model, ids)
    theirs, _ = read_attached(engine, model, ids)
    policy = engine.policy
    lean = DecodeStep(model, ours, on_qkv=policy.qkv_sink())
    assert lean.took == "layers"
    for i, token in enumerate([5, 17, 9]):
        a = lean.step(torch.tensor([[token]]), 150 + i)
        policy._flush(ours)
        b = forward(model, theirs, torch.tensor([[token]]), 150 + i)
        policy._flush(theirs)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)
    policy.detach()
