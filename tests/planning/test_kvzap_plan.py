"""Planning with a KVzap scorer: a card whose default is KVzap gets it under a profile made for another model, with a
budget that fits the profile's memory, and the plan counts the scorer and names where it comes from."""

from __future__ import annotations

import json

from localchat.cli import main

GIB = 2**30


def plan(capsys, *argv) -> tuple[dict, str]:
    assert main([*argv, "plan", "--json"]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_rtx4090_with_qwen3_8b_plans_kvzap_with_a_budget_that_fits(capsys):
    data, err = plan(capsys, "--profile", "rtx4090", "--model", "qwen3-8b")
    assert data["spec"]["policy"]["name"] == "kvzap" and data["fits"] and data["memory"] == 24 * GIB
    assert data["budget"] == 16384 and data["spec"]["policy"]["stabilizers"] == 2500
    assert 0.13 * GIB < data["bytes"]["KVzap scorer"] < 0.16 * GIB  # 75.7M parameters at bf16, its 36 layers
    assert "retaining heads" not in data["bytes"]
    assert any("KVzap (mlp, 75.7M parameters), the release nvidia/KVzap-mlp-Qwen3-8B" in n for n in data["notes"])
    assert ("sets policy, positions, budget, local, stabilizers for meta-llama/Llama-3.1-8B-Instruct; qwen3-8b takes "
            "its own") in err


def test_an_8_gb_card_lowers_the_budget_and_the_profiles_own_model_keeps_its_settings(capsys):
    small, _ = plan(capsys, "--profile", "rtx4060", "--model", "qwen3-8b")
    assert small["spec"]["policy"]["name"] == "kvzap" and small["fits"] and 1024 < small["budget"] < 16384
    llama, err = plan(capsys, "--profile", "rtx4090")
    assert llama["spec"]["policy"]["name"] == "locret" and llama["budget"] == 16384 and "takes its own" not in err
    offered, _ = plan(capsys, "--profile", "rtx4090", "--policy", "kvzap")  # Llama offers KVzap beside LOCRET
    assert offered["spec"]["policy"]["name"] == "kvzap" and offered["fits"]
    assert offered["bytes"]["KVzap scorer"] < 0.05 * GIB  # the linear release: 1.05M parameters


def test_the_default_model_ships_a_kvzap_scorer(capsys):
    """`--policy kvzap` on the embedded SmolLM2 reads the scorer that ships beside its LOCRET heads."""
    from localchat.engine import kvzap
    from localchat.planning.resolve import heads_dir_for, resolve

    spec = resolve({"policy": "kvzap"}, quiet=True)
    where = heads_dir_for(spec.policy, spec.card)
    assert where is not None and where.name == "kvzap" and where.parent.name == "smollm2-135m-instruct"
    config = kvzap.check_release(where)
    assert (config["input_dim"], config["output_dim"], config["n_modules"]) == (576, 3, 30)
    data, _ = plan(capsys, "--policy", "kvzap")
    assert any(n.startswith("scorer: KVzap (linear, 0.1M parameters) from ") for n in data["notes"])
