"""Are the pass key's tokens in the kept set when the model answers? (bench/results/baselines-strength/)

For each policy and example: build the bench cell's prompt and policy (as `localchat bench` does), answer,
and count, per (layer, KV head), whether the cache holds the key's digit tokens (both occurrences in the
needle sentence) at the first decoded token and at the end. For SAGE-KV it also checks the spec's exact
per-query-head rule (§2.3): are the digits among each query head's own top-k of the last prompt token's
logits, and did the KV head that serves it keep them?

    python bench/experiments/baselines_diagnose.py --policies sagekv,corm,roco --examples 3,9,15

`--corm-recency` is a what-if: CORM's cap ranks the keys by how recently they were last found important (then
by the latest attention) instead of by votes.
"""

from __future__ import annotations

import argparse

import torch

from localchat.bench.cell import Cell, answer_tokens, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages, score
from localchat.engine.events import Done, Notice, Token
from localchat.engine.sampling import GenerationSettings

SETTINGS: dict[str, str] = {}


def held(cache, where: list[int]) -> tuple[float, float, float]:
    """(share of (layer, head) pairs holding every key token, holding at least one full copy of the key,
    mean share of key tokens held)."""
    wanted = torch.tensor(where)
    half = len(where) // 2
    copies = [wanted[:half], wanted[half:]] if half else [wanted]
    every = one = share = pairs = 0
    for layer in cache.layers:
        pos = layer.positions.cpu()  # [H_kv, n]
        for h in range(pos.shape[0]):
            got = torch.isin(wanted, pos[h])
            every += bool(got.all())
            one += any(bool(torch.isin(c, pos[h]).all()) for c in copies)
            share += float(got.float().mean())
            pairs += 1
    return every / pairs, one / pairs, share / pairs


def per_token(cache, where: list[int]) -> str:
    """Share of (layer, head) pairs holding each key token, in document order (both copies of the key)."""
    counts = [0] * len(where)
    pairs = 0
    for layer in cache.layers:
        pos = layer.positions.cpu()
        for h in range(pos.shape[0]):
            counts = [c + int(bool((pos[h] == p).any())) for c, p in zip(counts, where)]
            pairs += 1
    return " ".join(f"{c / pairs:.2f}" for c in counts)


def corm_wants(policy, cache, where: list[int]) -> str:
    """The paper's per-head rule with no cap (spec §2.3): units wanted per (layer, head), and the share of
    pairs whose wanted set holds every key token."""
    from localchat.engine.policies.corm import wanted

    sizes, every, pairs = [], 0, 0
    for i, layer in enumerate(cache.layers):
        keep = wanted(policy.aligned(i, layer).rows, policy.recent_size).cpu()  # [H_kv, n]
        pos = layer.positions.cpu()
        for h in range(keep.shape[0]):
            kept = pos[h][keep[h]]
            sizes.append(int(keep[h].sum()))
            every += bool(torch.isin(torch.tensor(where), kept).all())
            pairs += 1
    sizes.sort()
    return (f"wanted units per (layer, head): min {sizes[0]}, median {sizes[len(sizes) // 2]}, max {sizes[-1]}"
            f" of {cache.get_seq_length()}; pairs wanting every key token {every / pairs:.2f}")


def sage_exact(policy, logits: dict[int, torch.Tensor], where: list[int], n: int) -> tuple[float, float]:
    """Per query head: share of heads whose own top-k (spec §2.3) holds every key token; and the mean share
    of key tokens among each query head's top-k."""
    from localchat.engine.policies.sagekv import split

    cfg = policy.model.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    sinks, k, recent = split(policy.budget, g)
    mid = torch.tensor([p for p in where if sinks <= p < n - recent - 1])
    every = share = heads = 0
    for row in logits.values():  # [H_q, n]
        top = row[:, sinks : n - recent - 1].topk(k, dim=-1).indices + sinks
        for h in range(row.shape[0]):
            got = torch.isin(mid, top[h])
            every += bool(got.all())
            share += float(got.float().mean())
            heads += 1
    return every / heads, share / heads


