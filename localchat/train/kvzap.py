"""Train a KVzap scorer (engine/kvzap.py's release format) for a model, on the CPU: KVzip+ labels from the model's
own attention over repeated texts, then a closed-form ridge regression per layer.

Labels (KVzip+, KVzap: NVIDIA, 2026, arXiv 2601.07891 §3): a text is laid out as a chat in which the user gives
the text followed by "Repeat the previous context exactly." and the assistant repeats it. With full attention and
no eviction, for layer l, KV head j and a token k of the original text:

    score[l, j, k] = log max over the copy's queries t and the query heads h of j's group of
                     a[h, t, k] / ||x_t|| * ||W_o,h v_j,k||

where a is the softmax attention of query t to key k, x_t the hidden state the layer's attention reads at t
(its input_layernorm's output), v_j,k the value of k and W_o,h the columns of the output projection that read
head h. The inputs a scorer sees are x_k of the original text's tokens (what `KVzapHooks` reads at inference).

The texts are the heads' training prompts (train/data.py: the "train" split of localchat.bench.corpus and the
standard library's sources; the benchmarks read the disjoint "eval" split), each the whole user message as the
app lays a document out, so the hidden states are those the app's own prompts give.

Fitting keeps only sufficient statistics per layer (n, Σx, Σy, XᵀX, Xᵀy, Σy², in float64): no feature matrix is
held, whatever the number of samples. The ridge fit centres x and y (its intercept is not penalised: sklearn's
`Ridge`, what kvpress uses) and folds the centring into the bias, so the saved `nn.Linear` computes it exactly.
The penalty is chosen per layer on a validation fold of the training samples, then refit on all of them; the
reported R² and correlation are on held-out samples no fit saw.
"""

from __future__ import annotations

import bisect
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from localchat.engine.cache import KVCache
from localchat.engine.heads import attention_modules, head_shape
from localchat.engine.kvzap_scorer import KVzapScorer, norms
from localchat.engine.policies.attention_stats import Collector, StatsHook
from localchat.engine.prefill import forward
from localchat.errors import UserError

REPEAT = "Repeat the previous context exactly."
ALPHAS = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)  # ridge penalties tried on the validation fold
MAX_TOKENS = 1500  # default longest text (kvpress: 750-1250 tokens); the repeated layout is twice as long


@dataclass
class Layout:
    """A repeated text as token ids, with the token spans [start, end) of the text and of its copy."""

    ids: list[int]
    text: tuple[int, int]
    copy: tuple[int, int]


def repeat_layout(engine, text: str) -> Layout:
    """The chat `user: TEXT\\n\\nRepeat the previous context exactly. / assistant: TEXT` as the engine renders and
    encodes it, with both copies' token spans (a token belongs to the span its first character starts in)."""
    text = text.strip()
    rendered = engine.render([{"role": "user", "content": f"{text}\n\n{REPEAT}"},
                              {"role": "assistant", "content": text}], add_generation_prompt=False)
    first = rendered.find(text)
    second = rendered.find(text, first + len(text)) if first >= 0 else -1
    if second < 0:
        raise ValueError("the chat template changed the text: cannot find both copies in the rendered prompt")
    cuts = (first, first + len(text), second, second + len(text))
    tok = engine.tokenizer
    if getattr(tok, "is_fast", False):
        enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = list(enc["input_ids"]), [a for a, _ in enc["offset_mapping"]]
        at = [bisect.bisect_left(starts, c) for c in cuts]
    else:  # no offsets: the token count of each prefix (a boundary may move by a token)
        ids = engine.encode(rendered)
        at = [engine.count_tokens(rendered[:c]) for c in cuts]
    if not (0 < at[0] < at[1] <= at[2] < at[3] <= len(ids)):
        raise ValueError(f"bad token spans {at} for a {len(ids)}-token repeated prompt")
    return Layout(ids, (at[0], at[1]), (at[2], at[3]))


@dataclass
class Labels:
    features: torch.Tensor  # [L, n, D] float32: each layer's attention input at the text's n tokens
    scores: torch.Tensor  # [L, H_kv, n] float32: log KVzip+ scores


