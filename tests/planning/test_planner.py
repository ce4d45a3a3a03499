"""The planner: budget and chunk choices, what-would-fit errors, the plan command, the measured check,
and the halve-the-chunk retry on out-of-memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from localchat.cli import main
from localchat.engine.events import Done, Notice
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.planning import memory as m
from localchat.planning import planner
from localchat.planning.planner import Request, make_plan
from localchat.profile_cli import best_threads, thread_counts

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
LLAMA = str(CONFIGS / "llama-3.1-8b-instruct.json")


def shape(name):
    return m.Shape.from_config(m.read_config(CONFIGS / f"{name}.json"), name=name)


def gpu_request(**kw):
    base = dict(local=100, max_new=512, weights="nf4", kv="bf16", act="bf16", d_r=1024, target=16384)
    return Request(**{**base, **kw})


def test_plenty_of_memory_gives_the_target_and_the_largest_chunk():
    plan = make_plan(shape("llama-3.1-8b-instruct"), 24 * m.GIB, gpu_request(), kind="cuda")
    assert (plan.budget, plan.chunk) == (16384, 4096)
    assert plan.fits and plan.estimate.margin == m.GIB
    assert plan.max_document() is None  # compact positions: any length


def test_tight_memory_lowers_the_budget_to_the_largest_that_fits():
    s, req = shape("llama-3.1-8b-instruct"), gpu_request()
    memory = 8 * m.GIB
    plan = make_plan(s, memory, req, kind="cuda")
    assert plan.budget < 16384 and plan.fits
    def e(b, c):
        return m.estimate(s, budget=b, chunk=c, local=100, max_new=512, weights="nf4", kv="bf16", act="bf16",
                          d_r=1024, margin=m.GIB, compact=True).total
    assert e(plan.budget + 128, 256) > memory  # rounded down to 64 from the true maximum
    assert e(plan.budget, plan.chunk) <= memory
    assert any("lowered" in n for n in plan.notes)


def test_card_chunk_is_preferred_without_measurements():
    smol = shape("smollm2-135m-instruct")
    req = Request(local=96, max_new=512, weights="fp32", kv="fp32", act="fp32", d_r=256, target=1024, card_chunk=512)
    plan = make_plan(smol, 16 * m.GIB, req)
    assert (plan.budget, plan.chunk) == (1024, 512)


def test_fastest_measured_chunk_wins():
    smol = shape("smollm2-135m-instruct")
    req = Request(local=96, max_new=512, weights="fp32", kv="fp32", act="fp32", target=1024, card_chunk=512,
                  throughput={256: 300.0, 512: 420.0, 1024: 510.0, 2048: 480.0})
    plan = make_plan(smol, 16 * m.GIB, req)
    assert plan.chunk == 1024
    assert any("510 tokens/s" in line for line in plan.lines())


def test_window_bounds_compact_budget():
    smol = shape("smollm2-135m-instruct")  # window 8192
    plan = make_plan(smol, 64 * m.GIB, Request(local=96, weights="fp32", kv="fp32", act="fp32", target=100000))
    assert plan.budget + plan.chunk < 8192
    with pytest.raises(UserError, match="window of 8,192 positions; a budget up to 7,935 would"):
        make_plan(smol, 64 * m.GIB, Request(budget=9000, weights="fp32", kv="fp32", act="fp32"))


def test_budget_that_cannot_fit_says_what_would():
    s = shape("llama-3.1-8b-instruct")
    with pytest.raises(UserError) as e:
        make_plan(s, 24 * m.GIB, gpu_request(budget=100000, weights="bf16"), kind="cuda")
    msg = str(e.value)
    assert "budget 100,000 needs" in msg and "a budget up to" in msg and "\n" not in msg
    with pytest.raises(UserError, match="nothing fits: the weights alone take 15.0 GiB"):
        make_plan(s, 12 * m.GIB, gpu_request(budget=1000, weights="bf16"), kind="cuda")
    with pytest.raises(UserError, match="does not fit in 4.0 GiB"):
        make_plan(s, 4 * m.GIB, gpu_request(), kind="cuda")


def test_a_chunk_that_cannot_fit_is_named_with_one_that_would():
    s = shape("llama-3.1-8b-instruct")
    with pytest.raises(UserError) as e:  # fits the window, not the memory
        make_plan(s, 24 * m.GIB, gpu_request(chunk=120_000), kind="cuda")
    msg = str(e.value)
    assert msg.startswith("chunk 120,000 does not fit") and "try --chunk " in msg and "smaller model" not in msg
    suggested = int(msg.split("try --chunk ")[1].split(",")[0].replace(",", ""))
    make_plan(s, 24 * m.GIB, gpu_request(chunk=suggested), kind="cuda")  # what it says would fit does
    with pytest.raises(UserError, match="chunk 1,000,000,000 does not fit .* window of 131,072 positions, with any "
                                        "budget"):
        make_plan(s, 24 * m.GIB, gpu_request(chunk=10**9, budget=1024), kind="cuda")
    with pytest.raises(UserError, match="does not fit in 4.0 GiB"):  # not the chunk: the weights
        make_plan(s, 4 * m.GIB, gpu_request(chunk=512), kind="cuda")


def test_full_cache_line_counts_tokens_without_eviction():
    plan = make_plan(shape("qwen2.5-7b-instruct"), 80 * m.GIB, gpu_request(weights="bf16"), kind="cuda")
    assert plan.full_attention_tokens() == 32768  # capped by Qwen2.5's window
    tight = make_plan(shape("llama-3.1-8b-instruct"), 24 * m.GIB, gpu_request(), kind="cuda")
    n = tight.full_attention_tokens()
    per_unit = m.kv_unit_bytes(tight.shape, "bf16")
    assert 50_000 < n < (24 * m.GIB - tight.estimate.weights) // per_unit


# --- the plan command ------------------------------------------------------------------------------------------


def test_plan_rtx4090_llama_fits_a_128k_document(capsys):
    assert main(["plan", "--profile", "rtx4090", "--model", LLAMA]) == 0
    out, err = capsys.readouterr()
    assert "(fits)" in out and "128K-token document fits" in out and "nf4" in out
    assert "`--weights nf4` loads them so" in out
    assert "budget       16,384" in out and "chunk        4,096" in out
    if not torch.cuda.is_available():
        assert "is for an RTX 4090" in err  # planned for the profile's GPU, with a warning
    assert main(["plan", "--profile", "rtx4090", "--model", LLAMA, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["predicted_total"] <= 24 * m.GIB and data["memory"] == 24 * m.GIB
    assert data["max_document"] is None and data["weights_dtype"] == "nf4"


def test_plan_knows_which_policies_hold_the_whole_prompt(capsys):
    def plan(*extra):
        assert main(["plan", "--memory-gb", "24", "--device", "cuda", "--weights", "nf4", "--model", LLAMA, "--json",
                     *extra]) == 0
        return json.loads(capsys.readouterr().out)

    assert plan("--policy", "locret")["max_document"] is None  # bounded cache, compact positions
    window_doc = 131072 - 512
    assert plan("--policy", "streaming", "--positions", "original")["max_document"] is None  # compact past the window
    for name in ("sagekv", "corm", "omnikv", "full"):  # the whole prompt stays: the memory bounds it below the window
        data = plan("--policy", name)
        assert data["max_document"] == data["full_cache_tokens"] - 512 < window_doc
    assert main(["plan", "--model", LLAMA, "--policy", "sagekv", "--memory-gb", "24", "--device", "cuda"]) == 0
    assert "sagekv keeps the whole prompt in memory" in capsys.readouterr().out
    assert main(["plan", "--model", LLAMA, "--policy", "bogus"]) == 2
    assert "unknown policy 'bogus'" in capsys.readouterr().err


def test_policies_that_score_with_attention_rows_plan_for_them(capsys):
    smol = shape("smollm2-135m-instruct")  # 30 layers, 9 query heads, 3 KV heads
    req = dict(local=96, max_new=512, weights="fp32", kv="fp32", act="fp32", budget=1024, chunk=2048)
    n = 1024 + 2048 + 96
    plans = {name: make_plan(smol, 16 * m.GIB, Request(**req, policy=make_policy(name))) for name in
             ("streaming", "h2o", "roco", "snapkv", "corm")}
    extra = {name: plan.estimate.scores for name, plan in plans.items()}
    assert extra["streaming"] == 0 and "policy scores" not in dict(plans["streaming"].estimate.rows())
    assert extra["h2o"] == 4 * 9 * 2048 * n + 2048 * 2048  # every query's fp32 row + the causal mask of the chunk
    assert extra["roco"] == extra["h2o"] + 2 * 4 * 3 * 2048 * n  # + the group mean and its square
    assert extra["snapkv"] == 4 * 9 * 32 * n + 32 * 32  # the 32-query window only
    assert extra["corm"] == 4 * 9 * 256 * n + 256 * 256 + 9 * 256 * n + 30 * 3 * 256 * n  # + CORM's messages
    assert plans["h2o"].estimate.total == plans["streaming"].estimate.total + extra["h2o"]
    assert main(["plan", "--policy", "roco", "--model", LLAMA, "--memory-gb", "24", "--device", "cuda",
                 "--weights", "nf4", "--json"]) == 0
    roco = json.loads(capsys.readouterr().out)
    assert main(["plan", "--policy", "streaming", "--model", LLAMA, "--memory-gb", "24", "--device", "cuda",
                 "--weights", "nf4", "--json"]) == 0
    streaming = json.loads(capsys.readouterr().out)
    assert roco["bytes"]["policy scores"] > 0 and roco["fits"]
    assert roco["budget"] * roco["chunk"] < streaming["budget"] * streaming["chunk"]  # it plans a smaller step


@pytest.mark.parametrize("profile, model", [("rtx4060", "phi-3-mini-128k-instruct"),
                                            ("rtx4080", "qwen2.5-7b-instruct"),
                                            ("rtx3060", "llama-3.1-8b-instruct")])
def test_builtin_profiles_fit_their_devices(capsys, profile, model):
    assert main(["plan", "--profile", profile, "--model", str(CONFIGS / f"{model}.json"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["predicted_total"] <= data["memory"]


def test_plan_budget_that_cannot_fit_exits_2(capsys):
    code = main(["plan", "--model", LLAMA, "--memory-gb", "24", "--device", "cuda", "--weights", "bf16",
                 "--kv", "none", "--policy", "streaming", "--budget", "120000"])
    err = capsys.readouterr().err
    assert code == 2 and "a budget up to" in err and err.count("\n") == 1


def test_plan_model_without_a_config_exits_2(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path / "none.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_plan_directory_with_only_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    assert main(["plan", "--model", str(tmp_path), "--memory-gb", "16", "--device", "cuda", "--weights", "nf4"]) == 0
    assert "7.62B parameters" in capsys.readouterr().out


# --- checking a plan against a real run ------------------------------------------------------------------------


def test_verify_measures_a_peak_on_the_tiny_model(tiny_engine):
    tiny_engine.set_policy(make_policy("streaming", budget=96, local=8))
    s = m.Shape.from_config(tiny_engine.model.config, name="tiny")
    req = Request(budget=96, chunk=32, local=8, max_new=4, weights="fp32", kv="fp32", act="fp32",
                  weights_exact=m.model_bytes(tiny_engine.model))
    plan = planner.verify(tiny_engine, make_plan(s, 8 * m.GIB, req))
    assert plan.measured_peak >= m.model_bytes(tiny_engine.model)
    assert tiny_engine.chunk == 64  # the engine's own chunk is left as it was


def test_verify_shrinks_the_chunk_until_the_measured_peak_fits(tiny_engine, monkeypatch):
    s = m.Shape.from_config(tiny_engine.model.config, name="tiny")
    req = Request(budget=512, local=8, max_new=4, weights="fp32", kv="fp32", act="fp32", target=512)
    plan = make_plan(s, 4 * m.GIB, req)
    assert plan.chunk == 4096
    seen = []

    def fake(engine, budget, chunk, max_new=0, baseline=None):
        seen.append(chunk)
        return 10 * m.GIB if chunk > 1024 else m.GIB

    monkeypatch.setattr(planner, "measure_chunk", fake)
    checked = planner.verify(tiny_engine, plan)
    assert seen == [4096, 2048, 1024] and checked.chunk == 1024 and checked.measured_peak == m.GIB
    assert sum("does not fit" in n for n in checked.notes) == 2


# --- out of memory during prefill ------------------------------------------------------------------------------


def test_oom_in_prefill_halves_the_chunk_and_keeps_going(tiny_engine, tiny_tok, monkeypatch):
    ids = tiny_tok("a fairly long prompt " * 12, add_special_tokens=False)["input_ids"]
    settings = GenerationSettings(max_new_tokens=6)
    expected = [e for e in tiny_engine.generate(ids, settings) if isinstance(e, Done)][0]

    real = tiny_engine.model.forward
    failures = []

    def flaky(*a, **kw):
        if kw["input_ids"].shape[-1] > 32:
            failures.append(kw["input_ids"].shape[-1])
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(*a, **kw)

    monkeypatch.setattr(tiny_engine.model, "forward", flaky)
    events = list(tiny_engine.generate(ids, settings))
    notices = [e for e in events if isinstance(e, Notice)]
    done = [e for e in events if isinstance(e, Done)]
    assert failures == [64] and tiny_engine.chunk == 32
    assert len(notices) == 1 and "chunks of 32" in notices[0].message
    assert done and done[0].text == expected.text and done[0].kv_tokens == expected.kv_tokens


# --- the 15 % check on the real model ----------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_prediction_within_15_percent_of_the_measured_peak(smollm2, tmp_path):
    """A fresh process, so the RSS figures are its own: predicted peak vs measured (CPU here), with fp32 weights
    and with packed int4 (the default where the CPU runs it faster). The first int4 start on a machine packs the
    weights once (engine/packed_store.py) and peaks higher; the prediction is for every later start, which maps
    the fp32 file and reads the packed copy: how many of the mapped file's pages count in RSS moves between
    runs (350-419 MiB measured against 350 predicted), so int4 gets 25 %."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCALCHAT_CONFIG_DIR": str(tmp_path)}

    def verify(weights: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "localchat", "--weights", weights, "plan", "--verify",
                              "--profile", "none", "--json"], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    verify("int4")  # packs once if this machine has no packed copy yet
    for weights, within in (("fp32", 0.15), ("int4", 0.25)):
        data = verify(weights)
        measured, predicted = data["measured_peak"], data["predicted_used"]
        assert data["spec"]["weights"] == weights and (data["budget"], data["chunk"]) == (1024, 512)
        assert abs(predicted - measured) / measured < within, (weights, predicted, measured)


