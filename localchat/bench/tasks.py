"""Long-context tasks generated from a seed, sized in tokens of the model's tokenizer.

Each generator returns a `Sample`: the document, the question, the expected answer, and where the
needle sits (token offset and depth in [0, 1]). Scoring rule for `passkey`: the answer is correct
when the 5-digit key appears in the model's output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Sample:
    task: str
    document: str
    question: str
    answer: str
    n_tokens: int  # tokens of `document`
    needle_token: int  # token offset of the needle inside the document
    depth: float


def passkey(tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> Sample:
    """A 5-digit pass key hidden in repetitive filler at `depth` (random from the seed if None)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.random() if depth is None else depth
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    per_filler = count(PASSKEY_FILLER * 10) / 10
    n_fill = max(0, int((n_tokens - count(needle)) / per_filler))
    at = round(n_fill * depth)
    before, after = PASSKEY_FILLER * at, PASSKEY_FILLER * (n_fill - at)
    document = before + needle + after
    return Sample(
        task="passkey", document=document, question="What is the pass key? Answer with the number only.",
        answer=key, n_tokens=count(document), needle_token=count(before), depth=depth,
    )


def score_passkey(sample: Sample, output: str) -> bool:
    return sample.answer in output
