"""engine/graph_step.py: the fixed-shape decode step gives transformers' logits and cache, on the plain and the
quantized cache, through the twin and through the Triton kernel (interpreted on the CPU); on CUDA it is captured
and replayed. Off CUDA the body runs eagerly: the same code the graph records."""

from __future__ import annotations

import pytest
import torch
from tiny import read_attached, tiny_architecture, tiny_tokenizer

from localchat.engine import graph_step
from localchat.engine.engine import Decoding, Engine
from localchat.engine.events import Done, Notice
from localchat.engine.graph_step import GraphStep
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.prefill import forward
from localchat.engine.qattention import FusedDecode
from localchat.engine.sampling import GenerationSettings

LEAN = ["llama", "qwen2", "qwen3"]  # Llama's layout, q/k/v biases, per-head q/k norms (Mistral's is Llama's)
GRAPH = [*LEAN, "phi3"]  # and Phi-3's q/k/v and gate/up projections in one each


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _locret(model, decode_window: int = 0):
    heads = RetainingHeads.random(model, d_r=32)
    return make_policy("locret", budget=48, stabilizers=8, local=8, decode_window=decode_window, heads=heads)


def _steps(arch, tok, kv="none", positions="compact", residual=None, tokens=(5, 17, 9, 40, 3, 11), made=None,
           **settings):
    """Decode `tokens` on two copies of one LOCRET read: through GraphStep (eagerly; `settings`: its keywords) and
    through transformers' forward with the retaining heads' hooks; assert logits, then return both caches (the
    step appended to `made`)."""
    model = tiny_architecture(arch, len(tok))
    engine = Engine(model, tok, chunk=32, policy=_locret(model), kv=kv, positions=positions)
    ids = torch.randint(3, len(tok) - 3, (1, 200), generator=torch.Generator().manual_seed(1))
    ours, theirs = read_attached(engine, model, ids)[0], read_attached(engine, model, ids)[0]
    policy = engine.policy
    if residual is not None:  # the tail is quantized within a few steps
        for layer in [*ours.layers, *theirs.layers]:
            layer.residual = residual
    assert graph_step.why_not(model, ours, policy.unit_heads()) is None
    step = GraphStep(model, ours, heads=policy.unit_heads(), **settings)
    assert not step.capture and step.fused == settings.get("fused", True)  # a CPU model: eager, the fused ops' twins
    if made is not None:
        made.append(step)
    fused = FusedDecode(model, theirs) if kv != "none" else None
    for i, token in enumerate(tokens):
        a = step.step(token, 200 + i)
        b = forward(model, theirs, torch.tensor([[token]]), 200 + i)  # q/k/v reach the heads through the hooks
        policy._flush(theirs)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    if fused is not None:
        fused.close()
    policy.detach()
    return ours, theirs


@pytest.mark.parametrize("arch", GRAPH)
def test_a_step_gives_transformers_logits_and_cache(arch, tok):
    """Steps after a LOCRET read at compact positions (RoPE at slots, not true positions): logits, keys, values,
    positions and the retaining heads' scores of the new units as transformers' forward leaves them."""
    ours, theirs = _steps(arch, tok)
    for x, y in zip(ours.layers, theirs.layers):
        assert x.n == y.n
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.values, y.values, rtol=1e-5, atol=1e-6)
        assert torch.equal(x.positions, y.positions)
        assert x.scores[:, -6:].abs().sum() > 0  # the decoded units were scored inside the step
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)


def test_the_step_op_by_op(tok):
    """`fused=False`: the norms, RoPE and SiLU product op by op, and no joined products; the same logits and
    scores as transformers' forward."""
    made = []
    ours, theirs = _steps("llama", tok, tokens=(5, 17, 9), made=made, fused=False)
    assert made[0].qkv == [None] * len(made[0].qkv) and made[0].gemv_down == [None] * len(made[0].gemv_down)
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)


def test_q_k_v_and_gate_up_become_one_product_over_the_models_own_weights(tok):
    """Plain linear layers: one weight each for q/k/v and gate/up, the model's parameters re-pointed into it (no
    second copy; the model's own forward reads the same numbers), joined once for every later step."""
    model = tiny_architecture("qwen2", len(tok))  # q/k/v with biases
    attn = model.model.layers[0].self_attn
    before = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).clone()
    engine = Engine(model, tok, chunk=32, policy=_locret(model))
    cache = read_attached(engine, model, torch.randint(3, len(tok) - 3, (1, 80)))[0]
    step = GraphStep(model, cache, heads=engine.policy.unit_heads())
    weight, bias = step.qkv[0]
    assert torch.equal(weight, before) and bias is not None
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert step.gate_up[1][0].shape[0] == 2 * model.config.intermediate_size
    assert GraphStep(model, cache, heads=engine.policy.unit_heads()).qkv[0][0] is weight  # joined once
    engine.policy.detach()


