"""The memory model against figures worked out by hand from the published configs (no downloads)."""

from pathlib import Path

import pytest

from localchat.planning import memory as m

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def shape(name: str) -> m.Shape:
    return m.Shape.from_config(m.read_config(CONFIGS / f"{name}.json"), name=name)


@pytest.mark.parametrize(("name", "params"), [
    # embed + lm_head (untied) + layers x (q + k + v + o + gate/up/down + 2 norms) + final norm
    ("smollm2-135m-instruct", 49152 * 576 + 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536 + 2 * 576) + 576),
    ("llama-3.1-8b-instruct", 2 * 128256 * 4096 + 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
                                                        + 2 * 4096) + 4096),
    # Qwen2 adds q/k/v biases: 3584 + 512 + 512 per layer
    ("qwen2.5-7b-instruct", 2 * 152064 * 3584 + 28 * (3584 * 3584 * 2 + 3584 * 512 * 2 + 3 * 3584 * 18944
                                                      + 2 * 3584 + 3584 + 2 * 512) + 3584),
    ("phi-3-mini-128k-instruct", 2 * 32064 * 3072 + 32 * (4 * 3072 * 3072 + 3 * 3072 * 8192 + 2 * 3072) + 3072),
])
def test_parameter_counts_match_the_published_sizes(name, params):
    s = shape(name)
    assert s.total_params() == params
    published = {"smollm2-135m-instruct": 134_515_008, "llama-3.1-8b-instruct": 8_030_261_248,
                 "qwen2.5-7b-instruct": 7_615_616_512, "phi-3-mini-128k-instruct": 3_821_079_552}
    assert params == published[name]


def test_shape_fields_from_config():
    q = shape("qwen2.5-7b-instruct")
    assert (q.head_dim, q.kv_heads, q.attn_bias, q.tied, q.window) == (128, 4, True, False, 32768)
    p = shape("phi-3-mini-128k-instruct")
    assert (p.head_dim, p.kv_heads, p.window) == (96, 32, 131072)
    assert shape("smollm2-135m-instruct").tied


def test_weight_bytes_by_dtype():
    s = shape("llama-3.1-8b-instruct")
    assert m.weight_bytes(s, "bf16") == 8_030_261_248 * 2
    assert m.weight_bytes(s, "fp32") == 8_030_261_248 * 4
    # nf4: linear layers at 0.5 byte + a 4-byte scale per 64 weights; embeddings, lm_head, norms at 2 bytes
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert m.weight_bytes(s, "nf4") == int(linear * (0.5 + 4 / 64)) + 2 * (2 * 128256 * 4096 + 32 * 2 * 4096 + 4096)
    assert 5.5 * m.GIB < m.weight_bytes(s, "nf4") < 5.8 * m.GIB


def test_kv_bytes_count_scores_and_positions():
    s = shape("llama-3.1-8b-instruct")
    # per unit: 32 layers x 8 KV heads x (K + V: 2 x 128 x 2 bytes + fp32 score 4 + int64 position 8)
    assert m.kv_unit_bytes(s, "bf16") == 32 * 8 * (512 + 12)
    phi = shape("phi-3-mini-128k-instruct")
    assert m.kv_unit_bytes(phi, "bf16") == 32 * 32 * (2 * 96 * 2 + 12)
    smol = shape("smollm2-135m-instruct")
    assert m.kv_unit_bytes(smol, "fp32") == 30 * 3 * (2 * 64 * 4 + 12)
    # int4 cache: half a byte per element plus an fp32-sized scale per 64 elements
    assert m.kv_unit_bytes(s, "int4") == round(32 * 8 * (2 * 128 * (0.5 + 4 / 64) + 12))


def test_estimate_for_llama_at_locret_settings():
    s = shape("llama-3.1-8b-instruct")
    e = m.estimate(s, budget=16384, chunk=1024, local=100, max_new=512, weights="nf4", kv="bf16", act="bf16",
                   d_r=1024, margin=m.GIB)
    units = 16384 + 1024 + 100 + 512
    assert e.kv == units * 32 * 8 * 524
    assert e.activations == 1024 * (4 * 4096 + 3 * 14336 + 4096 + 2 * 1024) * 2 + 4 * 128256
    kv_len = 16384 + 1024 + 100
    assert e.scratch == 2 * 32 * kv_len * 128 * 2 + 1024 * kv_len + 1024 * 4096 * 2
    in_dim = (32 + 16) * 128
    assert e.heads == 32 * (in_dim * 1024 + 1024 * 8) * 2 + 1024 * (in_dim + 1024) * 2
    assert e.total == e.weights + e.kv + e.activations + e.scratch + e.heads + m.GIB
    assert e.total < 24 * m.GIB


def test_estimate_for_smollm2_on_cpu():
    s = shape("smollm2-135m-instruct")
    e = m.estimate(s, budget=1024, chunk=512, local=96, max_new=512, weights="fp32", kv="fp32", act="fp32", d_r=256)
    assert e.weights == 134_515_008 * 4
    assert e.kv == (1024 + 512 + 96 + 512) * 30 * 3 * 524
    assert e.scratch == 2 * 9 * 1632 * 64 * 4 + 512 * 1632 + 512 * 9 * 64 * 4  # GQA: K/V repeated to 9 heads
    assert e.margin == 0 and e.total == e.used


def test_mha_has_no_repeated_kv():
    phi = shape("phi-3-mini-128k-instruct")
    assert m.scratch_bytes(phi, 1024, 8000, "bf16") == 1024 * 8000 + 1024 * 32 * 96 * 2


def test_model_bytes_counts_tied_weights_once(tiny_engine):
    model = tiny_engine.model
    params = sum(p.numel() for p in model.parameters())  # parameters() already skips the tied lm_head
    assert m.model_bytes(model) >= params * 4
    s = m.Shape.from_config(model.config)
    assert s.tied and s.total_params() == params


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        m.dtype_bits("fp8")


def test_detect_cpu_reports_ram_and_a_stable_fingerprint():
    d = m.detect("cpu")
    assert d.kind == "cpu" and 0 < d.free <= d.total
    assert d.fingerprint == m.detect("cpu").fingerprint
    assert d.fingerprint.startswith("cpu | ")
    gpu = m.Device("cuda", "NVIDIA GeForce RTX 4090", 24 * m.GIB, 20 * m.GIB, "8.9", "cuda 12.4")
    assert gpu.fingerprint == "cuda | NVIDIA GeForce RTX 4090 | 24GiB | sm8.9 | driver cuda 12.4"


def test_read_config_errors_are_one_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 4,\n oops}')
    with pytest.raises(ValueError, match=r"config.json line 2"):
        m.read_config(tmp_path)
    with pytest.raises(ValueError, match="cannot read"):
        m.read_config(tmp_path / "missing.json")


def test_gpu_cap_reads_gb_and_refuses_nonsense_in_one_line():
    from localchat.errors import UserError

    assert m.gpu_cap({}) is None and m.gpu_cap({m.GPU_CAP_ENV: " "}) is None
    assert m.gpu_cap({m.GPU_CAP_ENV: "24"}) == 24 * m.GIB
    assert m.gpu_cap({m.GPU_CAP_ENV: "7.5"}) == int(7.5 * m.GIB)
    for bad in ("nan", "-1", "0", "inf", "lots", "1e300"):
        with pytest.raises(UserError, match="LOCALCHAT_GPU_MEMORY_GB must be a number of GB above 0"):
            m.gpu_cap({m.GPU_CAP_ENV: bad})
