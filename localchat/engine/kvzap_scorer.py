"""A KVzap scorer in memory and at work: the per-layer modules of a release (engine/kvzap.py, the format), and
forward hooks that score each new token of every scored layer from the hidden state its attention reads.

The hidden state is the output of the layer's `input_layernorm` (what kvpress's hook on the attention module
receives as `hidden_states`); a hook on the norm fires in transformers' forward and in engine/decode_step.py's
steps alike (a hooked norm keeps that step off its one-call C++ layer path)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from localchat.engine import kvzap, weights_check
from localchat.engine.heads import UnitScorer
from localchat.engine.layer_kinds import layer_kinds
from localchat.errors import UserError

RANGE = "localchat.kvzap"  # the profiler's name for a chunk's scoring


def _module(config: dict) -> nn.Module:
    d, h, w = config["input_dim"], config["output_dim"], config.get("hidden_dim")
    if w is None:
        return nn.Linear(d, h)
    return nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, h))


class KVzapScorer(nn.Module):
    """The modules of the layers a model evicts (all of a dense model's; a hybrid's growing layers), keyed by
    layer index; `config` is the release's."""

    def __init__(self, config: dict, scored: list[int] | None = None, meta: dict | None = None):
        super().__init__()
        self.config = dict(config)
        self.meta = dict(meta or {})
        self.scored = list(range(config["n_modules"]) if scored is None else scored)
        self.layers = nn.ModuleDict({str(i): _module(config) for i in self.scored})

    @property
    def variant(self) -> str:
        return kvzap.variant(self.config)

    def head(self, i: int) -> nn.Module | None:
        return self.layers[str(i)] if str(i) in self.layers else None

    @classmethod
    def random(cls, model, hidden_dim: int | None = None, seed: int = 0) -> KVzapScorer:
        """An untrained scorer for `model` (tests and the random-scorer ablation)."""
        torch.manual_seed(seed)
        cfg = model.config
        config = {"model_type": "kvzap", "input_dim": cfg.hidden_size, "output_dim": cfg.num_key_value_heads,
                  "hidden_dim": hidden_dim, "n_modules": cfg.num_hidden_layers}
        return cls(config, growing(model), {"kind": "random", "seed": seed})

    @classmethod
    def load(cls, directory: Path | str, scored: list[int] | None = None) -> KVzapScorer:
        """The release in `directory` (checked against its own config; fetched ones against their sha256 too);
        only the modules of `scored` layers are kept (default all)."""
        directory = Path(directory)
        if (directory / weights_check.STAMP).is_file():
            damage = weights_check.problem(directory)
            if damage:
                raise UserError(f"the KVzap scorer in {directory} is damaged ({damage}); fetch it again "
                                f"(`localchat heads fetch MODEL` after deleting {directory}) or pass other --heads")
        config = kvzap.check_release(directory)
        tensors = load_file(directory / kvzap.WEIGHTS)
        scorer = cls(config, scored, {"kind": "kvzap", "source": str(directory)})
        keep = {k.removeprefix("layers."): v.float() for k, v in tensors.items() if int(k.split(".")[1]) in set(scorer.scored)}
        scorer.layers.load_state_dict(keep, strict=True)
        return scorer

    def save(self, directory: Path | str, dtype: torch.dtype = torch.float32) -> None:
        """As a release (config.json + model.safetensors, kvpress's names): every layer must have its module."""
        if self.scored != list(range(self.config["n_modules"])):
            raise ValueError("only a scorer with a module for every layer saves as a release")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {f"layers.{k}": v.detach().to(dtype).contiguous().cpu() for k, v in self.layers.state_dict().items()}
        save_file(state, directory / kvzap.WEIGHTS, metadata={"format": "pt"})
        import json

        config = {"architectures": ["KVzapModel"], **self.config, "dtype": str(dtype).removeprefix("torch.")}
        (directory / kvzap.CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def check_fits(self, model) -> None:
        cfg = model.config
        kvzap.check_fits(self.config, cfg.hidden_size, cfg.num_key_value_heads, cfg.num_hidden_layers,
                         self.meta.get("source", "this scorer"))


def growing(model) -> list[int]:
    """The layers whose cache grows with the document (the ones a policy evicts)."""
    return [i for i, kind in enumerate(layer_kinds(model.config)) if kind.grows]


def norms(model) -> list[nn.Module | None]:
    """Each decoder layer's input norm: its output is what the layer's attention reads."""
    return [getattr(layer, "input_layernorm", None) for layer in model.model.layers]


class KVzapHooks(UnitScorer):
    """A KVzap scorer on each scored layer's input-norm output (forward hooks on the norms)."""

    range_name = RANGE

    def __init__(self, model, scorer: KVzapScorer):
        scorer.check_fits(model)
        super().__init__(model, scorer, model.config.num_hidden_layers)
        for i, norm in enumerate(norms(model)):
            if self.by_layer[i] is not None:
                if norm is None:
                    raise UserError(f"layer {i} of this model has no input_layernorm for the KVzap scorer to read")
                self.handles.append(norm.register_forward_hook(
                    lambda m, a, out, i=i: self.take_input(i, out.reshape(-1, out.shape[-1]))))