def test_original_positions(tok):
    """A policy that keeps true positions: the step's RoPE takes the true position, not the slot."""
    ours, theirs = _steps("llama", tok, positions="original")
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-6)
        assert torch.equal(x.positions, y.positions)


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_the_quantized_cache(kv, tok):
    """The int8/int4 cache: the new unit enters the full-precision tail, attention reads the packed part and the
    tail; with a tail of 3 units it is quantized twice within the six steps, as the cache's own update does."""
    ours, theirs = _steps("llama", tok, kv=kv, residual=3)
    for x, y in zip(ours.layers, theirs.layers):
        assert (x.n, x.nq) == (y.n, y.nq) and x.nq > 48  # the tail was quantized while decoding
        for name, t in x.quantized().items():
            assert torch.equal(t, y.quantized()[name]), name
        torch.testing.assert_close(x.keys, y.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)
        assert torch.equal(x.positions, y.positions)


@pytest.mark.parametrize("kv,way", [("none", "group"), ("int4", "group"), ("int4", "dot")])
def test_the_triton_kernel_in_the_step(kv, way, tok, triton_kernels):
    """The step's Triton kernels (interpreted), the retaining heads' one included, with the split kernel's grouped
    way and its tensor-core way: logits, and the new units' scores as the heads' hooks give them."""
    from localchat.kernels import qattn

    ours, theirs = _steps("llama", tok, kv=kv, residual=2 if kv != "none" else None, tokens=(5, 17, 9),
                          split=qattn.Split(way=way))
    for x, y in zip(ours.layers, theirs.layers):
        assert x.scores[:, -3:].abs().sum() > 0
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_the_gemvs_in_the_step(arch, tok, triton_kernels):
    """`gemv=True`: each norm inside the product that reads it and the SiLU product inside the down
    projection (Triton GEMVs, interpreted); the same logits and scores as transformers' forward with the heads'
    hooks. Phi-3's own q/k/v and gate/up projections serve as they are."""
    made = []
    ours, theirs = _steps(arch, tok, tokens=(5, 17, 9), made=made, gemv=True)
    step = made[0]
    assert all(w is not None for w in [*step.gemv_qkv, *step.gemv_gate_up, *step.gemv_down])
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.scores, y.scores, rtol=1e-4, atol=1e-5)


def test_what_keeps_a_model_from_the_step(tok):
    model = tiny_architecture("llama", len(tok))
    engine = Engine(model, tok, chunk=32, policy=_locret(model))
    ids = torch.randint(3, len(tok) - 3, (1, 100), generator=torch.Generator().manual_seed(1))
    cache = read_attached(engine, model, ids)[0]
    heads = engine.policy.unit_heads()
    assert graph_step.why_not(model, cache, heads) is None
    assert "watches model.layers.0.self_attn.q_proj" in graph_step.why_not(model, cache, None)  # hooks, no heads
    engine.policy.detach()
    assert graph_step.why_not(model, cache.empty(), None) == "an empty cache"
    cache.layers[1].n -= 1
    assert graph_step.why_not(model, cache, None) == "layers hold different counts of units"
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=16,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert "not Llama's" in graph_step.why_not(gemma, cache, None)
    phi = tiny_architecture("phi3", len(tok))
    phi.config.partial_rotary_factor = 0.5
    assert graph_step.why_not(phi, cache, None) == "RoPE on part of each head"


ON_CPU = Decoding(graph_devices=("cuda", "cpu"))  # the captured path taken on the CPU too (its body runs eagerly)


