"""Models whose layers keep different things (engine/layer_kinds.py, engine/cache.py): Gemma 3's sliding and
global layers, gpt-oss's (with sinks), Qwen3.5's and Qwen3-Next's linear-attention layers, SmolLM3's layers
without RoPE.

Tiny random models of each (tests/tiny.py HYBRIDS). Where the policy keeps everything, the engine's chunked read
and a follow-up give transformers' own logits; a window layer never holds more than its window needs; compact
positions move a window's keys with the budget's slots and keep their distances exact; a cache's windows and
states survive being written out and read back."""

from __future__ import annotations

import pytest
import torch
from tiny import HYBRIDS, tiny_architecture, tiny_tokenizer

from localchat.engine.cache import KVCache, WindowLayer
from localchat.engine.engine import Engine
from localchat.engine.layer_kinds import GLOBAL, STATE, WINDOW, LayerKind, layer_kinds, summary
from localchat.engine.policies import make_policy
from localchat.engine.prefill import forward, prefill
from localchat.engine.rope import layer_inv_freqs
from localchat.kernels.rope import rope_table, rotate, shift_keys

CHUNK = 48


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module", params=HYBRIDS)
def model(request, tok):
    return tiny_architecture(request.param, len(tok))


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _read(model, cache, ids, policy=None, first_pos: int = 0, on_chunk=None) -> torch.Tensor:
    run = prefill(model, cache, ids, chunk=CHUNK, policy=policy, first_pos=first_pos, on_chunk=on_chunk)
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def test_layer_kinds_read_the_families_layouts(model):
    kinds = layer_kinds(model.config)
    assert len(kinds) == model.config.num_hidden_layers
    kind = model.config.model_type
    expected = {"gemma3_text": "1 global, 3 window (64)", "gpt_oss": "2 global, 2 window (32)",
                "qwen3_next": "1 global, 3 state", "qwen3_5_text": "1 global, 3 state",
                "smollm3": "4 global; 1 without RoPE"}[kind]
    assert summary(kinds) == expected


@torch.inference_mode()
def test_full_attention_reads_and_follows_up_as_transformers_does(model, tok):
    doc, follow = _ids(300, len(tok)), _ids(20, len(tok), seed=1)
    whole = torch.cat([doc, follow], dim=1)
    want_doc = model(input_ids=doc).logits[0, -1]
    want_all = model(input_ids=whole).logits[0, -1]
    engine = Engine(model, tok, chunk=CHUNK)
    cache = engine.new_cache(320, 4)
    got_doc = _read(model, cache, doc, engine.policy)
    got_all = _read(model, cache, follow, engine.policy, first_pos=300)
    torch.testing.assert_close(got_doc, want_doc, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_all, want_all, atol=2e-5, rtol=1e-4)


@torch.inference_mode()
def test_a_window_layer_holds_its_window_and_no_more(model, tok):
    engine = Engine(model, tok, chunk=CHUNK)
    engine.set_policy(make_policy("streaming", budget=64, local=16))
    cache = engine.new_cache(600, 4)
    held = []
    _read(model, cache, _ids(600, len(tok)), engine.policy,
          on_chunk=lambda r: held.append([layer.n for layer in cache.layers if isinstance(layer, WindowLayer)]))
    windows = [k.window for k in engine.kinds if k.kind == WINDOW]
    if not windows:
        assert all(not h for h in held)
        return
    for counts in held:
        assert all(n <= w - 1 + max(CHUNK, WindowLayer.slack) for n, w in zip(counts, windows))
    assert all(n >= w - 1 for n, w in zip(held[-1], windows))  # a long document fills the window
    assert cache.get_seq_length() <= 64 + 16 + CHUNK  # the governed layers' budget bounds them


def test_a_windows_shift_is_a_rotation_to_the_shifted_positions():
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 2, 10, 16, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    at = torch.arange(100, 110)
    layer = WindowLayer(window=32)
    layer.update(rotate(raw, *rope_table(at, inv_freq)), torch.zeros(1, 2, 10, 16))
    layer.shift(-37, inv_freq)
    torch.testing.assert_close(layer.keys, rotate(raw, *rope_table(at - 37, inv_freq)), atol=1e-5, rtol=1e-5)


def test_partial_rope_rotates_only_its_dims():
    keys = torch.randn(1, 2, 5, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))  # 4 of 16 dims rotate
    moved = shift_keys(keys, torch.full((2, 5), 9), inv_freq)
    torch.testing.assert_close(moved[..., 4:], keys[..., 4:])
    torch.testing.assert_close(moved[..., :4], shift_keys(keys[..., :4], torch.full((2, 5), 9), inv_freq))


