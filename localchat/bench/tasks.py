"""Long-context tasks generated from a seed, sized in tokens of the model's tokenizer.

Each generator `task(tokenizer, n_tokens, seed, depth=None) -> Sample` returns the document (for
`multiturn` also the whole conversation), the question, the expected answer(s), the document's token
count (within a few % of `n_tokens`, never above it) and where each needle sits (token offset in the
document, and the depth in [0, 1] of the asked needle as a share of the filler before it). Haystacks
are natural text from `corpus.natural_text("eval", ...)`; needles are whole sentences between
sentences (filler sentences over 300 characters are skipped, so a needle lands near its depth).
`depth=None` draws the depth from the seed; the runner passes `depth_for(i, n)` = i/(n-1)
for example i of n (0.5 when n = 1), so depths spread evenly from the start to the end.

Tasks and scoring rules (`score(sample, output)`; needle numbers match only as whole digit runs):
- passkey: a 5-digit key in repetitive filler. Correct when the key appears in the output.
- passkeys: 5 labelled 5-digit keys in the passkey filler at fixed depths (PASSKEY_DEPTHS), read once and
  asked one per user turn of one conversation. Each turn is scored against its own key (a whole digit run,
  `score_turn`); the row's score is the share of keys found. `score` on one output: the share of the keys
  it holds.
- niah_single: "One of the special magic numbers for KEY is: N." in natural text (7-digit N).
  Correct when N appears.
- niah_multikey: the asked needle plus 3 distractor needles with other keys and numbers (at seeded
  depths). Correct when the asked N appears.
- niah_multivalue: 4 needles with the same key and different numbers (the first at `depth`). Correct
  only when all 4 numbers appear.
- variable_tracking: a chain "VAR A = N." "VAR B = VAR A." ... (5 names, first at `depth`, the rest
  later in order) plus a distractor chain with another value. Correct when the set of 5-capital-letter
  names in the output equals the asked chain's names.
- common_words: a numbered list of words; 10 words appear far more often than the rest. Score =
  recall: the share of those 10 words found in the output (whole words, any case).
- doc_qa: 4 facts about invented organisations (founding year, town, director, colour, ...) planted in
  natural text; one question about the fact at `depth`. Correct when the fact's value appears
  (case and spacing ignored).
- multiturn: a niah_single document in the first user turn, `turns` unrelated questions (default 9),
  then the question. Scored as niah_single. `messages` holds the conversation with short reference
  answers; the bench sends the user turns through a Session, so the model's own answers are kept.
- docs_qa: real reference text instead of planted facts: sections "## NAME(SIGNATURE)" + docstring of
  the eval split's modules, classes, functions and methods (`corpus.sections("eval")`, those up to
  MAX_SECTION characters, each at most once, in a seeded order), with the asked section at `depth`
  (the needle offset is its "##" line). Nothing is generated: the answer is read from the objects. Two
  kinds, drawn from the seed (or `kind=`): "default", the default of a named parameter of a named
  function as its header shows it (`inspect.signature`; strings and numbers with 3+ letters or digits,
  never None/True/0), and "name", which function, method or class has documentation that begins
  with a quoted first sentence (answer: its last name, e.g. `quote` for shlex.quote). A fact is
  asked only when its answer occurs at most SHARED times in the split and the sentence once; the
  other sections that hold the answer (or the sentence) are left out of that document, so the answer
  stands only in the asked section. Correct for "name" when the identifier appears whole (any case;
  `shlex.quote` counts, `quote_plus` does not); for a numeric default when a number in the output
  has its value (1e-9 for 1e-09; 999 is not -999); for a string default when its letters and digits
  appear as whole words (quotes, case and punctuation ignored: 'utf-8' ~ UTF-8). The split holds 2,388 such
  sections, about 156K tokens of SmolLM2's tokenizer (enough for 128K; a longer document raises);
  on CPython 3.11 there are 18 "default" facts (15 distinct answers) and 718 "name" facts.
Documents go to the model the way the app lays them out: `render.user_turn(question, [document])`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
import re
from bisect import bisect_right
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

from localchat.bench.corpus import Section, natural_text, paragraphs, sections
from localchat.engine.encode import encode

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DOC_NAME = "document.txt"

ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
              "keen", "lunar", "mellow", "noble", "olive", "proud", "quiet", "rusty", "silver", "tidy",
              "upper", "vivid", "wild", "young", "zesty", "bold", "crisp", "dim", "early", "fierce")
NOUNS = ("anchor", "badger", "candle", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quilt", "river", "saddle", "tunnel",
         "umbrella", "valley", "walnut", "yarrow", "zephyr", "beacon", "cobalt", "drum", "feather", "glacier")
KINDS = ("Society", "Institute", "Guild", "Foundation", "Observatory", "Library", "Company", "Museum")
FIRST_NAMES = ("Ada", "Bruno", "Celia", "Dorian", "Elsa", "Felix", "Greta", "Hugo", "Ines", "Jonas",
               "Klara", "Leon", "Mira", "Nils", "Olga", "Pavel")
LAST_NAMES = ("Albrecht", "Brandt", "Castell", "Dunmore", "Ekberg", "Fontaine", "Galloway", "Hartley",
              "Ivers", "Jansen", "Kowal", "Lindqvist", "Marchetti", "Norwood", "Ostrand", "Pellham")
TOWN_HEADS = ("Bren", "Cal", "Dun", "Esk", "Fal", "Gar", "Hol", "Kes", "Lin", "Mor", "Nor", "Pel", "Ros", "Tam")
TOWN_TAILS = ("moor", "wick", "ford", "holm", "bury", "stead", "dale", "haven", "mouth", "ton")
COLOURS = ("crimson", "turquoise", "violet", "orange", "ivory", "scarlet", "lilac", "maroon", "teal", "ochre")
CHAT_TURNS = (
    ("What is the capital of France?", "Paris."),
    ("Name a primary colour.", "Red."),
    ("How many days are in a week?", "Seven."),
    ("What do bees make?", "Honey."),
    ("Which planet is known as the red planet?", "Mars."),
    ("What is the opposite of cold?", "Hot."),
    ("How many legs does a spider have?", "Eight."),
    ("What is frozen water called?", "Ice."),
    ("Which animal is known for its long neck?", "The giraffe."),
    ("What is the first month of the year?", "January."),
)
# Longest answer each task needs (greedy decoding stops earlier at the end token).
ANSWER_TOKENS = {"passkey": 16, "passkeys": 16, "niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64,
                 "variable_tracking": 48, "common_words": 96, "doc_qa": 32, "multiturn": 24,
                 "docs_qa": 64}  # docs_qa: SmolLM2 restates the question before a value of up to 19 digits


@dataclasses.dataclass(frozen=True)
class Sample:
    task: str
    document: str
    question: str
    answer: str  # the expected answer; several values joined by ", "
    n_tokens: int  # tokens of `document`
    needle_token: int  # token offset of the (asked or first) needle inside the document; -1 if none
    depth: float | None  # depth of that needle; None when the task has no needle (common_words)
    answers: tuple[str, ...] = ()  # every expected value
    needle_tokens: tuple[int, ...] = ()  # token offset of every needle, the asked one first
    messages: tuple[dict, ...] = ()  # multiturn: the conversation, ending with the question


def _count(tokenizer, text: str) -> int:
    return len(encode(tokenizer, text))  # a long text in pieces: the same count, a bounded peak


def passkey(tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> Sample:
    """A 5-digit pass key hidden in repetitive filler at `depth` (random from the seed if None)."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.random() if depth is None else depth
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    count = lambda s: _count(tokenizer, s)  # noqa: E731
    per_filler = count(PASSKEY_FILLER * 10) / 10
    n_fill = max(0, int((n_tokens - count(needle)) / per_filler))
    at = round(n_fill * depth)
    before, after = PASSKEY_FILLER * at, PASSKEY_FILLER * (n_fill - at)
    document = before + needle + after
    return Sample(
        task="passkey", document=document, question="What is the pass key? Answer with the number only.",
        answer=key, n_tokens=count(document), needle_token=count(before), depth=depth,
        answers=(key,), needle_tokens=(count(before),),
    )


