"""`localchat train-heads`, `localchat import-heads` and `localchat heads fetch`: argument wiring for the heads pieces."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from localchat.errors import UserError


def _model_flag(p) -> None:
    """`--model` after the subcommand too (SUPPRESS keeps `localchat --model X train-heads ...`)."""
    p.add_argument("--model", "-m", default=argparse.SUPPRESS,
                   help="Hugging Face id, local HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")


def add_parser(sub) -> None:
    p = sub.add_parser("train-heads", help="train LOCRET retaining heads for a model (backbone frozen)")
    _model_flag(p)
    p.add_argument("--out", required=True, help="directory for heads.safetensors, heads.json, the log and the card")
    p.add_argument("--data", default=None, help="label files directory (default OUT/data); reused and extended")
    p.add_argument("--samples", type=int, default=160, help="training prompts to label (default 160)")
    p.add_argument("--min-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=None, help="default: the model's window minus 600")
    p.add_argument("--recipe", choices=["cpu", "paper"], default="cpu", help="cpu: about an hour here; paper: GPU")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--d-r", type=int, default=None, help="hidden width of each head (cpu 256, paper 1024)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--label", choices=["logit", "prob"], default=None,
                   help="prob (the cpu recipe's, what ships) or logit (the paper's label; the paper recipe's)")
    p.add_argument("--eval-every-nth", type=int, default=10, help="every Nth sample is held out (default 10)")
    p.add_argument("--keep", type=int, default=768, help="tokens of features kept per sample (default 768)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scorer", choices=["locret", "kvzap"], default="locret",
                   help="locret: retaining heads (default); kvzap: a linear KVzap scorer fit in closed form on KVzip+ "
                        "labels (--samples, --min-tokens, --max-tokens (default 1500), --seed, --eval-every-nth)")

    q = sub.add_parser("import-heads", help="convert an official LOCRET heads file into our format, or copy a KVzap "
                                            "release folder (the manual path of `heads fetch`)")
    q.add_argument("source", help="the release's .bin (e.g. llama-3.1-8B-instruct.bin), or a .safetensors file or "
                                  "a directory of them, or a KVzap release folder (config.json + model.safetensors)")
    q.add_argument("--out", required=True)
    _model_flag(q)


def _recipe(args):
    from localchat.train.loop import PAPER, Recipe

    base = PAPER if args.recipe == "paper" else Recipe()
    given = {"steps": args.steps, "d_r": args.d_r, "lr": args.lr, "warmup": args.warmup, "label": args.label}
    return replace(base, seed=args.seed, **{k: v for k, v in given.items() if v is not None})


def check(args) -> None:
    """Raise UserError for a bad training setting, before any labelling starts."""
    for flag, value in (("--steps", args.steps), ("--d-r", args.d_r), ("--eval-every-nth", args.eval_every_nth),
                        ("--keep", args.keep)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    if args.lr is not None and not args.lr > 0:
        raise UserError(f"--lr must be above 0 (got {args.lr})")
    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more (got {args.warmup})")
    if args.samples < 2 or args.min_tokens < 64 or (args.max_tokens and args.max_tokens < args.min_tokens):
        raise UserError("need --samples >= 2 and 64 <= --min-tokens <= --max-tokens")


def run_train(args, engine) -> int:
    from localchat.engine.heads import head_shape
    from localchat.train import dataset
    from localchat.train.data import KINDS, make_samples
    from localchat.train.loop import train

    out = Path(args.out)
    data = Path(args.data) if args.data else out / "data"
    max_tokens = args.max_tokens or max(args.min_tokens + 1, (engine.window or 8192) - 600)
    recipe = _recipe(args)
    t0 = time.time()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    samples = make_samples(engine.tokenizer, args.samples, args.seed, args.min_tokens, max_tokens)
    files = dataset.build(engine, samples, data, keep=args.keep, say=say)
    train_files, held = dataset.split(files, args.eval_every_nth)
    t1 = time.time()
    meta = {"model": engine.name, "kind": "trained", "label": recipe.label,
            "data": {"samples": len(files), "held_out": len(held), "kinds": list(KINDS),
                     "tokens": [args.min_tokens, max_tokens], "seed": args.seed}}
    log = train(head_shape(engine.model), train_files, held, out, recipe, meta, say=say)
    t2 = time.time()
    card = {
        "command": "localchat " + " ".join(sys.argv[1:]) if sys.argv and "localchat" in sys.argv[0] else "localchat train-heads",
        "recipe": asdict(recipe), "data": meta["data"], "label": recipe.label,
        "final_eval": log["eval"][-1] if log["eval"] else {}, "first_eval": log["eval"][0] if log["eval"] else {},
        "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "minutes": {"labels": round((t1 - t0) / 60, 1), "training": round((t2 - t1) / 60, 1)},
        "date": time.strftime("%Y-%m-%d"),
    }
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(out)
    return 0


def run_import(args) -> int:
    from transformers import AutoConfig

    from localchat.engine import kvzap
    from localchat.engine.heads import import_official
    from localchat.engine.loading import resolve

    source, _ = resolve(args.model)
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as exc:
        raise UserError(f"cannot read the config of {args.model}: {str(exc).splitlines()[0]}") from exc
    if kvzap.is_kvzap(args.source):
        print(import_kvzap(Path(args.source), config, Path(args.out)))
        return 0
    print(import_official(args.source, config, args.out))
    return 0


def import_kvzap(source: Path, config, out: Path) -> Path:
    """A KVzap release folder copied verbatim into `out` (its config.json and model.safetensors, with the
    weights' sha256 stamp) once its tensors match its config and its config fits the model of `config`."""
    import shutil

    from localchat.engine import kvzap, weights_check

    release = kvzap.check_release(source)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kvzap.check_fits(release, text.hidden_size, getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                     text.num_hidden_layers, str(source))
    out.mkdir(parents=True, exist_ok=True)
    for name in (kvzap.CONFIG, kvzap.WEIGHTS):
        shutil.copyfile(source / name, out / name)
    weights_check.stamp(out)
    return out


def add_heads_parser(sub) -> None:
    p = sub.add_parser("heads", help="trained scorers of carded models from official releases: LOCRET retaining heads, "
                                     "KVzap scorers")
    hs = p.add_subparsers(dest="heads_command", metavar="fetch", required=True)
    f = hs.add_parser("fetch", help="download MODEL's official trained scorer (a LOCRET heads-only file, converted, or "
                                    "a KVzap release, as it is), check it, install it into the cache")
    f.add_argument("name", nargs="?", metavar="MODEL",
                   help="a model card's id, alias or upstream id (default: --model, else the embedded default model)")
    f.add_argument("--kind", choices=["locret", "kvzap"], default=None,
                   help="which release, where a card has both (default: kvzap where the card's policy is kvzap or it "
                        "has no LOCRET release, else locret)")
    f.add_argument("--revision", default=None,
                   help="branch, tag or commit of the release (default: the commit or branch the model card names)")


def run_heads(args) -> int:
    """`localchat heads fetch [MODEL]`: print the cache directory holding the fetched scorer."""
    from localchat.engine import cards
    from localchat.planning import heads_fetch as hf

    name = args.name or getattr(args, "model", None)
    card = cards.find_card(name) if name else cards.default_card()
    if card is None:
        raise UserError(f"no model card for {name!r}; carded models with an official LOCRET release: {hf.releases_line()}; "
                        f"with a KVzap release: {hf.kvzap_releases_line()}")
    kind = getattr(args, "kind", None) or hf.default_kind(card)
    fetch = hf.fetch_kvzap if kind == "kvzap" else hf.fetch_heads
    print(fetch(card, revision=args.revision))
    return 0


def run(args) -> int:
    """`train-heads`, `import-heads` or `heads`, as `args.command` says."""
    if args.command == "import-heads":
        return run_import(args)
    if args.command == "heads":
        return run_heads(args)
    from localchat.engine.engine import Engine

    check(args)  # before the model loads
    engine = Engine.load(args.model, chunk=args.chunk)
    if args.scorer == "kvzap":
        from localchat.train import kvzap

        return kvzap.run_train(args, engine)
    return run_train(args, engine)