@torch.inference_mode()
def test_compact_positions_keep_a_windows_distances_exact(tok):
    """Layer 0 of the tiny Gemma 3 is a sliding layer: its keys depend on the tokens alone, so in compact positions
    (the global layer evicting) they are original-position keys moved by one shift: the window's last unit sits
    just before the next slot."""
    model = tiny_architecture("gemma3_text", len(tok))
    ids = _ids(500, len(tok))
    caches = {}
    for positions in ("compact", "original"):
        engine = Engine(model, tok, chunk=CHUNK)
        engine.set_policy(make_policy("streaming", budget=64, local=16), positions=positions)
        cache = engine.new_cache(500, 4)
        _read(model, cache, ids, engine.policy)
        caches[positions] = cache
    compact, original = caches["compact"].layers[0], caches["original"].layers[0]
    assert compact.n == original.n and torch.equal(compact.positions, original.positions)
    slots = caches["compact"].next_position(500) - compact.n + torch.arange(compact.n)
    delta = (compact.positions[0] - slots).expand(compact.keys.shape[1], -1)
    inv_freq = caches["compact"].inv_freqs[0]
    torch.testing.assert_close(shift_keys(compact.keys, delta, inv_freq), original.keys, atol=1e-4, rtol=1e-4)
    assert caches["compact"].next_position(500) < 500  # the global layer evicted: positions stayed bounded


@torch.inference_mode()
def test_windows_and_states_survive_being_written_out(model, tok):
    engine = Engine(model, tok, chunk=CHUNK)
    engine.set_policy(make_policy("streaming", budget=64, local=16))
    cache = engine.new_cache(400, 4)
    _read(model, cache, _ids(400, len(tok)), engine.policy)
    names = set(cache.tensors())
    for i, kind in enumerate(engine.kinds):
        assert ({f"conv.{i}", f"rec.{i}"} <= names) if kind.kind == STATE else (f"k.{i}" in names)
    copy = cache.empty()
    copy.load_tensors({k: v.clone() for k, v in cache.tensors().items()})
    step = _ids(1, len(tok), seed=2)
    torch.testing.assert_close(forward(model, copy, step, 400), forward(model, cache, step, 400))


def test_a_hybrid_cache_counts_the_governed_layers():
    kinds = [LayerKind(WINDOW, 8), LayerKind(GLOBAL), LayerKind(STATE)]
    cache = KVCache(3, kinds=kinds)
    assert cache.governed == [1] and cache.hybrid
    k = torch.zeros(1, 1, 20, 4)
    cache.layers[0].update(k, k)
    cache.layers[1].update(k[:, :, :5], k[:, :, :5])
    assert cache.get_seq_length() == 5 and cache.get_seq_length(0) == 20
    cache.settle()
    assert cache.layers[0].n == 20  # within window - 1 + slack: not moved yet


@pytest.mark.parametrize("policy", ["locret", "sirllm"])
def test_a_chat_continues_after_a_restart_without_a_re_read(model, tok, tmp_path, policy):
    """Two turns, saved, reopened by another Store: the follow-up reads only its own tokens and answers as the chat
    that never closed does (windows, states and the governed layers' kept units all restored)."""
    from localchat.engine.heads import RetainingHeads
    from localchat.engine.sampling import GenerationSettings
    from localchat.session import Session
    from localchat.store import Store

    heads = {"heads": RetainingHeads.random(model, d_r=32)} if policy == "locret" else {}
    engine = Engine(model, tok, name="tiny", chunk=CHUNK)
    engine.set_policy(make_policy(policy, budget=64, local=16, **heads))
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    chat = Session(engine)
    list(chat.send("The quick brown fox jumps over the lazy dog. " * 20 + "\nWhat jumps?", settings=settings))
    store = Store(tmp_path / "chats.sqlite3")
    name = store.save(chat, "notes")
    reopened, notices = Store(tmp_path / "chats.sqlite3").load(name, engine)
    assert notices == []
    want = list(chat.send("And then?", settings=settings))[-1]
    got = list(reopened.send("And then?", settings=settings))[-1]
    assert got.text == want.text and got.prompt_tokens == want.prompt_tokens < 40


