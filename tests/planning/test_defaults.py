"""The defaults a newcomer gets: every model and policy has its precision chosen from the memory found; on a CPU
the fastest weights measured to answer as full precision does; a long document on a model without trained heads
is read with a bounded policy instead of refused."""

from __future__ import annotations

import json

import pytest

from localchat.cli import main
from localchat.planning import memory as m
from localchat.planning.planner import Request, make_plan
from localchat.planning.resolve import model_facts
from tests.tiny import CONFIGS

EIGHT_GB = ["plan", "--device", "cuda", "--memory-gb", "8", "--json"]


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-7B-Instruct", str(CONFIGS / "llama-3.1-8b-instruct.json"),
                                   "meta-llama/Llama-3.1-8B-Instruct"])
def test_every_planning_path_chooses_the_precision_at_8_gb(model, capsys):
    """A card without heads (full attention), a config file and a card with heads: each plans 8B-class weights
    into 8 GB by choosing them, where they used to stop with 'try 4-bit weights'."""
    assert main(["--model", model, *EIGHT_GB]) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    assert printed["spec"]["weights"] == "nf4" and "weights" in printed["precision_chosen"]
    assert printed["fits"] and printed["predicted_total"] <= 8 * m.GIB


def test_try_4_bit_weights_is_said_only_where_they_were_not_tried(capsys):
    config = str(CONFIGS / "llama-3.1-8b-instruct.json")
    assert main(["--model", config, "plan", "--device", "cuda", "--memory-gb", "3"]) == 2
    tried = capsys.readouterr().err
    assert "even with nf4 weights" in tried and "try 4-bit" not in tried and "try a smaller model" in tried
    assert main(["--model", config, "--weights", "bf16", "plan", "--device", "cuda", "--memory-gb", "8"]) == 2
    assert "try 4-bit weights (--weights nf4)" in capsys.readouterr().err


