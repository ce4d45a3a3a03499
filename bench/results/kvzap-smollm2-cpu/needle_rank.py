"""Where do a needle's tokens rank among a document's tokens: KVzip+ labels vs the trained linear scorer."""
import bisect, sys, torch
from localchat.engine.engine import Engine
from localchat.engine.kvzap_scorer import KVzapScorer
from localchat.bench import tasks
from localchat.documents import Document
from localchat.render import user_turn
from localchat.train.kvzap import repeat_layout, kvzip_plus

e = Engine.load(None)
scorer = KVzapScorer.load(sys.argv[1]).eval()
n_tok = int(sys.argv[2]) if len(sys.argv) > 2 else 1800
for task in ("passkey", "niah_single"):
    for seed in (1, 2, 3):
        s = getattr(tasks, task)(e.tokenizer, n_tok, seed, 0.5)
        doc = Document(path=None, name="document.txt", kind="text", text=s.document, sha256="", n_bytes=0)
        content = user_turn(s.question, [doc])
        lay = repeat_layout(e, content)
        lab = kvzip_plus(e.model, lay, chunk=512)
        rendered = e.render([{"role": "user", "content": content + "\n\nRepeat the previous context exactly."}, {"role": "assistant", "content": content}], add_generation_prompt=False)
        enc = e.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
        starts = [a for a, _ in enc["offset_mapping"]]
        c = rendered.find(s.answer, rendered.find("<document"))
        t0 = bisect.bisect_right(starts, c) - 1
        t1 = bisect.bisect_left(starts, c + len(s.answer))
        idx = torch.arange(t0, t1) - lay.text[0]
        with torch.no_grad():
            pred = torch.stack([scorer.layers[str(i)](lab.features[i]).T for i in range(30)])  # [L, H, n]
        def pct(x):  # percentile rank of the needle tokens per layer/head, mean
            r = x.argsort(-1).argsort(-1).float() / (x.shape[-1] - 1)
            return float(r[..., idx].mean()), float((r[..., idx] > 1 - 1024 / x.shape[-1]).float().mean())
        print(task, seed, "needle tokens", t1 - t0, repr(e.tokenizer.decode(lay.ids[t0:t1])),
              "label pct %.2f top-share %.2f" % pct(lab.scores), "| scorer pct %.2f top-share %.2f" % pct(pred),
              "| corr %.2f" % float(torch.corrcoef(torch.stack([lab.scores.flatten(), pred.flatten()]))[0, 1]), flush=True)