@pytest.mark.parametrize("policy", ["locret", "sirllm", "h2o", "full"])
def test_the_engine_answers_the_same_through_it(policy, tok, monkeypatch):
    """Whole answers, greedy, two turns of a chat on one cache: the same tokens as the CPU's ways. LOCRET and
    full attention take the step (a chat's second turn replays the first turn's); SirLLM (a hook on the final
    norm) and H2O (its own attention function) decode eagerly and say why, once. LOCRET evicts while decoding
    (a decode window of 4), between replays."""
    model = tiny_architecture("llama", len(tok))
    built = {"locret": lambda: _locret(model, decode_window=4), "full": lambda: make_policy("full")}.get(
        policy, lambda: make_policy(policy, budget=48, local=8))
    made = []
    real_init = GraphStep.__init__
    monkeypatch.setattr(GraphStep, "__init__", lambda self, *a, **k: made.append(1) or real_init(self, *a, **k))
    answers, notices = {}, {}
    for graph in (True, False):
        engine = Engine(model, tok, chunk=32, policy=built(), decoding=ON_CPU if graph else Decoding())
        cache, pos, texts, said = None, 0, [], []
        for turn in ("the quick brown fox jumps over the lazy dog " * 8, "and then what happened next?"):
            ids = engine.encode(turn)
            cache = cache or engine.new_cache(len(ids), 12)
            events = list(engine.continue_on(cache, ids, pos, GenerationSettings(max_new_tokens=12, ignore_eos=True),
                                             keep_last=True))
            done = events[-1]
            assert isinstance(done, Done) and done.new_tokens == 12
            texts.append(done.text)
            said += [e.message for e in events if isinstance(e, Notice)]
            pos += len(ids) + done.new_tokens
        answers[graph], notices[graph] = texts, said
    assert answers[True] == answers[False]
    assert notices[False] == []
    if policy in ("locret", "full"):
        assert notices[True] == [] and len(made) == 1  # one step for both turns of the chat
    else:
        assert len(made) == 0
        assert len(notices[True]) == 1 and notices[True][0].startswith("decoding eagerly: ")
        assert ("model.norm" if policy == "sirllm" else "own function") in notices[True][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (tools/gpu runs this)")
@pytest.mark.parametrize("kv", ["none", "int8"])
def test_the_captured_step_replays_the_eager_one(kv, tok):
    """On CUDA: the graph's logits and cache equal the eager body's, step after step, across a re-capture when
    the cache grows past its capacity."""
    model = tiny_architecture("llama", len(tok)).cuda().to(torch.bfloat16)
    engine = Engine(model, tok, chunk=32, policy=_locret(model), kv=kv)
    ids = torch.randint(3, len(tok) - 3, (1, 200), generator=torch.Generator().manual_seed(1)).cuda()
    ours, theirs = read_attached(engine, model, ids)[0], read_attached(engine, model, ids)[0]
    heads = engine.policy.unit_heads()
    captured, eager = GraphStep(model, ours, heads), GraphStep(model, theirs, heads, capture=False)
    assert captured.capture
    for i in range(80):  # past the first allocation's room: a re-capture
        a, b = captured.step(i % 50 + 3, 200 + i), eager.step(i % 50 + 3, 200 + i)
        assert captured.reason is None and captured.graph is not None
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.scores, y.scores, rtol=2e-2, atol=2e-2)
        assert torch.equal(x.positions, y.positions)


def test_the_engine_keeps_no_finished_cache(tok, monkeypatch):
    """The engine keeps its last step for a chat's next turn, but not the cache of a chat that is gone."""
    import gc
    import weakref

    engine = Engine(tiny_architecture("llama", len(tok)), tok, chunk=32, policy=make_policy("full"), decoding=ON_CPU)
    ids = engine.encode("hello there " * 10)
    cache = engine.new_cache(len(ids), 4)
    *_, done = engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=4, ignore_eos=True))
    assert isinstance(done, Done) and engine._graph is not None and engine._graph.cache is cache
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None and engine._graph.cache is None


def _nf4(model):
    """The model's layers' projections as bitsandbytes nf4 layers (bf16 compute), quantized on the CPU."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, quant_type="nf4")
                    q.load_state_dict(child.state_dict())
                    setattr(parent, name, q.to("cpu"))
    return model


@pytest.mark.parametrize("weights", ["bf16", "nf4"])
def test_bf16_and_nf4_weights(weights, tok):
    """The step's body over bf16 weights and over bitsandbytes' nf4 layers (what a GPU runs, here on the CPU):
    the logits of transformers' forward, within bf16's rounding."""
    model = tiny_architecture("llama", len(tok)).to(torch.bfloat16)
    if weights == "nf4":
        model = _nf4(model)
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    engine = Engine(model, tok, chunk=32, policy=_locret(model))
    ids = torch.randint(3, len(tok) - 3, (1, 120), generator=torch.Generator().manual_seed(1))
    ours, theirs = read_attached(engine, model, ids)[0], read_attached(engine, model, ids)[0]
    policy = engine.policy
    step = GraphStep(model, ours, heads=policy.unit_heads())
    for i, token in enumerate((5, 17, 9)):
        a = step.step(token, 120 + i).float()
        b = forward(model, theirs, torch.tensor([[token]]), 120 + i).float()
        policy._flush(theirs)
        assert ((a - b).norm() / b.norm()).item() < 2e-2
        assert a.argmax() == b.argmax()
    for x, y in zip(ours.layers, theirs.layers):
        torch.testing.assert_close(x.scores, y.scores, rtol=2e-2, atol=2e-2)
    policy.detach()
