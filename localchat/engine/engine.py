"""Engine: the one façade over model, tokenizer, cache and generation that the TUI, CLI and bench use.

`Engine.chat(messages)` / `Engine.generate(ids)` stream typed events (Progress, Token, Done, Error) and
honour a cancel `threading.Event` between prefill chunks and between decoded tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from localchat.engine import focus as focus_mod
from localchat.engine import loading
from localchat.engine.attention import switchable, use_chunk_attention
from localchat.engine.cache import POSITION_MODES, KVCache
from localchat.engine.cards import ModelCard, card_chunk
from localchat.engine.decode_step import DecodeStep
from localchat.engine.decode_step import supported as lean_supported
from localchat.engine.detok import StreamDecoder
from localchat.engine.encode import encode as encode_text
from localchat.engine.events import Done, Error, Event, Notice, Token
from localchat.engine.graph_step import GraphStep
from localchat.engine.graph_step import why_not as graph_why_not
from localchat.engine.layer_kinds import hybrid, layer_kinds, summary
from localchat.engine.policies import PLAIN_POLICY, Policy, make_policy
from localchat.engine.prefill import Cancelled, evict, evict_while_decoding, forward, prefill
from localchat.engine.qattention import FusedDecode
from localchat.engine.qcache import KV_CHOICES, RESIDUAL, QuantizedKVCache, kv_bits
from localchat.engine.rope import layer_inv_freqs
from localchat.engine.sampling import GenerationSettings, StopText, pick_token
from localchat.errors import TooLong, UserError
from localchat.kernels import cpu_decode

END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>")


@dataclass(frozen=True)
class Decoding:
    """How a decoded token is computed: the engine's one decode setting (the defaults are the fastest path each
    device has; benchmarks and tests choose others through `Engine.configure(decoding=...)`).

    `lean`: Llama-layout models decode without transformers' forward (engine/decode_step.py); off, the model's
    forward. `graph`: on the `graph_devices`, the lean step is captured once as a CUDA graph and replayed
    (engine/graph_step.py). `fused`: a quantized cache is read packed by the split kernel (engine/qattention.py);
    off, dequantized then SDPA. `make_step(model, cache, heads)`: builds the captured step (None: GraphStep with its
    defaults; a benchmark passes GraphStep's keywords, fused, gemv, split, this way)."""

    lean: bool = True
    graph: bool = True
    fused: bool = True
    graph_devices: tuple[str, ...] = ("cuda",)
    make_step: Callable | None = None


class Engine:

    def __init__(self, model, tokenizer, *, name: str = "model", card: ModelCard | None = None,
                 chunk: int | None = None, policy: Policy | None = None, positions: str | None = None,
                 kv: str | None = None, weights: str | None = None, admit=None, spec=None,
                 decoding: Decoding | None = None):
        """`policy`: full attention when None. `weights`: the --weights the model was loaded with (None: as stored).
        `admit(engine, prompt units, max new, held units)`: a memory check that raises UserError for what the
        memory cannot hold, before it is read (planning/load.py's). `spec`: the RunSpec the engine was built from,
        when it was (localchat/config.py). `decoding`: how a decoded token is computed (Decoding())."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.card = card
        self.weights = weights
        self.admit = admit
        self.decoding = decoding or Decoding()
        self._graph: GraphStep | None = None  # the last one: a chat's next turn on the same cache replays it
        self._graph_failed = False  # a capture failed: later answers take the eager ways
        self._said_eager: set[str] = set()  # why CUDA decoding ran eagerly, said once each
        self.device = next(model.parameters()).device
        self.window = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        try:
            self.kinds = layer_kinds(model.config)  # what each layer keeps (engine/layer_kinds.py)
        except ValueError as exc:
            raise UserError(f"{name}: {exc}") from None
        self.policy, self.positions, self.chunk, self.kv, self.spec = None, "original", card_chunk(card), "none", None
        self.configure(policy or make_policy(PLAIN_POLICY), positions=positions, chunk=chunk, kv=kv, spec=spec)
        self.stop_ids = self._stop_ids()

    @classmethod
    def load(cls, spec: str | None = None, *, device: torch.device | None = None, say=loading._stderr,
             weights: str | None = None, before_weights=None, card=loading.LOOK_UP, **settings) -> Engine:
        """Load model `spec` (None: the embedded default) at `weights`; `settings` are the constructor's (chunk,
        policy, positions, kv, admit, spec). `card`: the model's card when the caller has looked it up (None: it
        has none)."""
        loaded = loading.load(spec, device=device, say=say, weights=weights, before_weights=before_weights,
                              card=card)
        return cls.of(loaded, weights=weights, say=say, **settings)

    @classmethod
    def of(cls, loaded: loading.Loaded, *, weights: str | None = None, say=loading._stderr, **settings) -> Engine:
        """An engine over a loaded model (loading.load's), with the constructor's `settings`."""
        engine = cls(loaded.model, loaded.tokenizer, name=loaded.name, card=loaded.card, weights=weights, **settings)
        if engine.device.type == "cpu" and engine.decoding.lean:
            cpu_decode.prepare(say)
        if engine.device.type == "cpu":
            use_chunk_attention(engine.model)  # a chunk's attention in bf16 dot products where the CPU has them
        return engine

    def configure(self, policy: Policy | None = None, *, positions: str | None = None, chunk: int | None = None,
                  kv: str | None = None, spec=None, decoding: Decoding | None = None) -> None:
        """What the engine runs with (each None keeps what it has): the one place these change. Positions default
        to the policy's own (compact for policies that evict, original for the others)."""
        kv = kv or self.kv
        if kv not in KV_CHOICES:
            raise UserError(f"unknown --kv {kv!r}; choose one of: {', '.join(KV_CHOICES)}")
        policy = policy or self.policy
        if not policy.hybrid and hybrid(self.kinds):
            raise UserError(f"{policy.name} cannot serve {self.name} ({summary(self.kinds)} layers); choose another "
                            f"--policy (localchat policies)")
        if (policy.attention_function or policy.focus_units()) and not switchable(self.model):
            raise UserError(f"{policy.name}{' --focus' if policy.focus_units() else ''} cannot serve {self.name}: it "
                            f"replaces the attention function, which would drop the model's attention sinks; choose "
                            f"another --policy (locret, sirllm, streaming, full)")
        if policy is not self.policy or positions is not None:
            positions = positions or policy.positions_default()
            if positions not in POSITION_MODES:
                raise UserError(f"unknown position mode {positions!r}; choose one of: {', '.join(POSITION_MODES)}")
            self.policy, self.positions = policy, positions
        self.kv = kv
        self.chunk = chunk or self.chunk
        self.spec = spec if spec is not None else self.spec
        if decoding is not None:
            self.decoding, self._graph, self._graph_failed = decoding, None, False

    def set_policy(self, policy: Policy, positions: str | None = None) -> None:
        """Use `policy` (at `positions`, or the policy's default)."""
        self.configure(policy, positions=positions)

    # --- prompts -------------------------------------------------------------------------------

    def _stop_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_TOKENS if t in vocab)
        return ids

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` (a plain fallback for models without a template)."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        return text + ("Assistant:" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)  # a long text in pieces, with the same ids (engine/encode.py)

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages))

    # --- generation ----------------------------------------------------------------------------

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None,
             cancel: threading.Event | None = None) -> Iterator[Event]:
        try:
            ids = self.encode_chat(messages)
        except Exception as exc:  # a template that rejects the messages
            yield Error(f"cannot build the prompt: {exc}", exc)
            return
        yield from self.generate(ids, settings, cancel)

    def generate(self, prompt_ids: list[int], settings: GenerationSettings | None = None,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Answer `prompt_ids` on a fresh cache."""
        yield from self.continue_on(None, prompt_ids, 0, settings, cancel)

    def continue_on(self, cache: KVCache | None, prompt_ids: list[int], first_pos: int,
                    settings: GenerationSettings | None = None, cancel: threading.Event | None = None,
                    *, keep_last: bool = False) -> Iterator[Event]:
        """Prefill `prompt_ids` (true positions from `first_pos`) on top of `cache`, then answer.

        A cache that already holds units (an earlier turn) is first compressed to the budget. With
        `keep_last`, the answer's last token is fed too, so the cache holds the whole answer (multi-turn).
        `cache=None` starts a fresh one. The cache is changed in place; Done reports what it holds.
        """
        settings = settings or GenerationSettings()
        try:
            settings.validate()
            if not prompt_ids:
                raise UserError("nothing to read: the prompt is empty")
            n_total = first_pos + len(prompt_ids)
            positions = cache.positions if cache is not None else self.positions
            past = self._past_window(n_total, positions)  # longer than the window: on at compact positions
            if past:
                positions = "compact"
            self._check_window(n_total, positions)
            if self.admit is not None:  # refuse, before reading, what memory cannot hold (planning/load.py)
                self.admit(self, len(prompt_ids), settings.max_new_tokens, cache.get_seq_length() if cache is not None else 0)
            if cache is None:
                cache = self.new_cache(len(prompt_ids), settings.max_new_tokens, positions=positions)
            elif past and cache.empty_now():
                cache.start_at("compact", layer_inv_freqs(self.model, self.kinds))
            elif past:  # what was kept at original positions moves to its slots
                cache.to_compact(layer_inv_freqs(self.model, self.kinds), first_pos)
            if past:
                yield Notice(f"the conversation is longer than {self.name}'s window of {self.window:,} tokens: read "
                             f"at compact positions from here on (each kept unit at its slot)")
            yield from self._generate(cache, prompt_ids, first_pos, settings, cancel, keep_last)
        except UserError as exc:
            yield Error(str(exc), exc)
        except torch.OutOfMemoryError as exc:
            yield Error("out of memory while generating; try a smaller --chunk or a shorter document", exc)

    def new_cache(self, prompt_tokens: int = 0, max_new: int = 0, positions: str | None = None) -> KVCache:
        """An empty cache for the current policy, its first allocation sized for the expected peak; at the engine's
        positions, or `positions` (a conversation past the window at compact ones, a saved cache's)."""
        reserve = peak_units(self.policy, prompt_tokens, self.chunk, max_new)
        kinds, positions = self.kinds, positions or self.positions
        inv_freq = layer_inv_freqs(self.model, kinds) if positions == "compact" else None
        if self.kv != "none":
            return QuantizedKVCache(len(kinds), kv_bits(self.kv), reserve=reserve, positions=positions,
                                    inv_freq=inv_freq, tail=self.chunk + RESIDUAL, kinds=kinds)
        return KVCache(len(kinds), reserve=reserve, positions=positions, inv_freq=inv_freq, kinds=kinds,
                       tail=self.chunk)

    def _past_window(self, n_total: int, positions: str) -> bool:
        """True when an evicting policy at original positions gets more than the window: compact positions let it
        read on (original ones hold inside the window, where a model like Gemma 3 270M reads better with them)."""
        return bool(self.window) and n_total >= self.window and self.policy.bounded() and positions == "original"

    def _chunk_halved(self, chunk: int) -> None:
        """Prefill ran out of memory and halved the chunk: later reads use the smaller one."""
        self.chunk = chunk

    def _stepper(self, cache: KVCache, heads) -> tuple[GraphStep | None, str | None]:
        """On CUDA, the captured decode step for `cache` (the last one when it is bound to the same cache and
        heads), or None and why not: the reason once per engine, None after."""
        way = self.decoding
        if self.device.type not in way.graph_devices or not (way.lean and way.graph) or self._graph_failed:
            return None, None
        why = graph_why_not(self.model, cache, heads)
        if why is None:
            last = self._graph
            if last is None or last.cache is not cache or last.heads is not heads or last.reason:
                last = self._graph = (way.make_step or GraphStep)(self.model, cache, heads)
            return last, None
        if why in self._said_eager:
            return None, None
        self._said_eager.add(why)
        return None, why

    @property
    def compressing(self) -> bool:
        """True when positions stay bounded by the budget (compact positions with an evicting policy)."""
        return self._bounded_at(self.positions)

    def _bounded_at(self, positions: str) -> bool:
        """True when an evicting policy at `positions` keeps the RoPE positions bounded by the budget."""
        return self.policy.bounded() and positions == "compact"

    def _check_window(self, n_total: int, positions: str | None = None) -> None:
        if not self.window:
            return
        if self._bounded_at(positions or self.positions):
            peak = self.policy.budget + max(self.chunk, self.policy.local + 2 * self.policy.decode_window)
            if peak >= self.window:
                raise UserError(
                    f"budget + chunk (or local tail + 2 x decode window) = {peak} positions do not fit {self.name}'s window of {self.window}; "
                    f"lower --budget or --chunk"
                )
        elif n_total >= self.window:
            way = ("--positions compact" if self.policy.bounded() else
                   "an evicting policy at compact positions (--policy locret --positions compact, or sirllm "
                   "where the model has no heads)")
            raise TooLong(
                f"the conversation is {n_total} tokens but {self.name} reads at most {self.window} with "
                f"{self.policy.name} attention at {positions or self.positions} positions; use {way}, or shorten the "
                f"document"
            )

    @torch.inference_mode()
    def _generate(self, cache: KVCache, prompt_ids: list[int], first_pos: int, settings: GenerationSettings,
                  cancel: threading.Event | None, keep_last: bool) -> Iterator[Event]:
        n = len(prompt_ids)
        max_new = settings.max_new_tokens
        p = self.policy
        ids = torch.tensor([prompt_ids], device=self.device)
        decoder = StreamDecoder(self.tokenizer)
        gen = torch.Generator(device="cpu").manual_seed(settings.seed)
        t0 = time.perf_counter()
        prefill_s = decode_s = ttft = 0.0
        new = 0
        reason = "length"
        fused = None
        ext = cache.extension
        if ext is not None and not isinstance(p, ext.owner):  # another policy kept units elsewhere: bring them back
            ext.restore(cache)
        p.attach(self.model, cache)
        attached = True
        focus = _Focus(self.model, cache, p, n, max_new)
        answer: list[int] = []
        stop = StopText(settings.stop) if settings.stop else None
        try:
            if p.evicts and cache.get_seq_length() > p.budget:  # an earlier turn: compress the history
                evict(cache, p, last_chunk=True)
            focus.arm_if_all_tail()
            logits = yield from prefill(self.model, cache, ids, chunk=self.chunk, policy=p, first_pos=first_pos,
                                        cancel=cancel, on_oom=self._chunk_halved, on_chunk=focus.on_chunk)
            focus.disarm()
            target = cache  # what the answer reads: the cache, or a focused view of it (engine/focus.py)
            if focus.ready():
                target = focus.view()
                for s in range(focus.tail_start, n, self.chunk):  # the tail again, over the view
                    logits = forward(self.model, target, ids[:, s:min(s + self.chunk, n)], first_pos + s)
                p.detach()  # the view is not scored: the answer is fed to the cache afterwards
                attached = False
            if self.device.type == "cuda":  # queued prefill work belongs to the prefill time
                torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            lean, eager = self._stepper(target, p.unit_heads() if attached else None)
            if eager:
                yield Notice(f"decoding eagerly: {eager}")
            if lean is None and self.decoding.fused and switchable(self.model):  # a quantized cache read packed
                fused = FusedDecode(self.model, target)
            if lean is None and self.decoding.lean and lean_supported(self.model, target):
                lean = DecodeStep(self.model, target, on_qkv=p.qkv_sink() if attached else None)
            pos = first_pos + n
            if self.window and not (self._bounded_at(cache.positions) and p.decode_window):  # RoPE positions left
                max_new = min(max_new, self.window - cache.next_position(pos))  # the cache, not a view: it gets the answer
            while new < max_new:
                if cancel is not None and cancel.is_set():
                    raise Cancelled
                tok = pick_token(logits, settings, gen)
                if tok in self.stop_ids and not settings.ignore_eos:
                    reason = "eos"
                    break
                new += 1
                if new == 1:
                    ttft = time.perf_counter() - t0
                piece = decoder.push(tok)
                yield Token(stop.push(piece) if stop is not None else piece, tok)
                if stop is not None and stop.hit:
                    reason = "stop"
                if (new == max_new or reason == "stop") and not keep_last:
                    break
                step = torch.tensor([[tok]], device=self.device)
                if lean is not None:  # a captured step takes the token id as it is (no read back from the device)
                    logits = lean.step(tok if isinstance(lean, GraphStep) else step, pos)
                else:
                    logits = forward(self.model, target, step, pos)
                answer.append(tok)
                if target is cache:
                    p.observe(cache, 1, step)  # answer tokens get scores too (multi-turn keeps them)
                    evict_while_decoding(cache, p)
                pos += 1
                if reason == "stop":  # the stop sequence's tokens are in the cache; the text ends before it
                    break
            if stop is not None and not stop.hit and stop.held:
                yield Token(stop.flush(), -1)
            if isinstance(lean, GraphStep) and lean.reason:  # capture failed: later answers take the eager ways
                self._graph_failed = True
                yield Notice(f"decoding eagerly: {lean.reason}")
            if target is not cache and answer and keep_last:  # a chat's next turn starts from the cache: feed the answer
                p.attach(self.model, cache)
                attached = True
                focus.feed(answer, first_pos + n, self.chunk)
            decode_s = time.perf_counter() - t1
            note = p.notice()  # a cap that bound while answering (CORM)
            if note:
                yield Notice(f"{note} while answering")
        except Cancelled:
            reason = "cancelled"
            if prefill_s == 0.0:
                prefill_s = time.perf_counter() - t0
            else:
                decode_s = time.perf_counter() - t1
        finally:
            focus.disarm()
            if fused is not None:
                fused.close()
            if attached:
                p.detach()
        held = cache.get_seq_length()
        yield Done(
            text=decoder.text() if stop is None else stop.shown + stop.held, prompt_tokens=n, new_tokens=new, prefill_s=prefill_s, decode_s=decode_s,
            ttft_s=ttft, stop_reason=reason, kv_tokens=held, kv_bytes=cache.nbytes(),
            kv_full_bytes=_unit_bytes(cache, held) * (first_pos + n + max(new - 1, 0)),
        )


class _Focus:
    """One generation's focus (engine/focus.py): a probe armed for the prompt's tail, then a view of the cache."""

    def __init__(self, model, cache: KVCache, policy: Policy, n: int, max_new: int):
        self.model, self.cache, self.policy, self.max_new = model, cache, policy, max_new
        self.k = policy.focus_units() if policy.evicts else 0
        self.window, self.spread = (policy.focus_window, policy.focus_spread) if self.k else (0, 0)
        self.tail_start = max(0, n - policy.local)  # where the tail (the question) begins in the prompt
        self.n = n
        self.probe: focus_mod.Probe | None = None

    def _arm(self) -> None:
        held = self.cache.get_seq_length()
        if self.k and held > self.k and self.probe is None:  # something to narrow
            self.probe = focus_mod.Probe(self.model, held, self.window)

    def arm_if_all_tail(self) -> None:
        """A prompt within the local tail (a short follow-up): the units held before it are what the view narrows."""
        if self.tail_start == 0:
            self._arm()

    def on_chunk(self, report) -> None:
        if report.end == self.tail_start and report.end < self.n:  # the head's last chunk, evicted
            self._arm()

    def disarm(self) -> None:
        if self.probe is not None:
            self.probe.close()

    def ready(self) -> bool:
        return self.probe is not None and len(self.probe.votes) == len(self.cache.layers)

    def view(self) -> KVCache:
        return focus_mod.view(self.cache, self.probe.votes, self.probe.held, self.k,
                              reserve=self.k + self.n - self.tail_start + self.max_new, after=self.spread)

    def feed(self, answer: list[int], first: int, chunk: int) -> None:
        """Read the answer's tokens into the cache (scored by the policy), as decoding on it would have."""
        ids = torch.tensor([answer], device=next(self.model.parameters()).device)
        for s in range(0, len(answer), chunk):
            piece = ids[:, s:s + chunk]
            forward(self.model, self.cache, piece, first + s)
            self.policy.observe(self.cache, piece.shape[-1], piece)


def peak_units(policy: Policy, prompt_tokens: int, chunk: int, max_new: int) -> int:
    """The cache's peak length per KV head for a prompt (what the engine reserves and the planner plans for)."""
    if policy.bounded():
        grow = min(max_new, 2 * policy.decode_window) if policy.decode_window else max_new
        focus = policy.focus_units()  # a focused answer's view: its units, the tail again and the answer
        return policy.budget + policy.local + grow + max(chunk, focus + policy.local if focus else 0)
    return prompt_tokens + max_new


def _unit_bytes(cache: KVCache, held: int) -> int:
    """Bytes of one unit (all layers) at full precision: a quantized cache says its own, else K/V bytes / held
    (a full cache carries no key remainders)."""
    full = getattr(cache, "full_unit_bytes", None)
    return full() if full is not None else cache.kv_nbytes() // max(held, 1)