def _wo_grams(model) -> list[torch.Tensor]:
    """Per layer `[H_q, d, d]`: W_o,hᵀ W_o,h of each query head's slice of the output projection, so that
    ||W_o,h v||² = vᵀ (W_o,hᵀ W_o,h) v without forming W_o,h v (D wide) for every key."""
    shape = head_shape(model)
    grams = []
    for attn in attention_modules(model):
        w = attn.o_proj.weight.detach().float()  # [D, H_q·d]
        w = w.view(w.shape[0], shape["q_heads"], shape["head_dim"]).permute(1, 0, 2)  # [H_q, D, d]
        grams.append(w.transpose(1, 2) @ w)
    return grams


@torch.inference_mode()
def kvzip_plus(model, layout: Layout, chunk: int = 1024) -> Labels:
    """Prefill up to the copy (full cache, true positions), then run the copy and take the labels."""
    shape = head_shape(model)
    if "scored" in shape or any(a is None for a in attention_modules(model)):
        raise UserError("KVzap training takes a model whose every layer is full attention (not a hybrid)")
    n_layers, kv, g = shape["layers"], shape["kv_heads"], shape["q_heads"] // shape["kv_heads"]
    (t0, t1), (c0, c1) = layout.text, layout.copy
    device = next(model.parameters()).device
    cache = KVCache(n_layers, reserve=c1)
    state = {"copy": False, "at": 0}
    kept: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    qnorm: list[torch.Tensor | None] = [None] * n_layers
    best: list[torch.Tensor | None] = [None] * n_layers  # [H_q, n] running max over the copy's rows

    def on_norm(i: int, out: torch.Tensor) -> None:
        x = out.reshape(-1, out.shape[-1]).float()
        if state["copy"]:
            qnorm[i] = x.norm(dim=-1)
        else:
            a = state["at"]
            rows = x[max(t0 - a, 0) : max(t1 - a, 0)]
            if rows.shape[0]:
                kept[i].append(rows.cpu())

    def on_probs(i: int, probs: torch.Tensor) -> None:  # [H_q, T, n]: this chunk of the copy against every key
        a = (probs[:, :, t0:t1] / qnorm[i].view(1, -1, 1)).amax(dim=1)
        best[i] = a if best[i] is None else torch.maximum(best[i], a)

    handles = [norm.register_forward_hook(lambda m, args, out, i=i: on_norm(i, out))
               for i, norm in enumerate(norms(model))]
    try:
        ids = torch.tensor([layout.ids[:c1]], device=device)
        for start in range(0, c0, chunk):
            state["at"] = start
            forward(model, cache, ids[:, start : min(start + chunk, c0)], start)
        state["copy"] = True
        hook = StatsHook(model, Collector(rows=None, callback=on_probs))
        try:
            for start in range(c0, c1, chunk):
                forward(model, cache, ids[:, start : min(start + chunk, c1)], start)
        finally:
            hook.close()
    finally:
        for h in handles:
            h.remove()
    grams = _wo_grams(model)
    scores = torch.empty(n_layers, kv, t1 - t0)
    for i in range(n_layers):
        v = cache.layers[i].values[0, :, t0:t1].float().repeat_interleave(g, dim=0)  # [H_q, n, d]
        wov = ((v @ grams[i].to(v.device)) * v).sum(-1).clamp_min(0).sqrt()  # [H_q, n]
        s = (best[i] * wov).view(kv, g, -1).amax(dim=1)
        scores[i] = s.clamp_min(torch.finfo(torch.float32).tiny).log().cpu()
    features = torch.stack([torch.cat(rows) for rows in kept])
    return Labels(features, scores)