def test_on_cuda_slow_int8_weights_rank_last_and_the_plan_says_why(capsys):
    """LLM.int8() decodes at a fifth of nf4's speed on CUDA (planner.DECODE_SPEED["cuda"]): at 12 GB, where int8
    weights used to be chosen for their quality, nf4 keeps the same budget and is chosen, with a line saying why;
    `--weights int8` still gets them. Without speeds (a bare request), quality alone still picks int8."""
    config = str(CONFIGS / "llama-3.1-8b-instruct.json")
    twelve = ["plan", "--device", "cuda", "--memory-gb", "12"]
    assert main(["--model", config, "--heads", "random", *twelve, "--json"]) == 0  # LOCRET
    printed = json.loads(capsys.readouterr().out)
    assert printed["spec"]["weights"] == "nf4" and printed["budget"] == 16384
    assert any("int8 weights would fit" in line and "0.21x bf16" in line for line in printed["precision_why"])
    assert main(["--model", config, "--heads", "random", "--weights", "int8", *twelve, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["weights"] == "int8"
    shape = model_facts(config)[0]
    ask = dict(weights=None, kv=None, kind="cuda", target=16384, local=96, max_new=512, d_r=1024)
    assert make_plan(shape, 12 * m.GIB, Request(**ask), kind="cuda").weights == "int8"
    speed = {"bf16": 1.0, "nf4": 1.0, "int8": 0.21}
    assert make_plan(shape, 12 * m.GIB, Request(**ask, speed=speed), kind="cuda").weights == "nf4"
    near = {**speed, "int8": 0.6}  # not slow enough to give up its quality
    assert make_plan(shape, 12 * m.GIB, Request(**ask, speed=near), kind="cuda").weights == "int8"


def test_profile_tune_measures_every_cuda_weights_that_fit():
    """What `profile tune` decodes with before the plan weighs speed: on CUDA each choice that fits the memory
    (bf16 only where it fits; LLM.int8 always measured, its slowness being the machine's), on a CPU full precision
    and the card's held weights."""
    from localchat.planning.planner import decode_choices

    shape = model_facts(str(CONFIGS / "llama-3.1-8b-instruct.json"))[0]
    ask = dict(weights=None, kv=None, target=16384, local=96, max_new=512, d_r=1024)
    roomy = make_plan(shape, 24 * m.GIB, Request(**ask), kind="cuda")
    assert decode_choices(roomy) == ("bf16", "int8", "nf4")
    twelve = make_plan(shape, 12 * m.GIB, Request(**ask), kind="cuda")
    assert decode_choices(twelve) == ("int8", "nf4")  # 8B bf16 weights alone are 15 GiB
    assert decode_choices(make_plan(shape, 8 * m.GIB, Request(**ask), kind="cuda")) == ("nf4",)
    cpu = make_plan(shape, 64 * m.GIB, Request(**ask, act="fp32"), kind="cpu")
    assert decode_choices(cpu, ("int4",)) == ("fp32", "int4") and decode_choices(cpu) == ("fp32",)


def test_on_a_cpu_the_fastest_weights_measured_to_hold_win_and_the_plan_says_why():
    shape, _ = model_facts(None)
    ask = dict(weights=None, kv=None, kind="cpu", target=1024, local=96, max_new=512, act="fp32")
    speed = {"fp32": 1.0, "bf16": 0.5, "int8": 3.0, "int4": 3.5}
    quality_first = make_plan(shape, 8 * m.GIB, Request(**ask, speed=speed), kind="cpu")
    assert (quality_first.weights, quality_first.kv) == ("fp32", "none")  # nothing measured to hold: quality
    held = make_plan(shape, 8 * m.GIB, Request(**ask, speed=speed, held=("int8", "int4")), kind="cpu")
    assert (held.weights, held.kv) == ("int4", "none") and held.budget == 1024
    assert "measured to answer as full precision does" in held.precision[0] and "3.5x fp32" in held.precision[0]
    slower = make_plan(shape, 8 * m.GIB, Request(**ask, speed={**speed, "int4": 2.0}, held=("int8", "int4")),
                       kind="cpu")
    assert slower.weights == "int8"  # measured faster than int4 on this machine: int8


def test_a_full_attention_plan_picks_the_precision_that_holds_the_document():
    """A policy that keeps every token: the highest quality whose memory holds the document (not a budget)."""
    shape = m.Shape.from_config(json.loads((CONFIGS / "qwen2.5-7b-instruct.json").read_text()), name="qwen")
    ask = dict(weights=None, kv="none", kind="cuda", holds_prompt="full", compact=False, max_new=512)
    short = make_plan(shape, 12 * m.GIB, Request(**ask, doc_tokens=4_000), kind="cuda")
    longer = make_plan(shape, 12 * m.GIB, Request(**ask, doc_tokens=30_000), kind="cuda")
    assert short.weights == "int8" and short.max_document() >= 4_000
    assert longer.weights == "nf4" and longer.max_document() >= 30_000
    assert "30,000-token document" in longer.precision[0]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A small random Qwen2 model (no trained heads exist for it) as a local Hugging Face directory."""
    from tests.tiny import tiny_architecture, tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-qwen2")
    tok = tiny_tokenizer()
    model = tiny_architecture("qwen2", len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def test_a_document_longer_than_full_attention_holds_is_read_with_a_bounded_policy(tiny_qwen2, tmp_path,
                                                                                    monkeypatch, capsys):
    """A model without heads under a memory cap: the default turns from full attention to the bounded policy
    without heads, named in one line, and the document is read end to end; a document that fits stays on full
    attention, and `--policy full` asked for is kept (and refused, in one line, when it cannot hold it)."""
    from localchat import profile_cli
    from localchat.planning import resolve as resolve_mod

    device = m.Device("cpu", "test machine", 64 * m.GIB, 513 * m.MIB)  # the margin and about 300 tokens of K/V
    for module in (m, resolve_mod, profile_cli):
        monkeypatch.setattr(module, "detect", lambda kind=None: device)
    long_doc, short_doc = tmp_path / "long.txt", tmp_path / "short.txt"
    long_doc.write_text("The sky is blue. " * 120 + "The pass key is 71432. " + "Birds sing. " * 20)
    short_doc.write_text("The pass key is 71432.")
    ask = ["--model", str(tiny_qwen2), "--max-new-tokens", "2", "ask", "--stats", "What is the pass key?", "-f"]

    assert main([*ask, str(long_doc)]) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "full attention holds" in line]
    assert len(said) == 1 and "reading it with sirllm" in said[0] and "localchat train-heads" in said[0]
    read = int(err.split("] read ")[1].split(" tokens")[0].replace(",", ""))
    assert "[sirllm," in err and read > len(long_doc.read_text())  # every byte-level token of it was read

    assert main([*ask, str(short_doc)]) == 0
    err = capsys.readouterr().err
    assert "[full," in err and "full attention holds" not in err

    longer = tmp_path / "longer.txt"
    longer.write_text(long_doc.read_text() * 3)  # refused before reading: no time spent on it
    assert main(["--policy", "full", *ask, str(longer)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localchat: error:") and "--policy locret" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("cpu, weights, speed", [("AVX512", "int4", "4.1x"), ("AVX2", "int4", "3.2x"),
                                                 ("DEFAULT", "fp32", None)])
def test_the_cpu_default_is_the_fastest_precision_measured_to_hold_on_this_cpu(cpu, weights, speed, capsys,
                                                                                monkeypatch):
    """The embedded model's card lists int4 as answering as fp32 does; it is the default where the CPU was
    measured to run it faster (AVX-512, AVX2), and a flag keeps fp32."""
    from localchat.planning import planner

    monkeypatch.setattr(planner, "cpu_class", lambda: cpu)
    assert main(["plan", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["spec"]["weights"] == weights and printed["precision_chosen"]
    if weights == "int4":
        assert "measured to answer as full precision does" in printed["precision_why"][0]
        assert f"{speed} fp32's decode speed" in printed["precision_why"][0]
    assert main(["--weights", "fp32", "plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["weights"] == "fp32"


@pytest.mark.slow  # three loads of the model and a decode at each precision: minutes on 2 cores
@pytest.mark.model
def test_profile_tune_measures_decode_speed_per_precision_and_saves_the_fastest(tmp_path, capsys, monkeypatch):
    """On the embedded model (its card measured int4 to answer as fp32 does): tune decodes with fp32 and int4 on
    this machine and the saved profile keeps the faster, whatever the built-in table says of this CPU."""
    from localchat.planning import profiles

    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path / "config"))
    assert main(["profile", "tune", "--tokens", "256", "--chunks", "256", "--name", "here"]) == 0, \
        capsys.readouterr().err
    err = capsys.readouterr().err
    assert "decode  fp32:" in err and "decode  int4:" in err
    saved = profiles.find("here")
    speeds = {k.removeprefix("decode_tps_"): v for k, v in saved.meta["measured"].items() if k.startswith("decode_tps")}
    assert set(speeds) == {"fp32", "int4"} and min(speeds.values()) > 0
    assert saved.values["weights"] == max(speeds, key=speeds.get)
    assert main(["--profile", "here", "plan", "--json"]) == 0  # a run with the profile loads them
    assert json.loads(capsys.readouterr().out)["spec"]["weights"] == max(speeds, key=speeds.get)
