"""The engine façade on a tiny random Llama: chunked prefill, streaming, events, cancel, sampling."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import tiny_llama

from localchat.engine.cache import KVCache
from localchat.engine.detok import StreamDecoder
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Error, Progress, Token
from localchat.engine.prefill import prefill
from localchat.engine.sampling import GenerationSettings, pick_token


def _drain(gen):
    """Run a prefill generator to the end; return (progress events, last logits)."""
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


@pytest.mark.parametrize("chunk", [1, 7, 64, 100, 1000])
def test_chunked_prefill_equals_one_shot(chunk):
    model = tiny_llama(300, layers=3, q_heads=6, kv_heads=2)
    ids = torch.randint(0, 300, (1, 233), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits[0, -1]
        cache = KVCache(3)
        _, got = _drain(prefill(model, cache, ids, chunk=chunk))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 233
    assert cache.layers[0].keys.shape == (1, 2, 233, 16)  # stored per KV head, never per query head


def test_cache_grows_in_place_and_reports_bytes():
    cache = KVCache(1, reserve=10)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 4, 8)
    layer.update(k, k)
    first = layer._k.data_ptr()
    layer.update(k, k)
    assert layer._k.data_ptr() == first  # within the reserve: no reallocation
    layer.update(k, k)  # 12 > 10: grows, keeps the old units
    assert torch.equal(layer.keys[:, :, :4], k) and torch.equal(layer.keys[:, :, 8:], k)
    assert cache.nbytes() == 12 * 2 * 8 * 4 * 2


def _events(engine, text="hello " * 40, settings=None, cancel=None):
    return list(engine.chat([{"role": "user", "content": text}], settings or GenerationSettings(max_new_tokens=12), cancel))


def test_events_are_well_formed(tiny_engine):
    events = _events(tiny_engine)
    progress = [e for e in events if isinstance(e, Progress)]
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert isinstance(done, Done) and not any(isinstance(e, (Done, Error)) for e in events[:-1])
    n = done.prompt_tokens
    assert [p.done for p in progress] == list(range(64, n, 64)) + [n]
    assert all(p.total == n and p.tokens_per_s > 0 for p in progress) and progress[-1].eta_s == 0
    assert events.index(progress[-1]) < events.index(tokens[0])
    assert "".join(t.text for t in tokens) == done.text
    assert done.new_tokens == len(tokens) == 12 and done.stop_reason == "length"
    assert done.kv_tokens == n + 11  # the last token is emitted, never fed back
    assert done.prefill_s > 0 and done.decode_s > 0 and done.ttft_s >= done.prefill_s
    assert done.prefill_tps > 0 and done.decode_tps > 0 and done.kv_bytes > 0


def test_stops_at_the_end_token(tiny_tok):
    model = tiny_llama(len(tiny_tok))

    def favour_end(module, args, out):  # make the end token the model's first choice
        out[..., tiny_tok.eos_token_id] = out.max() + 1.0
        return out

    model.lm_head.register_forward_hook(favour_end)
    engine = Engine(model, tiny_tok, chunk=64)
    done = _events(engine)[-1]
    assert done.stop_reason == "eos" and done.new_tokens == 0 and done.text == ""


def test_cancel_during_prefill_stops_within_one_chunk(tiny_engine):
    cancel = threading.Event()
    seen = []
    for ev in tiny_engine.chat([{"role": "user", "content": "word " * 200}], GenerationSettings(), cancel):
        seen.append(ev)
        if isinstance(ev, Progress) and ev.done == 64:
            cancel.set()
    assert [type(e) for e in seen] == [Progress, Done]
    assert seen[-1].stop_reason == "cancelled" and seen[-1].new_tokens == 0
    assert seen[-1].kv_tokens == 64  # no second chunk ran


def test_cancel_during_decode_stops_within_one_token(tiny_engine):
    cancel = threading.Event()
    seen = []
    for ev in tiny_engine.chat([{"role": "user", "content": "hi"}], GenerationSettings(max_new_tokens=50), cancel):
        seen.append(ev)
        if isinstance(ev, Token):
            cancel.set()
    done = seen[-1]
    assert done.stop_reason == "cancelled" and done.new_tokens == 1
    assert sum(isinstance(e, Token) for e in seen) == 1


def test_prompt_over_the_window_is_a_one_line_error(tiny_tok):
    engine = Engine(tiny_llama(len(tiny_tok), window=128), tiny_tok, name="tiny", chunk=64)
    events = _events(engine, text="x" * 300)
    assert len(events) == 1 and isinstance(events[0], Error)
    assert "128" in events[0].message and "\n" not in events[0].message


def test_bad_settings_are_errors(tiny_engine):
    for bad in (GenerationSettings(max_new_tokens=0), GenerationSettings(temperature=-1), GenerationSettings(top_p=0)):
        (ev,) = _events(tiny_engine, settings=bad)
        assert isinstance(ev, Error)


def test_sampling_is_seeded_and_top_p_narrows():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    greedy = GenerationSettings()
    assert pick_token(logits, greedy, None) == 1
    hot = GenerationSettings(temperature=2.0, seed=3)
    draw = lambda: [pick_token(logits, hot, g) for g in [torch.Generator().manual_seed(3)] for _ in range(30)]  # noqa: E731
    assert draw() == draw() and len(set(draw())) > 1
    narrow = GenerationSettings(temperature=2.0, top_p=0.01)
    g = torch.Generator().manual_seed(0)
    assert {pick_token(logits, narrow, g) for _ in range(20)} == {1}


def test_stream_decoder_never_splits_a_character(tiny_tok):
    text = "héllo wörld 😀 naïve — done"
    ids = tiny_tok(text, add_special_tokens=False)["input_ids"]
    dec = StreamDecoder(tiny_tok, window=3)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text == dec.text()
    assert not any("\ufffd" in p for p in pieces)


def test_policies_that_keep_every_token_are_refused_what_memory_cannot_hold(tiny_engine, monkeypatch):
    from localchat.engine.policies import make_policy
    from localchat.planning import memory
    from localchat.planning.load import admit

    monkeypatch.setattr(tiny_engine, "admit", admit)  # what planning/load.py installs on every engine it loads

    unit = memory.kv_unit_bytes(memory.Shape.from_config(tiny_engine.model.config), "fp32")
    text = "hello " * 40
    units = len(tiny_engine.encode_chat([{"role": "user", "content": text}])) + 12  # prompt + answer
    free = {"bytes": 512 * memory.MIB + unit * (units - 1)}  # one token short, after the CPU margin
    monkeypatch.setattr(memory, "detect", lambda kind=None: memory.Device("cpu", "test", 2**40, free["bytes"]))
    for name in ("full", "sagekv", "omnikv"):
        tiny_engine.set_policy(make_policy(name, budget=16))
        events = _events(tiny_engine, text)
        assert len(events) == 1 and isinstance(events[0], Error)
        assert events[0].message.startswith(f"{name} keeps every token: {units:,} more need")
        assert "use --policy sirllm" in events[0].message  # no trained heads for this model: not locret
    tiny_engine.set_policy(make_policy("streaming", budget=16))  # a bounded cache is not refused
    assert isinstance(_events(tiny_engine, text)[-1], Done)
    free["bytes"] += unit
    tiny_engine.set_policy(make_policy("full"))
    assert isinstance(_events(tiny_engine, text)[-1], Done)
