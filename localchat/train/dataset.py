"""Turn training samples into label files on disk, once (resumable): features + labels per sample.

Each sample becomes `DIR/sample-NNNNN.safetensors` with
  features [L, m, F] float16   pre-RoPE [Q|K|V] of m kept prompt tokens (F = (H_q + 2·H_kv)·d)
  logit, prob [L, H_kv, m]     the two label variants for those tokens (train/labels.py)
  full_logit, full_prob [L, H_kv, n]  labels of every prompt token (for oracle and overlap checks)
  positions [m] int64, adjacent [m] uint8 (1 when the next kept token is the next prompt token)
The m tokens are whole windows: those holding a needle or the question, the windows the labels
rank highest, and random windows (features of every token of an 8K prompt would be 470 MB).

A file is written in DIR/partial/ and renamed into DIR when whole (safetensors writes through a temporary
file of its own beside the target). What a killed run leaves there, or left in DIR before this, is removed
by the next run once LEFTOVER_AGE old.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings
from localchat.paths import PARTIAL, SAFETENSORS_TMP, collect_partial
from localchat.train.labels import extract

if TYPE_CHECKING:
    from localchat.train.data import TrainSample

OLD_TMP = re.compile(r"sample-\d{5}\.tmp")  # what versions before PARTIAL renamed from, in DIR
LEFTOVER_AGE = 300.0  # seconds; a younger file may be another run's write in progress


def collect_leftovers(out: Path, older_than: float = LEFTOVER_AGE) -> int:
    """Remove the partial files killed runs left in `out`; how many."""
    return collect_partial(out, lambda name: bool(OLD_TMP.fullmatch(name) or SAFETENSORS_TMP.fullmatch(name)),
                           older_than)


def needle_token_offsets(engine, prompt_text: str, needles: list[str]) -> list[tuple[int, int]]:
    """Approximate token spans of each needle string inside the rendered prompt."""
    spans = []
    for needle in needles:
        at = prompt_text.find(needle)
        if at >= 0 and needle:
            start = engine.count_tokens(prompt_text[:at])
            spans.append((start, start + engine.count_tokens(needle)))
    return spans


def choose_windows(n: int, importance: torch.Tensor, spans: list[tuple[int, int]], window: int, keep: int,
                   rng: random.Random) -> torch.Tensor:
    """Sorted token positions: windows covering `spans`, the tail, the top windows, then random ones."""
    n_win = (n + window - 1) // window
    chosen: list[int] = []
    add = lambda w: None if w in chosen or not 0 <= w < n_win else chosen.append(w)  # noqa: E731
    for a, b in spans:
        for w in range(a // window, (max(b, a + 1) - 1) // window + 1):
            add(w)
    add(n_win - 1)
    add(n_win - 2)
    per_win = torch.nn.functional.pad(importance, (0, n_win * window - n)).view(n_win, window).mean(-1)
    for w in per_win.argsort(descending=True)[:3].tolist():
        add(w)
    rest = [w for w in range(n_win) if w not in chosen]
    rng.shuffle(rest)
    budget = max(keep // window, len(chosen))
    chosen += rest[: max(0, budget - len(chosen))]
    pos = torch.cat([torch.arange(w * window, min((w + 1) * window, n)) for w in sorted(chosen)])
    return pos


def _importance(full_logit: torch.Tensor) -> torch.Tensor:
    """Per token: mean over layers and heads of the z-scored label."""
    z = (full_logit - full_logit.mean(-1, keepdim=True)) / (full_logit.std(-1, keepdim=True) + 1e-6)
    return z.mean(dim=(0, 1))


def build(engine, samples: list[TrainSample], out: Path, *, chunk: int = 1024, window: int = 64,
          keep: int = 768, say=print) -> list[Path]:
    """Write one label file per sample (skipping those already written); return all paths."""
    scratch = out / PARTIAL
    scratch.mkdir(parents=True, exist_ok=True)
    collect_leftovers(out)
    paths = []
    for i, sample in enumerate(samples):
        path = out / f"sample-{i:05d}.safetensors"
        paths.append(path)
        if path.exists():
            continue
        message = sample.message()
        answer = sample.answer
        if answer is None:  # natural text: the model's own greedy answer
            done = list(engine.chat([message], GenerationSettings(max_new_tokens=32)))[-1]
            answer = done.text.strip() if isinstance(done, Done) and done.text.strip() else "I do not know."
        prompt_text = engine.render([message])
        prompt_ids = engine.encode(prompt_text)
        answer_ids = engine.encode(answer)
        lab = extract(engine.model, prompt_ids, answer_ids, chunk=chunk)
        n = len(prompt_ids)
        spans = needle_token_offsets(engine, prompt_text, sample.needles)
        pos = choose_windows(n, _importance(lab.labels["logit"]), spans, window, keep, random.Random(sample.seed))
        adjacent = torch.zeros(len(pos), dtype=torch.uint8)
        adjacent[:-1] = (pos[1:] == pos[:-1] + 1).to(torch.uint8)
        tensors = {
            "features": lab.features[:, pos].contiguous(),
            "logit": lab.labels["logit"][:, :, pos].contiguous(),
            "prob": lab.labels["prob"][:, :, pos].contiguous(),
            "full_logit": lab.labels["logit"].contiguous(),
            "full_prob": lab.labels["prob"].contiguous(),
            "positions": pos,
            "adjacent": adjacent,
        }
        meta = {"kind": sample.kind, "seed": str(sample.seed), "n_tokens": str(n), "answer": answer,
                "spans": json.dumps(spans)}
        tmp = scratch / path.name
        save_file(tensors, str(tmp), metadata=meta)  # through a temporary file of its own, in scratch too
        os.replace(tmp, path)  # atomic: an interrupted run leaves no half file in `out`
        say(f"labels {i + 1}/{len(samples)}: {sample.kind}, {n} tokens, {len(pos)} kept")
    return paths


def split(files: list[Path], every_nth: int = 10) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): every `every_nth` file, counting from 1, is held out."""
    return [f for i, f in enumerate(files, 1) if i % every_nth], files[every_nth - 1::every_nth]


def load(path: Path, names: tuple[str, ...] = ("features", "logit", "prob", "adjacent")) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in names}