def test_verify_loads_the_weights_and_kv_it_plans_for(tmp_path):
    """`plan --verify --weights int8 --kv int4` measures an int8 model with an int4 cache, not the default."""
    from tiny import save_tiny

    from localchat.planning.load import load_measured
    from localchat.planning.resolve import resolve

    flags = {"model": str(save_tiny(tmp_path)), "weights": "int8", "kv": "int4", "chunk": 32, "policy": "full",
             "profile": "none"}
    engine, baseline = load_measured(resolve(flags))
    assert baseline > 0 and engine.weights == "int8" and engine.kv == "int4"
    assert type(engine.model.model.layers[0].self_attn.q_proj).__name__ != "Linear"  # quantized
    flags.update(weights=None, kv="bf16")  # a profile's full-precision KV dtype means no quantization
    engine, _ = load_measured(resolve(flags))
    assert engine.kv == "none" and type(engine.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"


@pytest.mark.parametrize("flags", [[], ["--budget", "64"], ["--chunk", "32"], ["--budget", "96", "--stabilizers", "8"]])
@pytest.mark.parametrize("policy", [["--policy", "streaming"], ["--policy", "locret", "--heads", "random"],
                                    ["--policy", "full"]])
def test_plan_json_is_what_the_engine_loads_and_runs_with(policy, flags, tmp_path, capsys, monkeypatch):
    """One resolution: `plan --json` prints the RunSpec the engine then runs with, for a model without a card."""
    from tiny import save_tiny

    from localchat.args import load_engine
    from localchat.cli import build_parser

    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    argv = ["--model", str(save_tiny(tmp_path / "m")), *policy, *flags]
    if "--stabilizers" in flags and "locret" not in policy:
        assert main([*argv, "plan"]) == 2  # n_s is LOCRET's: another policy refuses it in one line
        assert "--stabilizers applies to --policy locret" in capsys.readouterr().err
        return
    assert main([*argv, "plan", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["spec"]
    engine = load_engine(build_parser().parse_args(argv))
    assert engine.spec.to_dict() == printed
    p = engine.policy
    assert (p.name, engine.chunk, engine.positions, p.local) == (printed["policy"]["name"], printed["chunk"],
                                                                 printed["policy"]["positions"], printed["policy"]["local"])
    if p.uses_budget():
        assert p.budget == printed["policy"]["budget"]
        if "--budget" in flags:
            assert p.budget == int(flags[1])  # the user's budget is kept
    else:
        assert printed["policy"]["budget"] is None  # full attention has none
    if p.name == "locret":
        assert p.stabilizers == printed["policy"]["stabilizers"] < p.budget


# --- precision: chosen by the plan, loaded as planned ------------------------------------------------------------


def _fake_device(monkeypatch, free: int) -> None:
    from localchat import profile_cli
    from localchat.planning import resolve as resolve_mod

    device = m.Device("cpu", "test machine", 64 * m.GIB, free)
    fake = lambda kind=None: device  # noqa: E731
    for module in (m, resolve_mod, profile_cli):
        monkeypatch.setattr(module, "detect", fake)


def _plan_json(argv, capsys) -> dict:
    assert main([*argv, "plan", "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("want", [("fp32", "none"), ("bf16", "none"), ("bf16", "int8"), ("bf16", "int4")])
def test_plan_chooses_the_precision_the_memory_allows_and_the_engine_loads_it(want, tmp_path, capsys, monkeypatch):
    """Device memory x precision: with exactly the memory `want` needs at the target budget (and every better
    choice needing more), the plan picks `want`, and the engine loads those weights and that cache."""
    from tiny import save_tiny

    from localchat.args import load_engine
    from localchat.cli import build_parser

    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("LOCALCHAT_MARGIN_MIB", "1")
    model = save_tiny(tmp_path / "m", layers=8, kv_heads=4, head_dim=64)  # the cache weighs as much as the weights
    argv = ["--model", str(model), "--policy", "locret", "--heads", "random"]
    _fake_device(monkeypatch, 64 * m.GIB)
    need = {pair: _plan_json([*argv, "--weights", pair[0], "--kv", pair[1]], capsys)["predicted_total"]
            for pair in planner.precision_choices(Request(weights=None, kv=None, kind="cpu"))}
    better = planner.precision_choices(Request(weights=None, kv=None, kind="cpu"))
    better = better[: better.index(want)]
    assert all(need[p] > need[want] for p in better), "the memory axis must make `want` the best that fits"
    _fake_device(monkeypatch, need[want] + 1)
    printed = _plan_json(argv, capsys)
    spec = printed["spec"]
    assert (spec["weights"], spec["kv"]) == want and printed["precision_chosen"] == ["weights", "kv"]
    assert printed["budget"] == printed["spec"]["policy"]["budget"] and printed["fits"]
    engine = load_engine(build_parser().parse_args(argv))
    assert engine.spec.to_dict() == spec
    assert (engine.weights or "fp32", engine.kv) == want
    q_proj = engine.model.model.layers[0].self_attn.q_proj
    assert (type(q_proj).__name__ != "Linear") == (want[0] in ("int8", "int4"))
    assert engine.model.get_input_embeddings().weight.dtype == (torch.bfloat16 if want[0] == "bf16" else torch.float32)
    assert type(engine.new_cache()).__name__ == ("KVCache" if want[1] == "none" else "QuantizedKVCache")


def test_plan_says_what_it_chose_and_what_the_next_step_up_needs():
    s = shape("llama-3.1-8b-instruct")
    req = gpu_request(weights=None, kv=None)
    plan = make_plan(s, 12 * m.GIB, req, kind="cuda")
    assert (plan.weights, plan.kv) == ("int8", "int8") and plan.budget == 16384 and plan.fits
    assert plan.chosen == ("weights", "kv")
    up = planner.precision_choices(req)  # gpu_request: kind "cuda"
    up = up[up.index(("int8", "int8")) - 1]
    need = m.estimate(s, budget=16384, chunk=256, local=100, max_new=512, weights=up[0], compact=True,
                      kv=up[1] if up[1] != "none" else "bf16", act="bf16", d_r=1024, margin=m.GIB).total
    assert need > 12 * m.GIB  # the better choice really does not fit
    assert f"would need {need / m.GIB:.1f} GiB" in plan.precision[1]
    roomy = make_plan(s, 80 * m.GIB, req, kind="cuda")
    assert (roomy.weights, roomy.kv) == ("bf16", "none") and "highest quality" in roomy.precision[0]
    tight = make_plan(s, int(7.6 * m.GIB), req, kind="cuda")  # nothing keeps 16,384: the largest budget, no 2-bit cache
    assert tight.weights == "nf4" and tight.kv != "int2" and tight.budget < 16384 and tight.fits


def test_a_fixed_precision_is_kept_and_the_rest_is_chosen():
    s = shape("llama-3.1-8b-instruct")
    plan = make_plan(s, 18 * m.GIB, gpu_request(weights="bf16", kv=None), kind="cuda")
    assert plan.weights == "bf16" and plan.kv != "none" and plan.chosen == ("kv",) and plan.budget == 16384
    with pytest.raises(UserError, match="needs .* GiB"):
        make_plan(s, 18 * m.GIB, gpu_request(weights="bf16", kv="none", budget=16384), kind="cuda")


def test_verify_plans_a_cheaper_cache_around_a_measured_miss(monkeypatch):
    """The memory model missed by 1.5 GiB with a full-precision cache: verify plans again with the miss taken off
    (an int8 cache, which the plan chose) and measures that, keeping the target budget instead of cutting it."""
    from types import SimpleNamespace

    s = shape("llama-3.1-8b-instruct")
    req = gpu_request(weights="bf16", kv=None)
    roomy = make_plan(s, 64 * m.GIB, req, kind="cuda")
    assert roomy.kv == "none"
    plan = make_plan(s, roomy.estimate.total + 1, req, kind="cuda")  # the full-precision cache just fits on paper
    assert (plan.kv, plan.budget) == ("none", 16384)
    seen = []

    def fake(engine, budget, chunk, max_new=0, baseline=None):
        seen.append(engine.kv)
        used = m.estimate(s, budget=budget, chunk=chunk, local=100, max_new=512, weights="bf16", compact=True,
                          kv="bf16" if engine.kv == "none" else engine.kv, act="bf16", d_r=1024).used
        return used + (int(1.5 * m.GIB) if engine.kv == "none" else 0)

    monkeypatch.setattr(planner, "measure_chunk", fake)
    engine = SimpleNamespace(kv="none")
    engine.configure = lambda kv=None, **_: setattr(engine, "kv", kv or engine.kv)  # Engine.configure's kv
    checked = planner.verify(engine, plan)
    assert seen == ["none", checked.kv] and checked.kv == "int8" and checked.budget == 16384
    assert checked.measured_peak + checked.estimate.margin <= checked.memory == plan.memory
    assert any("does not fit; trying int8 cache" in n for n in checked.notes)


def test_profile_tune_saves_budget_and_precision_with_before_and_after(tmp_path, capsys, monkeypatch):
    from tiny import save_tiny

    from localchat.planning import profiles

    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    argv = ["--model", str(save_tiny(tmp_path / "m")), "--policy", "locret", "--heads", "random",
            "profile", "tune", "--tokens", "128", "--chunks", "32,64", "--name", "mine", "--memory-gb", "2",
            "--thread-counts", "1,2"]
    import torch

    threads = torch.get_num_threads()
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "before (plan)" in out and "after (measured)" in out and "measured" in out
    saved = profiles.find("mine")
    values, measured = saved.values, saved.meta["measured"]
    assert values["chunk"] in (32, 64) and values["weights"] == measured["after_weights"]
    assert values["budget"] == measured["after_budget"] and values["kv"] == measured["after_kv"]
    assert measured["after_measured_peak_mib"] > 0 and measured["before_predicted_peak_mib"] > 0
    assert measured["thread_counts"] == [1, 2] and len(measured["read_tokens_per_s_by_threads"]) == 2
    assert min(measured["decode_tokens_per_s_by_threads"]) > 0
    by = {n: {"read": r, "decode": d} for n, r, d in zip(measured["thread_counts"], measured["read_tokens_per_s_by_threads"],
                                                         measured["decode_tokens_per_s_by_threads"])}
    assert values["threads"] == best_threads(by)
    torch.set_num_threads(threads)


def test_tune_keeps_the_threads_that_read_fastest_and_of_near_ties_the_faster_decoder():
    assert best_threads({1: {"read": 100.0, "decode": 50.0}, 2: {"read": 180.0, "decode": 40.0}}) == 2
    assert best_threads({1: {"read": 176.0, "decode": 60.0}, 2: {"read": 180.0, "decode": 40.0}}) == 1  # within 3 %
    assert thread_counts(None, 8) == [1, 4, 8] and thread_counts(None, 1) == [1] and thread_counts("2,1,2", 8) == [1, 2]
    with pytest.raises(UserError, match="--thread-counts"):
        thread_counts("0,2", 8)


def test_a_profiles_threads_reach_the_run(monkeypatch, tmp_path):
    """`threads` in a profile (what tune saves) or --threads is the RunSpec's, and loading runs torch on it."""
    import torch

    from localchat.planning import profiles
    from localchat.planning.load import use_threads
    from localchat.planning.resolve import resolve

    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    profiles.save_profile("two", {"description": "t", "device": "cpu", "threads": 1})
    assert resolve({"profile": "two"}, plan=False, quiet=True).threads == 1
    assert resolve({"profile": "two", "threads": 2}, plan=False, quiet=True).threads == 2
    assert resolve({}, plan=False, quiet=True).threads is None
    before = torch.get_num_threads()
    try:
        use_threads(1)
        assert torch.get_num_threads() == 1
        use_threads(None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_two_bit_cache_is_the_last_resort_not_a_way_to_keep_the_budget():
    s = shape("llama-3.1-8b-instruct")
    plan = make_plan(s, 8 * m.GIB, gpu_request(weights=None, kv=None), kind="cuda")
    two_bit = make_plan(s, 8 * m.GIB, gpu_request(weights="nf4", kv="int2"), kind="cuda")
    assert two_bit.budget == 16384  # int2 would keep the whole budget ...
    assert (plan.weights, plan.kv) == ("nf4", "int4") and plan.budget < 16384  # ... but 4 bits are kept instead
    assert "the largest budget" in plan.precision[0] and "int2" not in plan.precision[1]
