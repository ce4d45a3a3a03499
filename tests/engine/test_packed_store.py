"""engine/packed_store.py: packed CPU weights saved once and loaded at the next start instead of quantizing."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from localchat.engine import packed_store
from localchat.kernels import packed
from localchat.kernels.packed import PackedLinear


def logits(model) -> torch.Tensor:
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        return model(ids).logits


@pytest.fixture()
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_store, "folder", lambda: tmp_path / "packed")
    return tmp_path / "packed"


@pytest.mark.parametrize("bits", [4, 8])
def test_the_second_start_loads_what_the_first_packed_and_computes_the_same(store, bits, monkeypatch):
    first = tiny_llama(300, head_dim=32)
    assert packed_store.pack(first, bits) == "packed"
    assert len(list(store.glob("*.safetensors"))) == 1
    assert isinstance(first.lm_head, PackedLinear) and first.lm_head.bits == 8
    assert not [m for m in first.modules() if type(m) is torch.nn.Linear]  # every linear layer was packed
    assert {m.bits for m in first.model.modules() if isinstance(m, PackedLinear)} == {bits}
    want = logits(first)
    from safetensors.torch import load_file  # the entry is a safetensors file any reader takes

    entry = next(store.glob("*.safetensors"))
    theirs, ours = load_file(str(entry)), packed_store.read(entry)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert torch.equal(ours["lm_head.codes"], first.lm_head.codes)

    def no_quantizing(*_):
        raise AssertionError("quantized again")

    monkeypatch.setattr(packed, "quantize_int4", no_quantizing)
    monkeypatch.setattr(packed, "quantize_int8", no_quantizing)
    second = tiny_llama(300, head_dim=32)
    assert packed_store.pack(second, bits) == "loaded"
    assert torch.equal(logits(second), want)


def test_layers_without_whole_groups_of_inputs_take_int8_when_packed_and_when_loaded(store):
    """hidden 48: q/k/v, gate and up have 48 inputs (not whole groups of 32), o and down 64 and 192."""
    first = tiny_llama(300, head_dim=12)
    assert packed_store.pack(first, 4) == "packed"
    layer = first.model.layers[0]
    assert (layer.self_attn.q_proj.bits, layer.mlp.up_proj.bits, layer.mlp.down_proj.bits) == (8, 8, 4)
    second = tiny_llama(300, head_dim=12)
    assert packed_store.pack(second, 4) == "loaded"
    assert second.model.layers[0].self_attn.q_proj.bits == 8 and torch.equal(logits(second), logits(first))


def test_other_weights_or_another_precision_make_their_own_entry(store):
    assert packed_store.pack(tiny_llama(300, head_dim=32, seed=0), 4) == "packed"
    assert packed_store.pack(tiny_llama(300, head_dim=32, seed=1), 4) == "packed"
    assert packed_store.pack(tiny_llama(300, head_dim=32, seed=0), 8) == "packed"
    assert packed_store.pack(tiny_llama(300, head_dim=32, seed=0), 4) == "loaded"
    assert len(list(store.glob("*.safetensors"))) == 3


def test_a_damaged_entry_is_packed_again_and_replaced(store):
    packed_store.pack(tiny_llama(300, head_dim=32), 4)
    (path,) = store.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[:100])
    model = tiny_llama(300, head_dim=32)
    assert packed_store.pack(model, 4) == "packed"
    reference = tiny_llama(300, head_dim=32)
    packed_store.pack(reference, 4)  # loaded from the new entry
    assert torch.equal(logits(model), logits(reference))


def test_an_entry_of_other_shapes_is_refused_not_loaded(store, monkeypatch):
    """A fingerprint collision is not possible in practice; the shapes are checked all the same."""
    packed_store.pack(tiny_llama(300, head_dim=32), 4)
    (path,) = store.glob("*.safetensors")
    monkeypatch.setattr(packed_store, "fingerprint", lambda *_: path.stem)
    model = tiny_llama(300, head_dim=32, layers=1, q_heads=2, kv_heads=1)
    assert packed_store.pack(model, 4) == "packed"
    assert logits(model).shape[-1] == 300


def test_only_the_most_recently_used_entries_are_kept(store, monkeypatch):
    monkeypatch.setattr(packed_store, "KEEP", 2)
    for seed in range(3):
        packed_store.pack(tiny_llama(300, head_dim=32, seed=seed), 8)
    assert len(list(store.glob("*.safetensors"))) == 2
    assert packed_store.pack(tiny_llama(300, head_dim=32, seed=0), 8) == "packed"  # the oldest went


def test_a_cache_that_cannot_be_written_still_packs(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(packed_store, "folder", lambda: blocked / "packed")
    model = tiny_llama(300, head_dim=32)
    said = packed_store.pack(model, 4)
    assert said.startswith("packed (not saved: ")
    assert isinstance(model.lm_head, PackedLinear) and logits(model).isfinite().all()
