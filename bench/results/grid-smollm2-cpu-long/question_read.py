# Question-aware read of LOCRET's cache (session 13): LOCRET b=BUDGET reads the document as the lane does; then the
# prompt's tail (the last n_loc tokens: the document's end, the question, the template) is read once over the
# kept units, its last W queries' attention picks the top K units per KV head (summed over the window rows and
# each KV head's query group, as SnapKV scores), and the tail is read again over those K units only before
# answering. The kept cache itself is not changed (a chat's next question starts from it again).
# usage: python question_read.py TASK LENGTH EXAMPLE BUDGET CAP K[,K...] [W [AFTER]]   (CAP 0: the paper's rule)
# The cache after the document's last eviction is saved under $SNAPS (default /tmp/qread; saved_cache.py), so other
# K and W reuse it. One JSON line per K on stdout; K=0 is plain LOCRET (the tail read over every kept unit).
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from localchat.bench.tasks import score
from localchat.engine.cache import KVCache
from localchat.engine.policies.attention_stats import Collector, StatsHook, group_sum
from localchat.engine.prefill import cache_kwarg, forward
from saved_cache import answer_share, cache_before_tail, setup, snap_path

task, length, example, budget, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ks = [int(k) for k in sys.argv[6].split(",")]
window = int(sys.argv[7]) if len(sys.argv) > 7 else 32
after = int(sys.argv[8]) if len(sys.argv) > 8 else 0  # a unit also takes the vote of units up to AFTER tokens before it
engine, sample, ids, head_end, where = setup(task, length, example, budget, cap, 24)
model, p = engine.model, engine.policy
tail = torch.tensor([ids[head_end:]])
slots = os.environ.get("SLOTS", "compact")  # compact: the picked units move to slots 0..K-1; keep: they stay put
snap_file = snap_path(task, length, example, budget, cap)


def step(cache, piece: torch.Tensor, true_first: int, slot: int | None) -> torch.Tensor:
    """forward(), with the RoPE slot of the first token given (`slot`) instead of the cache's length."""
    if slot is None:
        return forward(model, cache, piece, true_first)
    t = piece.shape[-1]
    cache.set_pending_positions(torch.arange(true_first, true_first + t))
    out = model(input_ids=piece, position_ids=torch.arange(slot, slot + t).unsqueeze(0), use_cache=True,
                logits_to_keep=1, **{cache_kwarg(model): cache})
    return out.logits[0, -1]


@torch.inference_mode()
def answer(cache, slot: int | None = None) -> str:
    logits = step(cache, tail, head_end, slot)
    pos, out = len(ids), []
    for j in range(24):
        tok = int(logits.argmax())
        if tok in engine.stop_ids:
            break
        out.append(tok)
        logits = step(cache, torch.tensor([[tok]]), pos, None if slot is None else slot + tail.shape[-1] + j)
        pos += 1
    return engine.tokenizer.decode(out)


@torch.inference_mode()
def narrowed(doc: KVCache, k: int) -> KVCache:
    """The document's units the tail's last `window` queries attend to most: top-k per KV head (+ the first 4)."""
    probe = doc.clone()
    n = doc.get_seq_length()
    votes = {}
    hook = StatsHook(model, Collector(window, lambda i, probs: votes.__setitem__(
        i, group_sum(probs[:, :, :n], model.config.num_key_value_heads))))
    try:
        forward(model, probe, tail, head_end)
    finally:
        hook.close()
    out = doc.clone()
    for i, layer in enumerate(out.layers):
        s = spread(votes[i], layer.positions, after)
        s[layer.positions < 4] = float("inf")
        idx = s.topk(min(k, n), dim=-1).indices.sort(dim=-1).values
        if slots == "keep":  # no move: keys keep the rotation of their slot in the document's cache
            out.layers[i].keep(idx)
        else:
            out.keep(i, idx)
    return out


def spread(votes: torch.Tensor, positions: torch.Tensor, after: int) -> torch.Tensor:
    """Each unit's vote raised to the largest vote of the units at most `after` tokens before it (the same head)."""
    if after <= 0:
        return votes.clone()
    gap = positions[:, :, None] - positions[:, None, :]  # [H, n, n]: this unit's position minus the other's
    near = (gap >= 0) & (gap <= after)
    return torch.where(near, votes[:, None, :], torch.zeros((), dtype=votes.dtype)).amax(dim=-1)


doc = cache_before_tail(engine, ids, head_end, 24, snap_file)
for k in ks:
    t = time.time()
    cache = doc.clone() if k == 0 else narrowed(doc, k)
    share = answer_share(cache, where)
    said = answer(cache, doc.get_seq_length() if slots == "keep" and k else None)
    print(json.dumps({"task": task, "length": length, "example": example, "budget": budget, "max_copies": cap,
                      "k": k, "window": window, "after": after, "slots": slots, "depth": sample.depth, "expected": sample.answers[0], "answer": said,
                      "correct": bool(score(sample, said)), "answer_kept": share, "seconds": round(time.time() - t, 1)}),
          flush=True)
