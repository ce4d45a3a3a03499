"""OmniKV --offload (engine/policies/omnikv/bank.py): the sparse layers' K/V in a host-side bank must give exactly the
answers of the in-memory OmniKV. On this CPU the bank shares the device's memory, so these tests check the
bookkeeping (what is banked, gathered, streamed and folded), not the CUDA copies."""

from __future__ import annotations

import argparse

import pytest
import torch
from tiny import tiny_llama

from localchat.engine.cache import KVCache, KVLayer
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Error
from localchat.engine.policies import make_policy
from localchat.engine.policies.omnikv import bank_groups, layer_roles
from localchat.engine.policies.omnikv.bank import Bank, BankLayer, bank_cache
from localchat.engine.prefill import forward, prefill
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.session import Session

FILTERS = (1,)  # 6 layers: dense, filter, dense (post-filter), sparse, sparse, sparse


def _model(tok_len=260):
    return tiny_llama(tok_len, layers=6, q_heads=4, kv_heads=2)


def _ids(n, seed=0):
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def _run(model, policy, cache, ids, first_pos, steps):
    """Prefill `ids` on `cache`, then feed `steps` fixed tokens; the logits of every step."""
    policy.attach(model, cache)
    gen = prefill(model, cache, ids, chunk=16, policy=policy, first_pos=first_pos)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        out = [stop.value]
    pos = first_pos + ids.shape[-1]
    for s in range(steps):
        out.append(forward(model, cache, _ids(1, seed=100 + s), pos))
        pos += 1
    policy.detach()
    return out


def test_groups_bank_the_sparse_layers_after_each_filter():
    roles = layer_roles(8, (1, 4))  # dense filter dense sparse filter dense sparse sparse
    assert bank_groups(roles) == {1: [3], 4: [6, 7]}
    assert make_policy("omnikv", filters=(1, 4), offload=True).offloaded_layers(8) == 3
    assert make_policy("omnikv", filters=(1, 4)).offloaded_layers(8) == 0
    assert make_policy("omnikv", offload=True).offloaded_layers(30) == 30 - 2 - 3 * 2  # SmolLM2: (2, 8, 17)


def test_split_bytes_counts_two_streamed_layers_on_both_sides():
    from localchat.planning.memory import split_bytes

    assert split_bytes(3200, 32, 24, prompt=1) == (1000, 2400)  # 8 resident + 2 streamed of 32 on the GPU
    assert split_bytes(3200, 32, 0, prompt=1) == (3200, 0)
    assert split_bytes(300, 3, 1, prompt=1) == (300, 100)  # one offloaded layer: it is streamed through whole


def test_offloaded_omnikv_gives_the_same_logits_over_two_turns(monkeypatch):
    from localchat.engine.policies.omnikv import bank as offload

    monkeypatch.setattr(offload, "PAGE_BYTES", 7 * 2 * 16 * 4)  # 7 tokens per page: chunks straddle pages
    takes = []
    real_take = Bank.take
    monkeypatch.setattr(Bank, "take", lambda self, layer, t: takes.append(
        self.ahead.get(layer.layer_idx, (None, None))[:2] == (layer.banked, t)) or real_take(self, layer, t))
    model = _model()
    plain, banked = KVCache(6), KVCache(6)
    a, b = make_policy("omnikv", budget=8, filters=FILTERS), make_policy("omnikv", budget=8, filters=FILTERS, offload=True)
    first, second = _ids(50), _ids(20, seed=1)
    got = _run(model, b, banked, first, 0, steps=4)
    want = _run(model, a, plain, first, 0, steps=4)
    assert [type(layer) for layer in banked.layers] == [KVLayer] * 3 + [BankLayer] * 3
    assert all(layer.banked == 50 and layer.tail == 4 for layer in banked.layers[3:])  # the answer stays on the device
    assert all(len(layer.hk.pages) == 8 for layer in banked.layers[3:])
    assert sorted(banked.extension.loaded) == []  # released after the turn
    # the second turn folds the answer into the bank and reads on
    got += _run(model, b, banked, second, 54, steps=3)
    want += _run(model, a, plain, second, 54, steps=3)
    assert all(layer.banked == 74 and layer.tail == 3 for layer in banked.layers[3:])
    assert len(takes) == 3 * (3 + 2) and all(takes)  # every chunk on a non-empty bank found its copy prefetched
    for x, y in zip(got, want):
        assert torch.allclose(x, y, atol=1e-5)
    # the budget binds: the sparse layers saw 8 of the prompt's slots, not all of them
    full = KVCache(6)
    forward(model, full, first, 0)
    assert not torch.allclose(forward(model, full, _ids(1, seed=100), 50), want[1], atol=1e-4)
    # and what the bank holds is what the plain cache holds
    for i in range(6):
        assert torch.equal(banked.layers[i].tensors()["k"], plain.layers[i].tensors()["k"])
        assert torch.equal(banked.layers[i].tensors()["v"], plain.layers[i].tensors()["v"])