PASSKEY_LABELS = ("red box", "blue door", "green lamp", "yellow cup", "white car")
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
SMALL_GAP = 3  # fillers per gap in the copy whose tokens are counted


def passkeys(tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> Sample:
    """Five 5-digit pass keys, one per label of PASSKEY_LABELS, in the passkey filler at PASSKEY_DEPTHS (of the
    filler before each); `depth` is ignored, every sample holds all five. `messages`: the document with the first
    question, then one user turn per other key, in depth order (with short reference answers between them);
    `question` is the first question, `answers` and `needle_tokens` follow depth order.

    The filler repeats, so a 1M-token document is never tokenized whole: tokens are counted on a copy with at
    most SMALL_GAP fillers per gap, plus the filler's own count for each filler left out."""
    rng = random.Random(seed)
    keys = _distinct(rng, lambda r: str(r.randint(10000, 99999)), len(PASSKEY_LABELS))
    needles = [f"The pass key of the {label} is {key}. Remember it. {key} is the pass key of the {label}. "
               for label, key in zip(PASSKEY_LABELS, keys)]
    per_filler = _count(tokenizer, PASSKEY_FILLER * 4) - _count(tokenizer, PASSKEY_FILLER * 3)
    n_fill = (n_tokens - sum(_count(tokenizer, n) for n in needles)) // per_filler
    for _ in range(4):  # the count grows by per_filler a filler once every gap holds SMALL_GAP: one step lands
        if n_fill < 1:
            raise ValueError(f"{n_tokens} tokens cannot hold {len(needles)} pass keys")
        ats = [round(n_fill * d) for d in PASSKEY_DEPTHS]
        gaps = [b - a for a, b in zip([0, *ats], [*ats, n_fill])]
        total, offsets = _filler_tokens(tokenizer, gaps, needles, per_filler, "")
        if 0 <= n_tokens - total < per_filler:
            break
        n_fill += (n_tokens - total) // per_filler
    tail = ""
    sentences = re.findall(r".+?\. ", PASSKEY_FILLER)
    for j in range(len(sentences) - 1, 0, -1):  # top up with the filler's first sentences
        more = _filler_tokens(tokenizer, gaps, needles, per_filler, "".join(sentences[:j]))
        if more[0] <= n_tokens:
            (total, offsets), tail = more, "".join(sentences[:j])
            break
    if total > n_tokens:
        raise ValueError(f"{n_tokens} tokens cannot hold {len(needles)} pass keys")
    document = _interleave(gaps, needles, tail)[0]
    questions = [f"What is the pass key of the {label}? Answer with the number only." for label in PASSKEY_LABELS]
    messages = [{"role": "user", "content": user_message(questions[0], document)}]
    for label, key, question in zip(PASSKEY_LABELS, keys, questions[1:]):
        messages += [{"role": "assistant", "content": f"The pass key of the {label} is {key}."},
                     {"role": "user", "content": question}]
    return Sample(task="passkeys", document=document, question=questions[0], answer=", ".join(keys),
                  n_tokens=total, needle_token=offsets[0], depth=PASSKEY_DEPTHS[0], answers=tuple(keys),
                  needle_tokens=tuple(offsets), messages=tuple(messages))


def _interleave(gaps: list[int], needles: list[str], tail: str) -> tuple[str, list[int]]:
    """gaps[0] fillers, needles[0], gaps[1] fillers, ..., the last gap's fillers, `tail` (no space at the end,
    as the app lays a document out); the text and each needle's character offset."""
    parts, starts, length = [], [], 0
    for i, gap in enumerate(gaps):
        parts.append(PASSKEY_FILLER * gap)
        length += len(parts[-1])
        if i < len(needles):
            starts.append(length)
            parts.append(needles[i])
            length += len(needles[i])
    return ("".join(parts) + tail).rstrip(), starts


def _filler_tokens(tokenizer, gaps: list[int], needles: list[str], per_filler: int,
                   tail: str) -> tuple[int, list[int]]:
    """(token count, each needle's token offset) of `_interleave(gaps, needles, tail)`, read from a copy with at
    most SMALL_GAP fillers per gap: each filler left out adds `per_filler` tokens."""
    small = [min(g, SMALL_GAP) for g in gaps]
    total, offsets = _token_offsets(tokenizer, *_interleave(small, needles, tail))
    extra = [per_filler * (g - s) for g, s in zip(gaps, small)]
    return total + sum(extra), [o + sum(extra[: i + 1]) for i, o in enumerate(offsets)]


# --- natural-text haystacks ------------------------------------------------------------------------

def _token_offsets(tokenizer, document: str, char_starts: list[int]) -> tuple[int, list[int]]:
    """(token count, index of the first token that reaches each char offset)."""
    try:
        enc = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # slow tokenizers: count the prefix instead
        return _count(tokenizer, document), [_count(tokenizer, document[:c]) for c in char_starts]
    ends = [end for _, end in enc["offset_mapping"]]
    return len(ends), [bisect_right(ends, c) for c in char_starts]


MAX_SENTENCE = 300  # characters; longer filler sentences are skipped, so a needle lands near its depth


def _sentences(text: str) -> list[str]:
    """Pieces that each start with the whitespace before a sentence (so counts add up)."""
    return [p for p in re.split(r"(?<=[.!?])(?=\s)", text) if p and len(p) <= MAX_SENTENCE]


def haystack(tokenizer, n_tokens: int, seed: int, needles: list[tuple[float, str]]) -> tuple[str, list[int]]:
    """Natural text of at most `n_tokens` tokens with each (depth, sentence) needle inserted at a
    sentence boundary; returns the document and each needle's token offset (in `needles` order)."""
    needle_cost = sum(_count(tokenizer, " " + text) for _, text in needles)
    probe = natural_text("eval", 4000, seed)
    chars_per_token = len(probe) / max(_count(tokenizer, probe), 1)
    budget = n_tokens - needle_cost
    if budget < 8:
        raise ValueError(f"{n_tokens} tokens cannot hold the needles ({needle_cost} tokens)")
    pieces = _sentences(natural_text("eval", int(budget * chars_per_token * 1.2) + 400, seed))
    return _place(tokenizer, n_tokens, pieces, budget, needles)


def _place(tokenizer, n_tokens: int, pieces: list[str], budget: int, needles: list[tuple[float, str]],
           sep: str = " ") -> tuple[str, list[int]]:
    """`pieces` (each starting with its separating whitespace) up to `budget` tokens with the needles between
    them, shrunk until the whole is at most `n_tokens`; the document and each needle's token offset."""
    sizes = [len(ids) for ids in tokenizer(pieces, add_special_tokens=False)["input_ids"]]
    order = sorted(range(len(needles)), key=lambda j: needles[j][0])  # stable: ties keep list order
    for _ in range(4):
        document, starts = _assemble(pieces, sizes, budget, [needles[j] for j in order], sep)
        total, offsets = _token_offsets(tokenizer, document, starts)
        if total <= n_tokens:
            break
        budget -= total - n_tokens
    by_needle = [0] * len(needles)
    for j, off in zip(order, offsets):
        by_needle[j] = off
    return document, by_needle


def _assemble(pieces: list[str], sizes: list[int], budget: int,
              needles: list[tuple[float, str]], sep: str = " ") -> tuple[str, list[int]]:
    """Take pieces in order up to `budget` tokens (skipping those that would overflow it), then put
    the needles (sorted by depth) between them."""
    chosen = []
    bounds = [0]  # filler tokens before chosen piece i
    for piece, size in zip(pieces, sizes):
        if bounds[-1] + size <= budget:
            chosen.append(piece)
            bounds.append(bounds[-1] + size)
    pieces, take, used = chosen, len(chosen), bounds[-1]
    at = [min(range(take + 1), key=lambda i: abs(bounds[i] - d * used)) for d, _ in needles]
    parts: list[str] = []
    starts: list[int] = []
    length = 0
    nxt = 0
    for i in range(take + 1):
        while nxt < len(needles) and at[nxt] == i:
            gap = sep if parts else ""
            starts.append(length + len(gap))
            parts.append(gap + needles[nxt][1])
            length += len(parts[-1])
            nxt += 1
        if i < take:
            piece = pieces[i] if parts else pieces[i].lstrip()
            parts.append(piece)
            length += len(piece)
    return "".join(parts), starts


def _rng_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _distinct(rng: random.Random, make: Callable[[random.Random], str], k: int) -> list[str]:
    seen: dict[str, None] = {}
    while len(seen) < k:
        seen[make(rng)] = None
    return list(seen)


def _magic(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _single(tokenizer, n_tokens: int, seed: int, depth: float | None) -> tuple[str, str, str, list[int], float]:
    """(key, value, document, offsets, depth) of one needle in natural text."""
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    key, value = _rng_key(rng), _magic(rng)
    document, offsets = haystack(tokenizer, n_tokens, rng.randrange(2**31), [(depth, _needle(key, value))])
    return key, value, document, offsets, depth


def niah_single(tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> Sample:
    key, value, document, offsets, depth = _single(tokenizer, n_tokens, seed, depth)
    question = (f"What is the special magic number for {key} mentioned in the provided text? "
                f"Answer with the number only.")
    return _sample("niah_single", tokenizer, document, question, [value], offsets, depth)


def niah_multikey(tokenizer, n_tokens: int, seed: int, depth: float | None = None, keys: int = 4) -> Sample:
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    names = _distinct(rng, _rng_key, keys)
    values = _distinct(rng, _magic, keys)
    needles = [(depth if j == 0 else rng.random(), _needle(k, v)) for j, (k, v) in enumerate(zip(names, values))]
    document, offsets = haystack(tokenizer, n_tokens, rng.randrange(2**31), needles)
    question = (f"What is the special magic number for {names[0]} mentioned in the provided text? "
                f"Answer with the number only.")
    return _sample("niah_multikey", tokenizer, document, question, [values[0]], offsets, depth)


def niah_multivalue(tokenizer, n_tokens: int, seed: int, depth: float | None = None, values: int = 4) -> Sample:
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    key = _rng_key(rng)
    numbers = _distinct(rng, _magic, values)
    needles = [(depth if j == 0 else rng.random(), _needle(key, v)) for j, v in enumerate(numbers)]
    document, offsets = haystack(tokenizer, n_tokens, rng.randrange(2**31), needles)
    question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                f"List every one of them.")
    return _sample("niah_multivalue", tokenizer, document, question, numbers, offsets, depth)


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def variable_tracking(tokenizer, n_tokens: int, seed: int, depth: float | None = None, hops: int = 4) -> Sample:
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    names = _distinct(rng, _var_name, 2 * (hops + 1))
    asked, other = names[: hops + 1], names[hops + 1:]
    value, decoy = _distinct(rng, lambda r: str(r.randint(10000, 99999)), 2)

    def chain(vars_: list[str], number: str, depths: list[float]) -> list[tuple[float, str]]:
        lines = [f"VAR {vars_[0]} = {number}."] + [f"VAR {b} = VAR {a}." for a, b in zip(vars_, vars_[1:])]
        return list(zip(depths, lines))

    asked_depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in range(hops))
    needles = chain(asked, value, asked_depths) + chain(other, decoy, sorted(rng.random() for _ in range(hops + 1)))
    document, offsets = haystack(tokenizer, n_tokens, rng.randrange(2**31), needles)
    question = (f"Find all variables that are assigned the value {value} in the text above, directly or "
                f"through other variables. Answer with their names only.")
    return _sample("variable_tracking", tokenizer, document, question, asked, offsets, depth)


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Lower-case words of 4 to 10 letters from the eval corpus, sorted."""
    return tuple(sorted({w for p in paragraphs("eval") for w in re.findall(r"\b[a-z]{4,10}\b", p)}))


def _word_list(rng: random.Random, vocab: tuple[str, ...], entries: int, top: int) -> tuple[str, list[str]]:
    """A numbered list of about `entries` words: `top` common words, each other word `rare` times."""
    rare = max(3, math.ceil((entries - top * 30) / (len(vocab) - top)))
    common = max(rare + 2, min(max(30, 3 * rare), entries // (3 * top)))
    n_rare = (entries - top * common) // rare
    if n_rare < top:
        raise ValueError(f"{entries} list entries are too few for a common_words list")
    words = rng.sample(vocab, top + n_rare)
    items = words[:top] * common + words[top:] * rare
    rng.shuffle(items)
    return "".join(f"{i + 1}. {w}\n" for i, w in enumerate(items)).rstrip("\n"), sorted(words[:top])


def common_words(tokenizer, n_tokens: int, seed: int, depth: float | None = None, top: int = 10) -> Sample:
    """A numbered word list: `top` words far more often than the rest, shuffled (no needle, no depth)."""
    vocab = _vocabulary()
    per_entry = _count(tokenizer, "".join(f"{i + 1}. {w}\n" for i, w in enumerate(vocab[:: len(vocab) // 200]))) / 200
    entries = int(n_tokens / per_entry)
    best = None
    for _ in range(5):  # resize until the list fills 97-100% of n_tokens
        document, answers = _word_list(random.Random(seed), vocab, entries, top)
        total = _count(tokenizer, document)
        if total <= n_tokens and (best is None or total > best[0]):
            best = (total, document, answers)
        if 0.97 * n_tokens <= total <= n_tokens:
            break
        entries = int(entries * n_tokens / total) - (1 if total > n_tokens else 0)
    if best is None:
        raise ValueError(f"cannot fit a common_words list in {n_tokens} tokens")
    total, document, answers = best
    question = (f"What are the {top} most common words in the list above? "
                f"Answer with the words only, separated by commas.")
    return Sample(task="common_words", document=document, question=question, answer=", ".join(answers),
                  n_tokens=total, needle_token=-1, depth=None, answers=tuple(answers))


FACTS = (  # (statement, question, kind of value)
    ("The {e} was founded in the year {v}.", "In which year was the {e} founded?", "year"),
    ("The {e} has its headquarters in the town of {v}.", "In which town does the {e} have its headquarters?", "town"),
    ("The current director of the {e} is {v}.", "Who is the current director of the {e}?", "person"),
    ("The main building of the {e} is painted {v}.", "What colour is the main building of the {e}?", "colour"),
    ("The {e} keeps a collection of exactly {v} old maps.", "How many old maps does the {e} keep?", "count"),
)


def _value(rng: random.Random, kind: str) -> str:
    if kind == "year":
        return str(rng.randint(1700, 1999))
    if kind == "town":
        return rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)
    if kind == "person":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    if kind == "colour":
        return rng.choice(COLOURS)
    return str(rng.randint(100, 9999))


def doc_qa(tokenizer, n_tokens: int, seed: int, depth: float | None = None, facts: int = 4) -> Sample:
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    entities = _distinct(rng, lambda r: f"{r.choice(ADJECTIVES).title()} {r.choice(NOUNS).title()} "
                                        f"{r.choice(KINDS)}", facts)
    templates = rng.sample(FACTS, facts)
    values = [_value(rng, kind) for _, _, kind in templates]
    needles = [(depth if j == 0 else rng.random(), statement.format(e=e, v=v))
               for j, ((statement, _, _), e, v) in enumerate(zip(templates, entities, values))]
    document, offsets = haystack(tokenizer, n_tokens, rng.randrange(2**31), needles)
    question = templates[0][1].format(e=entities[0]) + " Answer briefly."
    return _sample("doc_qa", tokenizer, document, question, [values[0]], offsets, depth)


# --- questions about real reference text ----------------------------------------------------------

MAX_SECTION = 2000  # characters; longer sections are left out, so the asked one lands near its depth
MAX_ASKED = 1000  # characters of an asked section (it must fit short documents)
SHARED = 3  # an answer may occur this often at most in the split's sections (the document keeps one)
FACT_KINDS = ("default", "name")


@dataclasses.dataclass(frozen=True)
class Fact:
    kind: str  # "default": a parameter's default; "name": whose docstring begins with a sentence
    section: int  # index of the asked section in Reference.sections
    question: str
    answer: str  # as the section writes it: a default's repr, or the object's last name
    marks: tuple[str, ...]  # normalised text that no other section of the document may hold


@dataclasses.dataclass(frozen=True)
class Reference:
    sections: tuple[Section, ...]
    normed: tuple[str, ...]  # " " + _norm(section text) + " "
    facts: dict[str, tuple[Fact, ...]]  # by kind


@functools.lru_cache(maxsize=1)
def reference() -> Reference:
    """The eval split's sections up to MAX_SECTION characters and every fact that can be asked about them."""
    pool = tuple(s for s in sections("eval") if len(s.text) <= MAX_SECTION)
    normed = tuple(f" {_norm(s.text)} " for s in pool)
    every = "\n".join(normed)  # sections apart: a match cannot cross the newline
    facts = [f for i, s in enumerate(pool) if len(s.text) <= MAX_ASKED
             for f in _default_facts(i, s, every) + _name_facts(i, s, every)]
    return Reference(pool, normed, {k: tuple(f for f in facts if f.kind == k) for k in FACT_KINDS})


def _distinctive(value: str) -> bool:
    """A default worth asking: a string or a number (as repr shows it) with at least 3 letters or digits."""
    if not (value[0] in "'\"" or re.fullmatch(r"-?\d[\d_.e+-]*", value)):
        return False  # None, True, bytes, tuples, ...
    return len(_norm(value).replace(" ", "")) >= 3


def _default_facts(i: int, section: Section, every: str) -> list[Fact]:
    facts = []
    for param, value in section.defaults:
        key = _norm(value)
        question = (f"In the provided text, what is the default value of the parameter {param} of "
                    f"{section.name}? Answer with the value only.")
        if (_distinctive(value) and every.count(f" {key} ") <= SHARED
                and f" {key} " not in f" {_norm(question)} "):
            facts.append(Fact("default", i, question, value, (key,)))
    return facts


def _first_sentence(doc: str) -> str | None:
    para = " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())
    found = re.match(r"(.+?[.!?])(?:\s|$)", para)
    return found.group(1) if found else None


def _name_facts(i: int, section: Section, every: str) -> list[Fact]:
    name = section.name.rsplit(".", 1)[-1]
    sentence = _first_sentence(section.doc)
    if section.kind == "module" or len(name) < 4 or sentence is None or not 40 <= len(sentence) <= 200:
        return []
    key, said = _norm(name), _norm(sentence)
    if f" {key} " in f" {said} " or every.count(f" {key} ") > SHARED or every.count(f" {said} ") > 1:
        return []  # the sentence gives the name away, or either is not distinctive
    question = (f'Which function, method or class in the provided text has documentation that begins: '
                f'"{sentence}" Answer with its name only.')
    return [Fact("name", i, question, name, (key, said))]


def docs_qa(tokenizer, n_tokens: int, seed: int, depth: float | None = None, kind: str | None = None) -> Sample:
    """Real reference sections (standard-library docstrings of the eval split) with a question about the
    one at `depth`: a parameter's default, or which object's docstring begins with a given sentence."""
    rng = random.Random(seed)
    depth = rng.random() if depth is None else depth
    kind = rng.choice(FACT_KINDS) if kind is None else kind
    if kind not in FACT_KINDS:
        raise ValueError(f"docs_qa kind must be one of {', '.join(FACT_KINDS)}, not {kind!r}")
    ref = reference()
    fact = rng.choice(ref.facts[kind])
    asked = ref.sections[fact.section].text
    budget = n_tokens - _count(tokenizer, "\n\n" + asked)
    if budget < 8:
        raise ValueError(f"{n_tokens} tokens cannot hold the asked section ({n_tokens - budget} tokens)")
    filler = ["\n\n" + s.text for i, (s, text) in enumerate(zip(ref.sections, ref.normed))
              if i != fact.section and not any(f" {m} " in text for m in fact.marks)]
    random.Random(rng.randrange(2**31)).shuffle(filler)
    for pieces in (_enough(tokenizer, filler, budget), filler):  # every section if the first ones leave a gap
        document, offsets = _place(tokenizer, n_tokens, pieces, budget, [(depth, asked)], sep="\n\n")
        sample = _sample("docs_qa", tokenizer, document, fact.question, [fact.answer], offsets, depth)
        if sample.n_tokens >= 0.97 * n_tokens:
            return sample
    raise ValueError(f"the eval split's reference text fills only {sample.n_tokens} of {n_tokens} tokens "
                     f"without repeating a section")


def _enough(tokenizer, pieces: list[str], budget: int, spare: int = 100) -> list[str]:
    """The first pieces: 20% more characters than `budget` tokens need (the rate read from the first
    ones), then `spare` more, so that short pieces can fill the end of the budget."""
    probe = "".join(pieces[:40])
    want = budget * len(probe) / max(_count(tokenizer, probe), 1) * 1.2 + 400
    size = 0
    for n, piece in enumerate(pieces):
        if size >= want:
            return pieces[: n + spare]
        size += len(piece)
    return pieces


OPENING = "I will ask you about this document later. For now, reply with OK."


def multiturn(tokenizer, n_tokens: int, seed: int, depth: float | None = None, turns: int = 9) -> Sample:
    """The niah_single needle in the first turn's document, `turns` unrelated turns, then the question
    (default: the question is the 11th user turn, after 10 turns of history)."""
    key, value, document, offsets, depth = _single(tokenizer, n_tokens, seed, depth)
    rng = random.Random(seed + 1)
    messages = [{"role": "user", "content": user_message(OPENING, document)},
                {"role": "assistant", "content": "OK. I have read the document."}]
    for q, a in rng.sample(CHAT_TURNS, turns):
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    question = (f"What is the special magic number for {key} in the document I gave you at the start? "
                f"Answer with the number only.")
    messages.append({"role": "user", "content": question})
    sample = _sample("multiturn", tokenizer, document, question, [value], offsets, depth)
    return dataclasses.replace(sample, messages=tuple(messages))


def _sample(task: str, tokenizer, document: str, question: str, answers: list[str], offsets: list[int],
            depth: float) -> Sample:
    return Sample(task=task, document=document, question=question, answer=", ".join(answers),
                  n_tokens=_count(tokenizer, document), needle_token=offsets[0], depth=depth,
                  answers=tuple(answers), needle_tokens=tuple(offsets))


# --- prompts ---------------------------------------------------------------------------------------

def as_document(document: str):
    """The generated text as the Document the app would have read from a file."""
    from localchat.documents import Document

    raw = document.encode("utf-8")
    return Document(path=Path(DOC_NAME), name=DOC_NAME, kind="text", text=document,
                    sha256=hashlib.sha256(raw).hexdigest(), n_bytes=len(raw))


def user_message(question: str, document: str) -> str:
    """The user turn the app builds for a question about one attached document."""
    from localchat.render import user_turn

    return user_turn(question, [as_document(document)])


def prompt_messages(sample: Sample) -> list[dict]:
    """The chat messages the model gets for `sample`."""
    if sample.messages:
        return [dict(m) for m in sample.messages]
    return [{"role": "user", "content": user_message(sample.question, sample.document)}]


# --- scoring ---------------------------------------------------------------------------------------

def _has_number(output: str, number: str) -> bool:
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", output) is not None


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def score_passkey(sample: Sample, output: str) -> bool:
    return sample.answer in output


def score_keys(sample: Sample, output: str) -> float:
    """passkeys on one output: the share of the keys it holds (whole digit runs)."""
    return sum(_has_number(output, k) for k in sample.answers) / len(sample.answers)


def score_turn(sample: Sample, i: int, output: str) -> bool:
    """passkeys as a conversation: whether the answer of turn i (from 0) holds key i (a whole digit run)."""
    return _has_number(output, sample.answers[i])


def score_needle(sample: Sample, output: str) -> bool:
    """niah_single, niah_multikey, multiturn: the asked number appears."""
    return _has_number(output, sample.answers[0])


def score_multivalue(sample: Sample, output: str) -> bool:
    return all(_has_number(output, v) for v in sample.answers)


def score_variables(sample: Sample, output: str) -> bool:
    return set(re.findall(r"\b[A-Z]{5}\b", output)) == set(sample.answers)


def score_common_words(sample: Sample, output: str) -> float:
    said = set(re.findall(r"[a-z]+", output.lower()))
    return sum(w in said for w in sample.answers) / len(sample.answers)


def score_doc_qa(sample: Sample, output: str) -> bool:
    return f" {_norm(sample.answers[0])} " in f" {_norm(output)} "


_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?!\w)", flags=re.I)


