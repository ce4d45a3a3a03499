"""One benchmark cell: a (task, length, policy, budget) combination, its examples run one by one.

`python -m localchat.bench.cell SPEC_JSON` runs a cell in a fresh process (the runner's default), so
the peak RSS read at the end (`ru_maxrss`) belongs to that cell alone. Each example appends one JSON
row to the results file as soon as it finishes. Each example is claimed first (`lanes`), so several
`localchat bench` processes can share one results file without running an example twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from localchat.bench import lanes, machine
from localchat.bench.tasks import (
    OPENING,
    PASSKEY_DEPTHS,
    Sample,
    as_document,
    depth_for,
    make_sample,
    prompt_messages,
    score,
    score_turn,
)
from localchat.engine.encode import cuts
from localchat.engine.events import Done, Error
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError

if TYPE_CHECKING:
    from localchat.session import Session

FOLLOWUP_TOKENS = 8  # answer length of the earlier multiturn turns (the model's own answers are kept)
KEY_FIELDS = ("task", "length", "policy", "budget", "n", "seed", "model_spec", "heads", "chunk", "positions",
              "max_new_tokens", "turns", "weights", "kv", "sparse_prefill", "max_copies",
              "focus", "focus_window", "focus_spread")


@dataclass(frozen=True)
class Cell:
    task: str
    length: int
    policy: str
    budget: int | None  # None for `full`
    n: int  # examples in the cell (sets the depths)
    seed: int
    model_spec: str | None  # what --model said (None: the default model)
    heads: str | None  # locret only
    chunk: int
    positions: str
    max_new_tokens: int
    turns: int | None = None  # multiturn: unrelated turns between the document and the question
    weights: str | None = None  # --weights (None: the device's dtype)
    kv: str | None = None  # --kv int8/int4/int2 (None: unquantized cache)
    sparse_prefill: float | None = None  # omnikv only: --sparse-prefill R (None: full-attention reading)
    max_copies: int | None = None  # locret only: --max-copies N (None: no cap, the paper's rule)
    focus: int | None = None  # locret only: --focus K (None: the answer reads every kept unit, the paper's rule)
    focus_window: int | None = None  # --focus-window (None: LOCRET's default, 32)
    focus_spread: int | None = None  # --focus-spread (None: LOCRET's default, 16)

    def key(self, example: int) -> str:
        return json.dumps([*(getattr(self, f) for f in KEY_FIELDS), example])

    def label(self) -> str:
        budget = "" if self.budget is None else f" b={self.budget}"
        quant = "".join(f" {name}={v:g}" if isinstance(v, float) else f" {name}={v}" for name, v in
                        (("weights", self.weights), ("kv", self.kv), ("sparse-prefill", self.sparse_prefill),
                         ("max-copies", self.max_copies), ("focus", self.focus),
                         ("focus-window", self.focus_window), ("focus-spread", self.focus_spread))
                        if v is not None)
        return f"{self.task} {self.length} {self.policy}{budget}{quant}"


def row_key(row: dict) -> str:
    return json.dumps([*(row.get(f) for f in KEY_FIELDS), row.get("example")])


def example_seed(seed: int, task: str, length: int, example: int) -> int:
    """The same sample for every policy and budget (paired comparisons)."""
    digest = hashlib.sha256(f"{seed}:{task}:{length}:{example}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def sample_for(cell: Cell, tokenizer, example: int) -> Sample:
    seed = example_seed(cell.seed, cell.task, cell.length, example)
    try:
        extra = {"turns": cell.turns} if cell.turns is not None else {}
        return make_sample(cell.task, tokenizer, cell.length, seed, depth_for(example, cell.n), **extra)
    except ValueError as exc:  # a length too short for the task
        raise UserError(f"{cell.task} at {cell.length} tokens: {exc}") from exc


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_engine(cell: Cell):
    from localchat.engine.engine import Engine
    from localchat.planning.load import admit

    # with the memory check of policies that keep every token, as in the app
    return Engine.load(cell.model_spec, chunk=cell.chunk, say=_stderr, weights=cell.weights, admit=admit)


def use_policy(engine, cell: Cell) -> None:
    """The cell's policy, resolved as the app resolves flags (LOCRET's n_s drops to budget // 4 where the card's
    n_s >= budget). One thing differs: a LOCRET cell without --max-copies runs the paper's rule (no cap), also
    where the model card sets a cap, so that a row's `max_copies` says what ran; so do --focus (none: the paper's
    read) and, with it, --focus-window and --focus-spread (none: LOCRET's defaults, not a card's)."""
    from localchat.engine.policies import policy_class
    from localchat.planning.load import use_policy
    from localchat.planning.resolve import policy_spec

    cls = policy_class(cell.policy)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    paper = {"max_copies": 0, "focus": 0, "focus_window": defaults.get("focus_window"),
             "focus_spread": defaults.get("focus_spread")}
    given = {name: getattr(cell, name) for name in paper}
    options = {name: paper[name] if value is None and name in cls.options else value for name, value in given.items()}
    flags = {"budget": cell.budget, "heads": cell.heads, "sparse_prefill": cell.sparse_prefill,
             "positions": cell.positions, **options}
    spec, _ = policy_spec(cell.policy, {k: v for k, v in flags.items() if v is not None}, {}, engine.card,
                          engine.device.type)
    use_policy(engine, spec, kv=cell.kv or "none")  # the cache type is chosen per cache (Engine.new_cache)


def run_cell(cell: Cell, examples: list[int], out: Path, *, engine=None, memory: str = "subprocess",
             progress: tuple[int, int] = (0, 0), command: str = "", say: Callable[[str], None] = _stderr) -> None:
    """Run `examples` of `cell` and append a row per example to `out` (JSONL)."""
    engine = engine or load_engine(cell)
    use_policy(engine, cell)
    cuda = engine.device.type == "cuda"
    rss_load = machine.max_rss_bytes()
    common = {
        "model": engine.name, "device": engine.device.type, "hardware": machine.hardware(),
        "versions": machine.versions(), "command": command, "memory_mode": "cuda" if cuda else memory,
        "stabilizers": getattr(engine.policy, "stabilizers", None) if engine.policy.evicts else None,  # LOCRET's n_s
        "local": engine.policy.local if engine.policy.evicts else None,
    }
    at, total = progress
    for example in examples:
        held = lanes.claim(out, cell.key(example))
        if held is None or cell.key(example) in {row_key(r) for r in lanes.read_rows(out)}:
            if held:
                held.release()
            say(f"bench: {cell.label()} #{example}: run by another process, skipped")
            continue
        try:
            sample = sample_for(cell, engine.tokenizer, example)
            t0 = time.perf_counter()
            result = run_example(engine, sample, cell.max_new_tokens)
            peak = torch.cuda.max_memory_allocated() if cuda else machine.max_rss_bytes()
            row = {**dataclasses.asdict(cell), "example": example, **common, **_sample_fields(sample, cell, example),
                   **result, "peak_memory_bytes": peak, "rss_after_load_bytes": rss_load,
                   "wall_s": round(time.perf_counter() - t0, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            lanes.append_row(out, json.dumps(row))
        finally:
            held.release()
        at += 1
        say(_progress_line(at, total, cell, example, row))


def _sample_fields(sample: Sample, cell: Cell, example: int) -> dict:
    return {"sample_seed": example_seed(cell.seed, cell.task, cell.length, example), "depth": sample.depth,
            "n_tokens": sample.n_tokens, "needle_tokens": list(sample.needle_tokens),
            "question": sample.question, "expected": list(sample.answers)}


def _progress_line(at: int, total: int, cell: Cell, example: int, row: dict) -> str:
    head = f"bench [{at}/{total}] {cell.label()} #{example}"
    if row["error"]:
        return f"{head}: error: {row['error']}"
    return (f"{head}: score {row['score']:.2f}, prefill {row['prefill_s']:.1f}s ({row['prefill_tps']:,.0f} tok/s), "
            f"decode {row['decode_tps']:.1f} tok/s")


def _complete(engine, messages: list[dict], max_new: int, answers: tuple[str, ...]) -> tuple[Done | str, float | None]:
    """Greedy answer to `messages`: the Done event (or the error message), and the share of the answer's
    tokens in the prompt still cached after answering (`answer_kept`, None where it can't be located)."""
    settings = GenerationSettings(max_new_tokens=max_new)
    text = engine.render(messages)
    ids = engine.encode(text)
    cache = engine.new_cache(len(ids), max_new)
    for event in engine.continue_on(cache, ids, 0, settings):
        if isinstance(event, Done):
            return event, answer_kept(engine.tokenizer, text, ids, answers, cache)
        if isinstance(event, Error):
            return event.message, None
    return "no answer", None


def answer_tokens(tokenizer, text: str, ids: list[int], answers: tuple[str, ...]) -> list[int]:
    """Prompt token indices that overlap any occurrence of an expected answer in `text` (the needle's
    value where the document states it). Empty when the tokenizer gives no offsets or they disagree."""
    spans = []
    for answer in answers:
        at = text.find(answer)
        while answer and at >= 0:
            spans.append((at, at + len(answer)))
            at = text.find(answer, at + 1)
    found, done, start = [], 0, 0
    for end in [*cuts(tokenizer, text), len(text)]:  # the encoder's pieces: a 1M-token prompt's offsets stay small
        try:
            enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer: no offsets
            return []
        n = len(enc["input_ids"])
        if list(enc["input_ids"]) != list(ids[done:done + n]):
            return []
        found += [done + i for i, (a, b) in enumerate(enc["offset_mapping"])
                  if any(a + start < e and b + start > s for s, e in spans)]
        done, start = done + n, end
    return found if done == len(ids) else []


def answer_kept(tokenizer, text: str, ids: list[int], answers: tuple[str, ...], cache) -> float | None:
    """The share of the answer's prompt tokens still cached, over layers and KV heads (1.0 for a policy
    that keeps every unit; OmniKV keeps all and picks per step, so 1.0 says nothing of its picks)."""
    where = answer_tokens(tokenizer, text, ids, answers)
    if not where:
        return None
    wanted = torch.tensor(where)
    held = total = 0
    for layer in cache.layers:
        positions = layer.positions  # [H_kv, n] true positions
        held += int(torch.isin(positions, wanted.to(positions.device)).sum())
        total += positions.shape[0] * len(where)
    return round(held / total, 4)


def _timing(turn: int, done: Done) -> dict:
    return {"turn": turn, "prompt_tokens": done.prompt_tokens, "prefill_s": round(done.prefill_s, 4),
            "ttft_s": round(done.ttft_s, 4), "total_s": round(done.prefill_s + done.decode_s, 4),
            "kv_tokens": done.kv_tokens}


NEEDLE_SPAN = 20  # tokens from the asked needle's offset counted by `needle_kept` (its sentence)


def _turns(engine, sample: Sample, max_new: int) -> Iterator[tuple[Session, int, Done | str]]:
    """The sample's user turns the way the app runs a chat: one Session, each turn reads only its new tokens
    and the model's own answers stay in the compressed cache. The first turn attaches the document (multiturn:
    with OPENING; passkeys: with the first question). Every turn may answer `max_new` tokens but multiturn's
    unrelated ones (FOLLOWUP_TOKENS). Yields (session, turn from 1, the turn's Done or error); stops at an error."""
    from localchat.session import Session

    session = Session(engine)
    users = [m["content"] for m in sample.messages if m["role"] == "user"]
    for turn, content in enumerate(users, start=1):
        first = OPENING if sample.task == "multiturn" else sample.question
        question, docs = (first, [as_document(sample.document)]) if turn == 1 else (content, [])
        short = sample.task == "multiturn" and turn < len(users)
        settings = GenerationSettings(max_new_tokens=FOLLOWUP_TOKENS if short else max_new)
        done: Done | str = "no answer"
        for event in session.send(question, docs, settings):
            if isinstance(event, Done):
                done = event
            elif isinstance(event, Error):
                done = event.message
        yield session, turn, done
        if isinstance(done, str):
            return


def _needle_kept(session: Session, needle_token: int) -> float:
    """The share of the needle's units (its first NEEDLE_SPAN tokens) still cached, over layers and KV heads."""
    doc = session.attachments[0]
    at = doc.start + needle_token
    return round(session.kept_share(at, min(at + NEEDLE_SPAN, doc.end)), 4)


def _conversation(engine, sample: Sample, max_new: int) -> tuple[Done | str, list[dict], int, float | None]:
    """multiturn: the last Done (or the error), every turn's timing, the tokens the conversation put through
    the model, and the share of the asked needle's units still cached at the end."""
    timings: list[dict] = []
    for session, turn, done in _turns(engine, sample, max_new):
        if isinstance(done, str):
            return done, timings, session.fed, None
        timings.append(_timing(turn, done))
    return done, timings, session.fed, _needle_kept(session, sample.needle_token)


def _passkeys(engine, sample: Sample, max_new: int) -> tuple[Done | str, list[dict], int]:
    """passkeys: the first (reading) turn's Done (or the error), one entry per key asked (its depth, answer,
    the turn's output, whether it holds its key, its needle's units still cached after the turn, the turn's
    timing), and the tokens the conversation put through the model."""
    keys: list[dict] = []
    first: Done | str = "no answer"
    for session, turn, done in _turns(engine, sample, max_new):
        if isinstance(done, str):
            return done, keys, session.fed
        first = done if turn == 1 else first
        i = turn - 1
        keys.append({"depth": PASSKEY_DEPTHS[i], "answer": sample.answers[i], "output": done.text,
                     "found": score_turn(sample, i, done.text),
                     "needle_kept": _needle_kept(session, sample.needle_tokens[i]), **_timing(turn, done)})
    return first, keys, session.fed


def run_example(engine, sample: Sample, max_new: int) -> dict:
    """Answer one sample; multiturn and passkeys run as a conversation in one Session, every turn timed.
    passkeys: `score` is the share of keys found, `keys` has each turn's answer, and the timings are the
    first turn's (the one that reads the document)."""
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    followups: list[dict] = []
    conversation = needle_kept = kept = keys = None
    if sample.task == "passkeys":
        done, keys, conversation = _passkeys(engine, sample, max_new)
    elif sample.task == "multiturn":
        done, followups, conversation, needle_kept = _conversation(engine, sample, max_new)
    else:
        done, kept = _complete(engine, prompt_messages(sample), max_new, sample.answers)
    if isinstance(done, str):
        return {**_failed(done), **({"keys": keys} if keys is not None else {})}
    if keys is None:
        value, output = float(score(sample, done.text)), done.text
    else:
        value, output = sum(k["found"] for k in keys) / len(sample.answers), "\n".join(k["output"] for k in keys)
        needle_kept = round(sum(k["needle_kept"] for k in keys) / len(keys), 4)
    return {
        "output": output, "score": value, "correct": value >= 1.0, "error": None,
        "prompt_tokens": done.prompt_tokens, "new_tokens": done.new_tokens, "stop_reason": done.stop_reason,
        "prefill_s": round(done.prefill_s, 4), "decode_s": round(done.decode_s, 4), "ttft_s": round(done.ttft_s, 4),
        "prefill_tps": round(done.prefill_tps, 2), "decode_tps": round(done.decode_tps, 2),
        "kv_tokens": done.kv_tokens, "kv_bytes": done.kv_bytes, "kv_full_bytes": done.kv_full_bytes,
        "compression": round(done.compression, 3), "followups": followups or None,
        "conversation_tokens": conversation, "needle_kept": needle_kept, "answer_kept": kept,
        **({"keys": keys} if keys is not None else {}),
    }


def _failed(message: str) -> dict:
    return {"output": None, "score": None, "correct": None, "error": message, "followups": None}


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    try:
        run_cell(Cell(**spec["cell"]), spec["examples"], Path(spec["out"]), progress=tuple(spec["progress"]),
                 command=spec.get("command", ""))
    except UserError as exc:
        print(f"localchat: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