class Moments:
    """Sufficient statistics of a per-layer linear regression of y `[H]` on x `[D]`, summed over samples."""

    def __init__(self, layers: int, dim: int, heads: int):
        f = torch.float64
        self.n = 0
        self.sx, self.sy = torch.zeros(layers, dim, dtype=f), torch.zeros(layers, heads, dtype=f)
        self.xx, self.xy = torch.zeros(layers, dim, dim, dtype=f), torch.zeros(layers, dim, heads, dtype=f)
        self.yy = torch.zeros(layers, heads, dtype=f)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """`x [L, n, D]`, `y [L, H, n]` (one sample: products in float32, sums in float64)."""
        x, y = x.float(), y.float().transpose(1, 2)
        xt = x.transpose(1, 2)
        self.n += x.shape[1]
        self.sx += x.sum(1).double()
        self.sy += y.sum(1).double()
        self.xx += (xt @ x).double()
        self.xy += (xt @ y).double()
        self.yy += (y * y).sum(1).double()

    def __iadd__(self, other: Moments) -> Moments:
        self.n += other.n
        for k in ("sx", "sy", "xx", "xy", "yy"):
            getattr(self, k).add_(getattr(other, k))
        return self

    def mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of y, `[L, H]` each."""
        mean = self.sy / self.n
        return mean, (self.yy / self.n - mean * mean).clamp_min(0).sqrt()


def ridge(m: Moments, alpha: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W `[L, H, D]`, b `[L, H]`) minimising ||y - Wx - b||² + alpha·||W||² per layer (alpha a float, or `[L]`)."""
    if m.n < 2:
        raise UserError("too few tokens to fit a KVzap scorer")
    mx, my = m.sx / m.n, m.sy / m.n
    gram = m.xx - m.n * mx.unsqueeze(2) * mx.unsqueeze(1)
    cross = m.xy - m.n * mx.unsqueeze(2) * my.unsqueeze(1)
    alpha = torch.as_tensor(alpha, dtype=torch.float64).reshape(-1, 1, 1)
    eye = torch.eye(gram.shape[-1], dtype=torch.float64)
    w = torch.linalg.solve(gram + alpha * eye, cross)  # [L, D, H]
    b = my - (mx.unsqueeze(1) @ w).squeeze(1)
    return w.transpose(1, 2).contiguous(), b


def evaluate(w: torch.Tensor, b: torch.Tensor, m: Moments) -> dict[str, torch.Tensor]:
    """R², Pearson correlation and mean squared error of the fit (w, b) on the samples of `m`, `[L, H]` each,
    from the statistics alone."""
    w = w.double().transpose(1, 2)  # [L, D, H]
    b = b.double()
    n = m.n
    sx_w = (m.sx.unsqueeze(1) @ w).squeeze(1)  # Σ x·w  [L, H]
    sp = sx_w + n * b  # Σ ŷ
    spp = (w * (m.xx @ w)).sum(1) + 2 * b * sx_w + n * b * b  # Σ ŷ²
    spy = (w * m.xy).sum(1) + b * m.sy  # Σ ŷ·y
    sse = m.yy - 2 * spy + spp
    sst = m.yy - m.sy * m.sy / n
    var_p = spp - sp * sp / n
    cov = spy - sp * m.sy / n
    return {"r2": 1 - sse / sst, "corr": cov / (var_p * sst).clamp_min(1e-30).sqrt(), "mse": sse / n}


def fold(i: int, every_nth: int) -> str:
    """Sample i's part: every `every_nth` sample (counting from 1) is held out; of the others, every
    `every_nth` is the validation fold that picks the penalty."""
    if (i + 1) % every_nth == 0:
        return "held_out"
    rest = i - (i + 1) // every_nth
    return "valid" if every_nth > 1 and (rest + 1) % every_nth == 0 else "train"


def fit(parts: dict[str, Moments], alphas: tuple[float, ...] = ALPHAS) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Pick each layer's penalty on `valid` (fit on `train`), refit on train + valid; (W, b, report)."""
    train, valid = parts["train"], parts.get("valid")
    if valid is not None and valid.n and train.n:
        r2 = torch.stack([evaluate(*ridge(train, a), valid)["r2"].mean(-1) for a in alphas])  # [A, L]
        alpha = torch.tensor(alphas, dtype=torch.float64)[r2.argmax(0)]
        both = Moments(*train.xy.shape[:2], train.xy.shape[2])
        both += train
        both += valid
    else:
        alpha, both = torch.full((train.xx.shape[0],), 1.0, dtype=torch.float64), train
    w, b = ridge(both, alpha)
    return w, b, {"alpha": alpha.tolist()}


