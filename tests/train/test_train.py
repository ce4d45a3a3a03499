"""Training loop pieces: the loss, a real (short) training run, checkpoint resume, the official importer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_llama

from localchat.engine.heads import HeadScorer, RetainingHeads, head_shape, import_official
from localchat.errors import UserError
from localchat.train.loop import SMOOTH, Recipe, loss_fn, overlap, predict, train


def test_loss_matches_a_hand_computation():
    pred = torch.tensor([[[0.0, 1.0, 3.0, 3.5]]])  # [L=1, H=1, m=4]
    label = torch.tensor([[[0.5, 1.0, 1.0, 3.5]]])
    adjacent = torch.tensor([1, 0, 1, 0], dtype=torch.uint8)  # pairs (0,1) and (2,3) are neighbours
    reg, smooth = loss_fn(pred, label, adjacent)
    # SmoothL1 (beta 1): 0.5*0.5^2=0.125, 0, |2|-0.5=1.5, 0 -> mean 0.40625
    assert torch.isclose(reg, torch.tensor(0.40625))
    assert torch.isclose(smooth, torch.tensor((1.0 + 0.25) / 2))  # (0-1)^2 and (3-3.5)^2 over 2 pairs
    assert SMOOTH == 0.0025


def test_overlap_counts_shared_top_tokens():
    label = torch.arange(20.0).view(1, 1, 20)
    assert overlap(label, label) == 1.0 and overlap(-label, label) == 0.0


def _fake_files(tmp_path, shape, teacher, count=6, m=96):
    """Label files whose labels come from a hidden 'teacher' head: learnable."""
    feat_dim = (shape["q_heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    files = []
    g = torch.Generator().manual_seed(0)
    for i in range(count):
        feats = torch.randn(shape["layers"], m, feat_dim, generator=g)
        with torch.no_grad():
            lab = predict(teacher, feats)
        adjacent = torch.ones(m, dtype=torch.uint8)
        adjacent[-1] = 0
        path = tmp_path / f"sample-{i:05d}.safetensors"
        save_file({"features": feats.half(), "logit": lab, "prob": lab.softmax(-1), "adjacent": adjacent}, path)
        files.append(path)
    return files


def test_training_learns(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    shape = head_shape(model)
    teacher = RetainingHeads.random(model, d_r=16, seed=5)
    files = _fake_files(tmp_path, shape, teacher)
    recipe = Recipe(d_r=16, steps=60, lr=3e-3, warmup=5, eval_every=20, checkpoint_every=20, label="logit")
    log = train(shape, files[:5], files[5:], tmp_path / "a", recipe, {"model": "tiny"}, say=lambda m: None)
    first, last = log["eval"][0], log["eval"][-1]
    assert last["loss"] < first["loss"] and last["top10_overlap"] > 0.3
    heads = RetainingHeads.load(tmp_path / "a")
    assert heads.meta["recipe"]["steps"] == 60 and "top10_overlap" in heads.meta["final"]
    assert (tmp_path / "a" / "train-log.json").exists()


def test_resume_continues_from_the_checkpoint(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    shape = head_shape(model)
    files = _fake_files(tmp_path, shape, RetainingHeads.random(model, d_r=16, seed=5), count=4)
    recipe = Recipe(d_r=16, steps=30, lr=3e-3, warmup=5, eval_every=10, checkpoint_every=10, label="logit")
    train(shape, files[:3], files[3:], tmp_path / "full", recipe, {}, say=lambda m: None)
    # a run killed between the checkpoints at step 10 and 20, then started again
    part = tmp_path / "part"

    def kill_at_20(msg):
        if msg.startswith("step 20/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(shape, files[:3], files[3:], part, recipe, {}, say=kill_at_20)
    notes = []
    train(shape, files[:3], files[3:], part, recipe, {}, say=notes.append)
    assert "resumed at step 10" in notes
    a, b = RetainingHeads.load(tmp_path / "full"), RetainingHeads.load(part)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6)  # same data order, same updates


def test_import_official_checkpoint_naming(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    cfg = model.config
    in_dim = (4 + 2 * 2) * 16
    g = torch.Generator().manual_seed(1)
    weights = {"model.embed_tokens.weight": torch.randn(300, 64, generator=g)}  # other tensors are ignored
    for i in range(2):
        weights[f"model.layers.{i}.self_attn.fc1.weight"] = torch.randn(32, in_dim, generator=g).bfloat16()
        weights[f"model.layers.{i}.self_attn.fc2.weight"] = torch.randn(2, 32, generator=g).bfloat16()
        weights[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(64, 64, generator=g)
    save_file(weights, tmp_path / "model.safetensors")
    out = import_official(tmp_path, cfg, tmp_path / "ours")
    heads = RetainingHeads.load(out)
    assert heads.d_r == 32 and heads.meta["kind"] == "imported"
    x = torch.randn(5, in_dim)
    fc1, fc2 = (weights[f"model.layers.1.self_attn.fc{j}.weight"].float() for j in (1, 2))
    official = fc2 @ torch.nn.functional.silu(fc1 @ x.T)
    assert torch.allclose(heads.head(1)(x).T, official, atol=1e-5)  # bf16 kept: the release's values exactly
    HeadScorer(model, heads).close()  # fits the model
    torch.save({k: v for k, v in weights.items()}, tmp_path / "heads.bin")  # a release's .bin
    assert RetainingHeads.load(import_official(tmp_path / "heads.bin", cfg, tmp_path / "from-bin")).d_r == 32
    with pytest.raises(UserError, match="does not exist"):
        import_official(tmp_path / "nothing.safetensors", cfg, tmp_path / "x")
    bad = {"model.layers.0.self_attn.fc1.weight": torch.randn(32, in_dim + 1),
           "model.layers.0.self_attn.fc2.weight": torch.randn(2, 32),
           "model.layers.1.self_attn.fc1.weight": torch.randn(32, in_dim + 1),
           "model.layers.1.self_attn.fc2.weight": torch.randn(2, 32)}
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(UserError, match="does not fit"):
        import_official(tmp_path / "bad.safetensors", cfg, tmp_path / "x")
    (tmp_path / "notes.txt").write_text("not weights\n")
    with pytest.raises(UserError) as err:
        import_official(tmp_path / "notes.txt", cfg, tmp_path / "x")
    assert "\n" not in str(err.value) and len(str(err.value)) < 300 and "notes.txt" in str(err.value)
    assert not (tmp_path / "x").exists()


def test_split_holds_out_every_nth_file_and_keeps_the_rest():
    from localchat.train.dataset import split

    files = [Path(f"sample-{i:05d}.safetensors") for i in range(25)]
    train_files, held = split(files, 10)
    assert held == [files[9], files[19]]
    assert train_files == [f for i, f in enumerate(files) if i not in (9, 19)]


def _train_args(*argv):
    from localchat.cli import build_parser

    return build_parser().parse_args(["train-heads", "--out", "/tmp/unused", *argv])


def test_cpu_recipe_is_what_ships_and_the_paper_recipe_keeps_its_label():
    from localchat.train.cli import _recipe

    cpu = _recipe(_train_args())
    assert (cpu.label, cpu.steps, cpu.d_r) == ("prob", 1500, 256)
    paper = _recipe(_train_args("--recipe", "paper"))
    assert (paper.label, paper.steps, paper.d_r) == ("logit", 3000, 1024)
    mixed = _recipe(_train_args("--recipe", "paper", "--label", "prob", "--steps", "7"))
    assert (mixed.label, mixed.steps, mixed.d_r) == ("prob", 7, 1024)


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--d-r", "-1"), ("--lr", "0"), ("--warmup", "-2"),
                                         ("--keep", "0"), ("--eval-every-nth", "0"), ("--samples", "1"),
                                         ("--min-tokens", "10")])
def test_bad_training_settings_stop_before_the_model_loads(flag, value, capsys):
    from localchat.cli import main

    # The model path does not exist: the setting's error must come first, before any loading or labelling.
    assert main(["--model", "/no/such/model", "train-heads", "--out", "/tmp/unused", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["train-heads", "--model", "M", "--out", "D"], ["--model", "M", "train-heads", "--out", "D"],
                                  ["import-heads", "src", "-m", "M", "--out", "D"], ["-m", "M", "import-heads", "src", "--out", "D"]])
def test_model_flag_works_before_or_after_the_training_subcommands(argv):
    from localchat.cli import build_parser

    assert build_parser().parse_args(argv).model == "M"
    # Without it the embedded default stays (None), whichever side of the subcommand the other flags are.
    assert build_parser().parse_args([a for a in argv if a not in ("--model", "-m", "M")]).model is None


def test_train_heads_with_a_missing_model_after_the_subcommand_is_one_line(capsys):
    from localchat.cli import main

    assert main(["train-heads", "--model", "/no/such/model", "--out", "/tmp/unused-heads"]) == 2
    err = capsys.readouterr().err
    assert "/no/such/model" in err and err.count("\n") == 1 and "Traceback" not in err