def run(engine, policy_name: str, example: int, n: int, budget: int, length: int, chunk: int = 512) -> None:
    cell = Cell("passkey", length, policy_name, budget, n, 0, None, None, chunk, "original", 16)
    use_policy(engine, cell)
    policy = engine.policy
    for key, value in SETTINGS.items():  # --set: a policy field changed for a what-if run
        setattr(policy, key, type(getattr(policy, key) or 0)(value))
    sample = sample_for(cell, engine.tokenizer, example)
    text = engine.render(prompt_messages(sample))
    ids = engine.encode(text)
    where = answer_tokens(engine.tokenizer, text, ids, sample.answers)
    logits: dict[int, torch.Tensor] = {}
    if policy_name == "sagekv":  # keep the last token's logits that the selection uses
        done_hook = policy.prefill_done

        def grab(cache):
            logits.update({i: t.clone() for i, t in policy.last.items()})
            done_hook(cache)

        policy.prefill_done = grab
    if policy_name == "corm":  # what the uncapped rule wants per (layer, head), read before the capped eviction
        wants: list[str] = []
        done_hook = policy.prefill_done

        def grab(cache):
            done_hook(cache)
            wants.append(corm_wants(policy, cache, where))

        policy.prefill_done = grab
    cache = engine.new_cache(len(ids), 16)
    first = None
    notes = []
    for event in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=16)):
        if isinstance(event, Token) and first is None:
            first = held(cache, where)
            digits = per_token(cache, where)
        elif isinstance(event, Notice):
            notes.append(event.message)
        elif isinstance(event, Done):
            end = held(cache, where)
            ok = score(sample, event.text)
            line = (f"{policy_name:7s} ex{example:<2d} depth {sample.depth:.2f} key {sample.answer} -> {event.text[:28]!r:32s}"
                    f" score {float(ok):.0f} | kept units/head {cache.get_seq_length()}"
                    f" | pairs holding all key tokens: first token {first[0]:.2f}, end {end[0]:.2f};"
                    f" a full copy: {first[1]:.2f}/{end[1]:.2f}; mean share {first[2]:.2f}/{end[2]:.2f}")
            if logits:
                ex_all, ex_share = sage_exact(policy, logits, where, len(ids))
                line += f" | exact per-query-head top-k holds all: {ex_all:.2f}, share {ex_share:.2f}"
            print(line, flush=True)
            print(f"   per key token (first token): {digits}", flush=True)
            if policy_name == "corm":
                print("   uncapped rule after the prompt:", wants[0], flush=True)
            for note in notes:
                print("   notice:", note, flush=True)


def corm_by_recency(self, layer, layer_idx):
    """CORM's score, what-if: the 1-based index of the latest window row marking a unit, then its attention."""
    m = self.aligned(layer_idx, layer)
    order = torch.arange(1, m.rows.shape[1] + 1, device=m.rows.device, dtype=torch.float32)[None, :, None]
    return (m.rows.float() * order).amax(dim=1) + layer.scores  # [H_kv, n]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Is the pass key in the kept set when the model answers?")
    ap.add_argument("--policies", default="sagekv,corm,roco")
    ap.add_argument("--examples", default="3,9,15")
    ap.add_argument("-n", type=int, default=20)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE on the policy (what-if runs)")
    ap.add_argument("--corm-recency", action="store_true", help="what-if: CORM's cap ranks keys by recency")
    args = ap.parse_args(argv)
    if args.corm_recency:
        from localchat.engine.policies.corm import CORM

        CORM.score = corm_by_recency
    SETTINGS.update(kv.split("=", 1) for kv in args.set)
    torch.manual_seed(0)
    engine = load_engine(Cell("passkey", args.length, "full", None, args.n, 0, None, None, args.chunk, "original", 16))
    for name in args.policies.split(","):
        for ex in (int(e) for e in args.examples.split(",")):
            run(engine, name, ex, args.n, args.budget, args.length, args.chunk)


if __name__ == "__main__":
    main()