def scorer_from(w: torch.Tensor, b: torch.Tensor, meta: dict | None = None) -> KVzapScorer:
    layers, heads, dim = w.shape
    config = {"model_type": "kvzap", "input_dim": dim, "output_dim": heads, "hidden_dim": None, "n_modules": layers}
    scorer = KVzapScorer(config, meta={"kind": "trained", **(meta or {})})
    with torch.no_grad():
        for i in range(layers):
            scorer.layers[str(i)].weight.copy_(w[i].float())
            scorer.layers[str(i)].bias.copy_(b[i].float())
    return scorer


def _rounded(t: torch.Tensor, digits: int = 4) -> list:
    return [round(float(v), digits) for v in t]


def train(engine, texts: list[str], out: Path, *, every_nth: int = 10, chunk: int | None = None,
          say=print) -> dict:
    """Label `texts`, fit, save the scorer into `out` and return the log (also written as out/train-log.json)."""
    model = engine.model
    shape = head_shape(model)
    dim = model.config.hidden_size
    chunk = chunk or engine.chunk or 1024
    parts = {k: Moments(shape["layers"], dim, shape["kv_heads"]) for k in ("train", "valid", "held_out")}
    counts = {k: 0 for k in parts}
    t0 = time.time()
    for i, text in enumerate(texts):
        layout = repeat_layout(engine, text)
        lab = kvzip_plus(model, layout, chunk=chunk)
        part = fold(i, every_nth)
        parts[part].add(lab.features, lab.scores)
        counts[part] += 1
        say(f"labels {i + 1}/{len(texts)}: {layout.text[1] - layout.text[0]} tokens ({len(layout.ids)} repeated), "
            f"{part}, {time.time() - t0:.0f}s")
    t1 = time.time()
    if not parts["train"].n or not parts["held_out"].n:
        raise UserError(f"need training and held-out samples (got {len(texts)} with every {every_nth}th held out)")
    w, b, report = fit(parts)
    held = evaluate(w, b, parts["held_out"])
    t2 = time.time()
    scorer_from(w, b).save(out)
    mean, std = parts["train"].mean_std()
    r2, corr = held["r2"].mean(-1), held["corr"].mean(-1)
    log = {
        "scorer": "kvzap", "variant": "linear", "fit": "ridge (closed form, per layer; centred, intercept unpenalised)",
        "label": "KVzip+ (log)", "samples": counts, "tokens": {k: m.n for k, m in parts.items()},
        "alpha_per_layer": report["alpha"],
        "held_out": {"r2_mean": round(float(r2.mean()), 4), "corr_mean": round(float(corr.mean()), 4),
                     "r2_per_layer": _rounded(r2), "corr_per_layer": _rounded(corr),
                     "mse_per_layer": _rounded(held["mse"].mean(-1))},
        "label_mean_per_layer": _rounded(mean.mean(-1), 3), "label_std_per_layer": _rounded(std.mean(-1), 3),
        "seconds": {"labels": round(t1 - t0, 1), "fit": round(t2 - t1, 1)},
        "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                     "threads": torch.get_num_threads()},
        "chunk": chunk,
    }
    (Path(out) / "train-log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    return log


def run_train(args, engine) -> int:
    """`localchat train-heads --scorer kvzap`: the heads' training prompts (--samples, --min-tokens, --max-tokens
    (default 1500), --seed, --eval-every-nth) -> a KVzap release folder in --out."""
    from localchat.train.data import KINDS, make_samples

    out = Path(args.out)
    max_tokens = args.max_tokens or max(args.min_tokens + 1, MAX_TOKENS)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    samples = make_samples(engine.tokenizer, args.samples, args.seed, args.min_tokens, max_tokens)
    texts = [s.message()["content"] for s in samples]
    log = train(engine, texts, out, every_nth=args.eval_every_nth, say=say)
    log.update({
        "model": engine.name, "seed": args.seed, "kinds": list(KINDS), "text_tokens": [args.min_tokens, max_tokens],
        "command": "localchat " + " ".join(sys.argv[1:]) if sys.argv and "localchat" in sys.argv[0] else None,
        "minutes": round((time.time() - t0) / 60, 1), "date": time.strftime("%Y-%m-%d"),
    })
    (out / "train-log.json").write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
    say(f"held-out R² {log['held_out']['r2_mean']:.3f}, correlation {log['held_out']['corr_mean']:.3f} "
        f"(mean over layers and KV heads); {log['minutes']} min")
    print(out)
    return 0