def test_each_filter_choice_is_gathered_across_pages_for_its_layers(monkeypatch):
    from localchat.engine.policies.omnikv import bank as offload

    monkeypatch.setattr(offload, "PAGE_BYTES", 3 * 2 * 4 * 4)  # 3 rows of [H=2, d=4] fp32 per page
    bank = Bank(torch.device("cpu"), {0: [1, 2]})
    full = {}
    for j in (1, 2):
        layer = bank.layers[j] = BankLayer(bank, j)
        full[j] = torch.arange(2 * 8 * 4, dtype=torch.float32).view(1, 2, 8, 4) + 1000 * j  # [1, H, n, d]
        layer.update(full[j][:, :, :5], -full[j][:, :, :5])  # two chunks: 5 then 3 slots, over 3 pages
        layer.update(full[j][:, :, 5:], -full[j][:, :, 5:])
        assert len(layer.hk.pages) == 3 and layer.banked == 8
    bank.answer()
    bank.choose(0, torch.tensor([1, 2, 3, 7]))
    assert bank.pending is not None and not bank.loaded  # gathered by the next layer, not the filter
    bank.fetch()
    for j in (1, 2):
        k, v = bank.selected(j)
        assert torch.equal(k, full[j][:, :, [1, 2, 3, 7]]) and torch.equal(v, -full[j][:, :, [1, 2, 3, 7]])
        assert torch.equal(bank.layers[j].tensors()["k"], full[j])  # the pages read back whole


def test_reading_prefetches_the_next_banked_layer_with_room_for_the_chunk():
    bank = Bank(torch.device("cpu"), {0: [1, 2]})
    for j in (1, 2):
        bank.layers[j] = BankLayer(bank, j)
        bank.layers[j].update(torch.ones(1, 2, 6, 4) * j, torch.ones(1, 2, 6, 4))
    bank.prefetch_after(0, t=3)
    assert list(bank.ahead) == [1] and bank.ahead[1][2][0].shape == (1, 2, 9, 4)
    whole_k, _ = bank.layers[1].update(torch.full((1, 2, 3, 4), 7.0), torch.zeros(1, 2, 3, 4))
    assert not bank.ahead and whole_k.shape == (1, 2, 9, 4)
    assert torch.equal(whole_k[:, :, :6], torch.ones(1, 2, 6, 4)) and torch.equal(whole_k[:, :, 6:], torch.full((1, 2, 3, 4), 7.0))
    assert bank.layers[1].banked == 9


def test_crop_drops_the_answer_first_then_the_bank():
    bank = Bank(torch.device("cpu"), {0: [1]})
    layer = bank.layers[1] = BankLayer(bank, 1)
    layer.update(torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4))
    bank.answer()
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    layer.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    layer.crop(-3)
    assert (layer.banked, layer.tail, layer.get_seq_length()) == (9, 0, 9)


def _engine(tiny_tok, **policy):
    engine = Engine(_model(len(tiny_tok)), tiny_tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("omnikv", budget=16, local=0, filters=FILTERS, **policy))
    return engine


def _answers(session, questions, settings):
    out = []
    for q in questions:
        events = list(session.send(q, (), settings))
        assert not any(isinstance(e, Error) for e in events), events[-1]
        out.append(events[-1])
    return out