@torch.inference_mode()
def test_a_quantized_cache_keeps_the_global_layers_packed_and_reads_as_the_plain_one(model, tok):
    """--kv int8 on a hybrid: the governed layers are quantized (stored un-rotated in compact positions, partial RoPE
    included), the window and state layers stay as they are; StreamingLLM keeps the same units either way, so the
    logits after a read with evictions match the plain cache's to int8's precision."""
    from localchat.engine.qcache import QuantizedKVCache, QuantizedKVLayer

    ids = _ids(400, len(tok))
    got = {}
    for kv in ("none", "int8"):
        engine = Engine(model, tok, chunk=CHUNK, kv=kv)
        engine.set_policy(make_policy("streaming", budget=64, local=16))
        cache = engine.new_cache(400, 4)
        got[kv] = _read(model, cache, ids, engine.policy)
        if kv == "int8":
            assert isinstance(cache, QuantizedKVCache)
            assert all(isinstance(layer, QuantizedKVLayer) == (i in cache.governed) for i, layer in enumerate(cache.layers))
    scale = got["none"].abs().max()
    assert (got["int8"] - got["none"]).abs().max() < 0.003 * scale  # measured up to 0.0009 on these models


def test_a_quantized_layer_moves_partial_rope_keys_to_their_slots():
    """Partial RoPE (4 of 16 dims) in compact positions: after an eviction the quantized layer's keys, read back,
    are the plain layer's (rotated to the kept units' slots) to int8 precision; the other 12 dims never move."""
    from localchat.engine.cache import KVLayer
    from localchat.engine.qcache import QuantizedKVLayer

    g = torch.Generator().manual_seed(1)
    raw, values = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))
    keys = rotate(raw, *rope_table(torch.arange(40), inv_freq))  # at their true positions 0..39
    idx = torch.stack([torch.arange(0, 40, 3)[:10], torch.arange(5, 40, 2)[:10]])
    plain, packed = KVLayer(), QuantizedKVLayer(bits=8)
    packed.inv_freq = inv_freq
    for layer in (plain, packed):
        layer.update(keys, values)
        layer.keep(idx, inv_freq)
    want = rotate(raw.gather(2, idx[None, :, :, None].expand(-1, -1, -1, 16)), *rope_table(torch.arange(10), inv_freq))
    torch.testing.assert_close(plain.keys, want, atol=1e-5, rtol=1e-5)
    got, _ = packed.whole(torch.float32)
    assert (got - want).abs().max() < 0.05 and (got - want)[..., :4].abs().max() < 0.05


@pytest.mark.parametrize("kv", ["none", "int8"])
@torch.inference_mode()
def test_a_conversation_at_original_positions_moves_to_compact_ones(model, tok, kv):
    """A chat read at original positions that grows past the window goes on at compact ones (KVCache.to_compact):
    each governed key moves from its true position to its slot (its pre-RoPE key is unchanged), each window
    layer's keys move as far as the next token's position does (their distances stay exact), states stay."""
    engine = Engine(model, tok, chunk=CHUNK, kv=kv)
    engine.set_policy(make_policy("streaming", budget=64, local=16), positions="original")
    cache = engine.new_cache(400, 4)
    _read(model, cache, _ids(400, len(tok)), engine.policy)
    before = cache.clone()
    freqs = layer_inv_freqs(model, engine.kinds)
    cache.to_compact(freqs, 400)
    n = cache.get_seq_length()
    assert cache.positions == "compact" and n < 400 and cache.next_position(400) == n
    for i, (old, new) in enumerate(zip(before.layers, cache.layers)):
        if i in cache.governed:
            assert torch.equal(old.positions, new.positions)
            was = old.whole(torch.float32)[0] if kv == "int8" else old.keys
            now = new.whole(torch.float32)[0] if kv == "int8" else new.keys
            want = was if freqs[i] is None else shift_keys(was, torch.arange(n)[None, :] - old.positions, freqs[i])
            tol = 0.02 * was.abs().max() if kv == "int8" else 1e-4
            assert (now - want).abs().max() <= tol
        elif isinstance(old, WindowLayer):
            want = old.keys if freqs[i] is None else shift_keys(old.keys, torch.full(old.positions.shape, n - 400), freqs[i])
            torch.testing.assert_close(new.keys, want, atol=1e-4, rtol=1e-4)
    states = {k: v for k, v in before.tensors().items() if k[:4] in ("conv", "rec.")}
    assert all(torch.equal(v, cache.tensors()[k]) for k, v in states.items())
