"""Engine: the one façade over model, tokenizer, cache and generation that the TUI, CLI and bench use.

`Engine.chat(messages)` / `Engine.generate(ids)` stream typed events (Progress, Token, Done, Error) and
honour a cancel `threading.Event` between prefill chunks and between decoded tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from localchat.engine import loading
from localchat.engine.cache import POSITION_MODES, KVCache
from localchat.engine.cards import ModelCard
from localchat.engine.detok import StreamDecoder
from localchat.engine.events import Done, Error, Event, Token
from localchat.engine.policies import Policy, make_policy
from localchat.engine.prefill import Cancelled, evict_while_decoding, forward, prefill
from localchat.engine.rope import rope_inv_freq
from localchat.engine.sampling import GenerationSettings, pick_token
from localchat.errors import UserError

DEFAULT_CHUNK = 512
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>", "<end_of_turn>")


class Engine:
    def __init__(self, model, tokenizer, *, name: str = "model", card: ModelCard | None = None,
                 chunk: int | None = None, policy: Policy | None = None, positions: str | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.card = card
        self.chunk = chunk or int((card.locret.get("chunk") if card else 0) or DEFAULT_CHUNK)
        self.set_policy(policy or make_policy("full"), positions)
        self.device = next(model.parameters()).device
        self.window = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.stop_ids = self._stop_ids()

    @classmethod
    def load(cls, spec: str | None = None, *, chunk: int | None = None, device: torch.device | None = None,
             policy: Policy | None = None, positions: str | None = None, say=loading._stderr) -> "Engine":
        loaded = loading.load(spec, device=device, say=say)
        return cls(loaded.model, loaded.tokenizer, name=loaded.name, card=loaded.card, chunk=chunk,
                   policy=policy, positions=positions)

    def set_policy(self, policy: Policy, positions: str | None = None) -> None:
        """Use `policy`; positions default to compact for evicting policies, original otherwise."""
        positions = positions or ("compact" if policy.evicts else "original")
        if positions not in POSITION_MODES:
            raise UserError(f"unknown position mode {positions!r}; choose one of: {', '.join(POSITION_MODES)}")
        self.policy, self.positions = policy, positions

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
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
        settings = settings or GenerationSettings()
        try:
            settings.validate()
            self._check_window(len(prompt_ids))
            yield from self._generate(prompt_ids, settings, cancel)
        except UserError as exc:
            yield Error(str(exc), exc)
        except torch.OutOfMemoryError as exc:
            yield Error("out of memory while generating; try a smaller --chunk or a shorter document", exc)

    @property
    def compressing(self) -> bool:
        """True when positions stay bounded by the budget (compact positions with an evicting policy)."""
        return self.policy.evicts and self.positions == "compact"

    def _check_window(self, n_prompt: int) -> None:
        if not self.window:
            return
        if self.compressing:
            peak = self.policy.budget + max(self.chunk, self.policy.local + 2 * self.policy.decode_window)
            if peak >= self.window:
                raise UserError(
                    f"budget + chunk (or local tail + 2 x decode window) = {peak} positions do not fit {self.name}'s window of {self.window}; "
                    f"lower --budget or --chunk"
                )
        elif n_prompt >= self.window:
            raise UserError(
                f"the prompt is {n_prompt} tokens but {self.name} reads at most {self.window} with "
                f"{self.policy.name} attention at {self.positions} positions; use --policy locret "
                f"--positions compact, or shorten the document"
            )

    @torch.inference_mode()
    def _generate(self, prompt_ids: list[int], settings: GenerationSettings,
                  cancel: threading.Event | None) -> Iterator[Event]:
        n = len(prompt_ids)
        max_new = settings.max_new_tokens
        p = self.policy
        grow = min(max_new, 2 * p.decode_window) if p.decode_window else max_new
        reserve = p.budget + self.chunk + p.local + grow if p.evicts else n + max_new
        inv_freq = rope_inv_freq(self.model) if self.positions == "compact" else None
        cache = KVCache(self.model.config.num_hidden_layers, reserve=reserve, positions=self.positions,
                        inv_freq=inv_freq)
        ids = torch.tensor([prompt_ids], device=self.device)
        decoder = StreamDecoder(self.tokenizer)
        gen = torch.Generator(device="cpu").manual_seed(settings.seed)
        t0 = time.perf_counter()
        prefill_s = decode_s = ttft = 0.0
        new = 0
        reason = "length"
        p.attach(self.model, cache)
        try:
            logits = yield from prefill(self.model, cache, ids, chunk=self.chunk, policy=p, cancel=cancel)
            prefill_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            pos = n
            if self.window and not (self.compressing and p.decode_window):  # RoPE positions left
                max_new = min(max_new, self.window - cache.next_position(n))
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
                yield Token(decoder.push(tok), tok)
                if new == max_new:
                    break
                step = torch.tensor([[tok]], device=self.device)
                logits = forward(self.model, cache, step, pos)
                p.observe(cache, 1, step)  # answer tokens get scores too (multi-turn keeps them)
                evict_while_decoding(cache, p)
                pos += 1
            decode_s = time.perf_counter() - t1
        except Cancelled:
            reason = "cancelled"
            if prefill_s == 0.0:
                prefill_s = time.perf_counter() - t0
            else:
                decode_s = time.perf_counter() - t1
        finally:
            p.detach()
        yield Done(
            text=decoder.text(), prompt_tokens=n, new_tokens=new, prefill_s=prefill_s, decode_s=decode_s,
            ttft_s=ttft, stop_reason=reason, kv_tokens=cache.get_seq_length(), kv_bytes=cache.nbytes(),
            kv_full_bytes=cache.nbytes() // max(cache.get_seq_length(), 1) * (n + max(new - 1, 0)),
        )