def test_a_session_with_offload_answers_retries_and_switches_policy_like_one_without(tiny_tok, monkeypatch):
    settings = GenerationSettings(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
    questions = ("alpha beta gamma delta " * 30 + "What comes after beta?", "And before it?")
    plain = _answers(Session(_engine(tiny_tok)), questions, settings)
    s = Session(_engine(tiny_tok, offload=True))
    banked = _answers(s, questions, settings)
    assert [d.text for d in banked] == [d.text for d in plain]
    assert any(isinstance(layer, BankLayer) for layer in s.cache.layers)
    # retry restores the cache as it was before the last turn (an append-only cache: cropped)
    again = list(s.retry(settings))[-1]
    assert isinstance(again, Done) and again.text == banked[-1].text
    # another policy re-reads the chat once, without copying the offloaded cache back first
    clones = []
    real_clone = KVCache.clone
    monkeypatch.setattr(KVCache, "clone", lambda self: clones.append(getattr(self, "bank", None)) or real_clone(self))
    s.set_policy(make_policy("streaming", budget=32, local=8))
    out = _answers(s, ("Once more?",), settings)
    assert isinstance(out[-1], Done) and clones == []
    assert not any(isinstance(layer, BankLayer) for layer in s.cache.layers)
    # and an engine switched under a live cache brings every layer back to the device
    e = _engine(tiny_tok, offload=True)
    cache = e.new_cache()
    list(e.continue_on(cache, list(range(60, 120)), 0, settings))
    e.set_policy(make_policy("full"))
    list(e.continue_on(cache, list(range(70, 80)), 67, settings))  # 60 + 8 answered, the last one not fed
    assert not any(isinstance(layer, BankLayer) for layer in cache.layers) and cache.get_seq_length() == 84


def test_offload_refuses_an_evicted_cache_and_drops_copies_of_a_failed_chunk(tiny_tok):
    from localchat.engine.prefill import _rollback

    e = _engine(tiny_tok)
    e.set_policy(make_policy("streaming", budget=16, local=4))
    cache = e.new_cache()
    list(e.continue_on(cache, list(range(60, 120)), 0, GenerationSettings(max_new_tokens=2)))
    policy = make_policy("omnikv", budget=8, filters=FILTERS, offload=True)
    with pytest.raises(UserError, match="kept every token"):
        policy.attach(e.model, cache)
    cache = KVCache(6)
    bank = bank_cache(cache, {1: [3]}, torch.device("cpu"))
    bank.ahead[3] = (0, 4, None)
    _rollback(cache, [0] * 6)
    assert bank.ahead == {}


def test_offload_refuses_a_quantized_cache(tiny_tok):
    engine = _engine(tiny_tok, offload=True)
    engine.kv = "int4"
    events = list(engine.chat([{"role": "user", "content": "hello " * 8}], GenerationSettings(max_new_tokens=2)))
    assert isinstance(events[-1], Error) and "--offload needs an unquantized KV cache" in events[-1].message


def test_offload_flag_is_omnikvs_and_a_gpus(tiny_engine):
    from localchat.planning.load import policy_for

    with pytest.raises(UserError, match="applies to --policy omnikv"):
        policy_for(tiny_engine, "locret", heads="random", offload=True)
    with pytest.raises(UserError, match="this runs on the CPU"):
        policy_for(tiny_engine, "omnikv", offload=True)


def test_plan_with_offload_reads_longer_documents_on_a_gpu():
    from pathlib import Path

    from localchat.profile_cli import plan_for

    config = str(Path(__file__).parents[1] / "data" / "configs" / "llama-3.1-8b-instruct.json")

    def plan(offload, device="cuda"):
        args = argparse.Namespace(model=config, policy="omnikv", budget=None, chunk=None, local=None, positions=None,
                                  weights=None, kv=None, margin_mib=None, memory_gb=24.0, device=device,
                                  profile="none", max_new_tokens=512, heads=None, offload=offload)
        return plan_for(args, quiet=True)[1]

    on_gpu, offloaded = plan(False), plan(True)
    assert offloaded.offloaded() == 24  # 32 layers, filters (2, 8, 18): 8 stay on the GPU
    # the GPU holds 8 layers' K/V plus two streamed through instead of 32: more than twice the tokens
    assert 2.2 < offloaded.max_document() / on_gpu.max_document() < 3.2
    assert any("24 of 32 layers in host memory" in line for line in offloaded.lines())
    assert any(f"without --offload the GPU holds {on_gpu.full_attention_tokens():,}" in line for line in offloaded.lines())
    with pytest.raises(UserError, match="this runs on the CPU"):
        plan(True, device="cpu")


def test_the_engine_checks_both_memories_before_reading_with_offload(tiny_tok, monkeypatch):
    from localchat.planning import memory
    from localchat.planning.load import admit

    engine = _engine(tiny_tok, offload=True)
    engine.device = torch.device("cuda")  # only the arithmetic runs: nothing is read
    unit = memory.kv_unit_bytes(memory.Shape.from_config(engine.model.config), "fp32") // 6  # one layer
    # 6 layers, 3 offloaded: the GPU holds 3 layers' new units, 2 streamed layers whole (40 held + new) and
    # the offloaded layers' answer (12); host memory the offloaded layers' prompt (88)
    on_gpu, in_host = unit * (3 * 100 + 2 * (40 + 100) + 3 * 12), unit * 3 * 88
    free = {"cuda": 1024 * memory.MIB + on_gpu, "cpu": 512 * memory.MIB + in_host - 1}
    monkeypatch.setattr(memory, "detect", lambda kind=None: memory.Device(kind or "cuda", "test", 2**40, free[kind or "cuda"]))
    with pytest.raises(UserError, match="omnikv --offload keeps 3 layers in host memory: 88 more tokens"):
        admit(engine, 88, 12, held=40)
    free["cpu"] += 1
    admit(engine, 88, 12, held=40)  # both fit exactly
    free["cuda"] -= 1
    with pytest.raises(UserError, match=r"100 more need .* GiB on the GPU \(3 offloaded layers' share"):
        admit(engine, 88, 12, held=40)