def score_docs_qa(sample: Sample, output: str) -> bool:
    """A name: the identifier appears whole, any case (`shlex.quote` counts for quote, quote_plus does not).
    A number: one in the output has its value (1e-9 for 1e-09; 999 is not -999). A string: its letters
    and digits appear as whole words, quotes, case and punctuation ignored ('utf-8' ~ UTF-8)."""
    answer = sample.answers[0]
    if answer.isidentifier():
        return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", output, flags=re.I) is not None
    if answer[0] not in "'\"":
        return any(Decimal(n) == Decimal(answer) for n in _NUMBER.findall(output))
    return f" {_norm(answer)} " in f" {_norm(output)} "


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey, "passkeys": passkeys, "niah_single": niah_single, "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue, "variable_tracking": variable_tracking,
    "common_words": common_words, "doc_qa": doc_qa, "multiturn": multiturn, "docs_qa": docs_qa,
}
SCORERS: dict[str, Callable[[Sample, str], bool | float]] = {
    "passkey": score_passkey, "passkeys": score_keys, "niah_single": score_needle, "niah_multikey": score_needle,
    "niah_multivalue": score_multivalue, "variable_tracking": score_variables,
    "common_words": score_common_words, "doc_qa": score_doc_qa, "multiturn": score_needle,
    "docs_qa": score_docs_qa,
}


def score(sample: Sample, output: str) -> bool | float:
    """The task's scoring rule (module doc): a bool, or a float in [0, 1] for common_words and passkeys."""
    return SCORERS[sample.task](sample, output)


def depth_for(i: int, n: int) -> float:
    """Needle depth of example i of n: evenly spread over [0, 1]."""
    return i / (n - 1) if n > 1 else 0.5


def make_sample(task: str, tokenizer, n_tokens: int, seed: int, depth: float | None, **options) -> Sample:
    """`options`: task settings, e.g. turns=N for multiturn."""
    return TASKS[task](tokenizer, n_tokens, seed, depth, **options)
