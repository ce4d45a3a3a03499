"""Turn a user's file (text, source code, PDF, HTML) into plain text for a prompt."""

from __future__ import annotations

import codecs
import hashlib
import io
import logging
import os
import re
import shlex
import stat
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

from localchat.errors import UserError

DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_SNIFF = 8192  # bytes / chars examined for binary detection
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # many of these => binary
_HINT_KIND = "attach a text, PDF or HTML file"

# Byte-order marks; UTF-32 LE must be tested before UTF-16 LE (same prefix).
_BOMS = [
    (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"),
]

# Well-known binary signatures, so the error can name the file type.
_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "PNG image"), (b"\xff\xd8\xff", "JPEG image"),
    (b"GIF87a", "GIF image"), (b"GIF89a", "GIF image"),
    (b"PK\x03\x04", "ZIP archive; .docx/.xlsx/.odt files are ZIP too"),
    (b"\x1f\x8b", "gzip archive"), (b"\xfd7zXZ\x00", "xz archive"),
    (b"7z\xbc\xaf\x27\x1c", "7-Zip archive"), (b"\x28\xb5\x2f\xfd", "zstd archive"),
    (b"\x7fELF", "ELF executable"), (b"\xcf\xfa\xed\xfe", "Mach-O executable"),
    (b"SQLite format 3\x00", "SQLite database"), (b"ID3", "MP3 audio file"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "old Microsoft Office file"),
]


class DocumentError(UserError):
    """One-line, user-facing message naming the file, the problem and what to do."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


@dataclass(frozen=True)
class Document:
    path: Path  # resolved absolute path
    name: str  # file name
    kind: str  # "text" | "pdf" | "html"
    text: str
    sha256: str  # of the raw file bytes
    n_bytes: int


def _show(raw: str) -> str:
    """The path as typed, with control characters escaped so it stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in raw)


def _human(n: int) -> str:
    size, unit = float(n), "bytes"
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            break
        size /= 1024
    if unit == "bytes":
        return f"{n} bytes"
    return f"{size:.1f}".removesuffix(".0") + f" {unit}"


def _norm_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _decode(data: bytes, shown: str) -> str:
    """Bytes -> str via BOM, strict UTF-8, then cp1252/latin-1; reject binaries."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            text = data[len(bom):].decode(codec, errors="replace")
            break
    else:
        if b"\x00" in data[:_SNIFF]:
            raise DocumentError(f"{shown} looks like a binary file (NUL bytes); {_HINT_KIND}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            try:
                text = data.decode("cp1252")
            except UnicodeDecodeError:
                text = data.decode("latin-1")  # never fails
    sample = text[:_SNIFF]
    if sample and len(_CONTROL.findall(sample)) / len(sample) > 0.10:
        raise DocumentError(f"{shown} looks like a binary file (control characters); {_HINT_KIND}")
    return _norm_newlines(text)


class _Captured(logging.Handler):
    """Collects what pypdf logs while a file is read, so it reaches the message, not the terminal."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _pypdf_quiet():
    """pypdf's log records and warnings during the block, captured (a list of one-line strings) instead of printed."""
    log = logging.getLogger("pypdf")
    handler, propagate = _Captured(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield handler.lines
        handler.lines.extend(str(w.message) for w in caught)
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def _why(problem: str) -> str:
    """A pypdf message as a short clause for a one-line error."""
    line = " ".join(problem.split())
    return line if len(line) <= 80 else line[:77] + "..."


def _pdf_text(data: bytes, shown: str) -> str:
    from pypdf import PdfReader  # lazy: keeps start-up fast
    from pypdf.errors import DependencyError

    if b"%PDF-" not in data[:1024]:
        raise DocumentError(f"{shown} is not a PDF (no %PDF- header in its first bytes): damaged, or another kind "
                            f"of file named .pdf; re-export it, or rename it if it is text")
    damaged = (f"cannot read PDF {shown}: it is damaged (", "); re-export it or paste its text")
    with _pypdf_quiet() as problems:
        try:
            reader = PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):
                raise DocumentError(f"{shown} is a password-protected PDF; attach an unprotected copy")
            pages = []
            for number, page in enumerate(reader.pages, 1):
                try:
                    pages.append(_norm_newlines(page.extract_text() or "").strip())
                except DependencyError:
                    raise
                except Exception as e:  # noqa: BLE001 - one damaged page: say which, never drop it silently
                    raise DocumentError(f"cannot read PDF {shown}: page {number} is damaged "
                                        f"({_why(str(e) or type(e).__name__)}); re-export it or paste its text") from None
        except DocumentError:
            raise
        except DependencyError:  # AES encryption needs the optional 'cryptography' package
            raise DocumentError(f"{shown} is an encrypted PDF; install 'cryptography' or attach an "
                                "unencrypted copy") from None
        except Exception as e:  # noqa: BLE001 - pypdf raises many types for damaged files
            why = problems[0] if problems else (str(e) or type(e).__name__)
            raise DocumentError(f"{damaged[0]}{_why(why)}{damaged[1]}") from None
    text = "\n\n".join(p for p in pages if p)
    if not text and problems:  # pypdf recovered from damage but found nothing: the damage, not a scan
        raise DocumentError(f"{damaged[0]}{_why(problems[0])}; no text could be read{damaged[1]}")
    if not text:
        raise DocumentError(f"{shown} has no text layer (scanned images?); run OCR on it or paste its text")
    return text


_BLOCK = set(
    "address article aside blockquote br dd details div dl dt fieldset figcaption figure footer"
    " form h1 h2 h3 h4 h5 h6 header hr li main nav ol p pre section summary table tr ul".split()
)
_SKIP = {"head", "script", "style", "noscript", "template"}  # content not shown
_SPACES = re.compile(r"[ \t\n\r\f\v]+")


class _HTMLText(HTMLParser):
    """Collects visible text: title first, block elements end lines, <pre> kept verbatim."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title: list[str] = []
        self.lines: list[str] = []
        self._buf: list[str] = []  # current flowing line
        self._pre: list[str] | None = None  # raw text while inside <pre>
        self._skip: list[str] = []  # open skipped elements
        self._in_title = False

    def _flush(self) -> None:
        line = _SPACES.sub(" ", "".join(self._buf)).strip()
        self._buf.clear()
        if line:
            self.lines.append(line)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = not self.title
        elif tag == "body":
            self._skip.clear()  # an unclosed <head> ends here
        elif tag in _SKIP:
            self._skip.append(tag)
        elif self._pre is not None or self._skip:
            return
        elif tag == "pre":
            self._flush()
            self._pre = []
        elif tag == "br" and not "".join(self._buf).strip():
            self.lines.append("")
        elif tag in _BLOCK:
            self._flush()
        elif tag in ("td", "th"):
            self._buf.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        elif tag in _SKIP and tag in self._skip:
            del self._skip[self._skip.index(tag):]
        elif tag == "pre" and self._pre is not None:
            raw = "".join(self._pre).removeprefix("\n").rstrip("\n")
            self.lines.extend(raw.split("\n"))
            self._pre = None
        elif tag in _BLOCK and self._pre is None and not self._skip:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title.append(data)
        elif self._skip:
            return
        elif self._pre is not None:
            self._pre.append(data)
        else:
            self._buf.append(data)

    def extract(self, source: str) -> str:
        self.feed(source)
        self.close()
        self._flush()
        body = "\n".join(self.lines).strip("\n")
        title = _SPACES.sub(" ", "".join(self.title)).strip()
        return f"{title}\n\n{body}" if title and body else title or body


def _too_big(shown: str, size: str, max_bytes: int) -> DocumentError:
    return DocumentError(f"{shown} is {size}, over the {_human(max_bytes)} limit; "
                         "raise --max-file-mb or split the file")


def _unreadable(shown: str, e: OSError) -> DocumentError:
    if isinstance(e, PermissionError):
        return DocumentError(f"cannot read {shown}: permission denied; check its permissions")
    return DocumentError(f"cannot read {shown}: {e.strerror or e}; check the path")


def load_document(path: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """Read `path` and return its text; raise DocumentError with a one-line message."""
    raw = os.fsdecode(os.fspath(path))
    shown = _show(raw)
    p = Path(os.path.expanduser(raw))
    try:
        st = p.stat()  # size check happens before any read
    except (FileNotFoundError, NotADirectoryError):
        raise DocumentError(f"no such file: {shown}; check the path") from None
    except OSError as e:
        raise _unreadable(shown, e) from None
    if stat.S_ISDIR(st.st_mode):
        raise DocumentError(f"{shown} is a directory; attach a file")
    if not stat.S_ISREG(st.st_mode):
        raise DocumentError(f"{shown} is not a regular file; attach a regular file")
    if st.st_size > max_bytes:
        raise _too_big(shown, _human(st.st_size), max_bytes)
    if st.st_size == 0:
        raise DocumentError(f"{shown} is empty (0 bytes); attach a file with some text")
    try:
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)  # +1 catches a file that grew since stat()
    except OSError as e:
        raise _unreadable(shown, e) from None
    if len(data) > max_bytes:
        raise _too_big(shown, "larger than when checked", max_bytes)

    ext = p.suffix.lower()
    if ext == ".pdf" or data.startswith(b"%PDF-"):
        kind, text = "pdf", _pdf_text(data, shown)
    else:
        for magic, what in _MAGIC:
            if data.startswith(magic):
                raise DocumentError(f"{shown} looks like a binary file ({what}); {_HINT_KIND}")
        text = _decode(data, shown)
        head = text[:200].lstrip().lower()  # sniff extension-less HTML
        if ext in (".html", ".htm", ".xhtml") or (
                not ext and head.startswith(("<!doctype html", "<html"))):
            kind, text = "html", _HTMLText().extract(text)
        else:
            kind = "text"
        if not text.strip():
            raise DocumentError(f"{shown} contains only whitespace; attach a file with some text")
    digest = hashlib.sha256(data).hexdigest()
    return Document(p.resolve(), p.name, kind, text, sha256=digest, n_bytes=len(data))


def single_token(s: str) -> str | None:
    """`s` as one shell word with quoting and backslash escapes undone; None if it is not one word."""
    s = s.strip()
    if not s or "\n" in s:
        return None
    try:
        tokens = shlex.split(s)
    except ValueError:
        return None
    return tokens[0] if len(tokens) == 1 else None


def parse_path_input(s: str) -> str | None:
    """If `s` is one pasted file path (quoted, backslash-escaped, file:// URL or plain,
    `~` allowed) naming an existing file, return the plain path; else None."""
    cand = single_token(s)
    if cand is None:
        return None
    if cand.lower().startswith("file:"):
        url = urlsplit(cand)
        if url.netloc not in ("", "localhost"):
            return None
        cand = unquote(url.path)
    cand = os.path.expanduser(cand)
    # Only absolute paths: a bare word that happens to name a file in cwd stays prose.
    return cand if os.path.isabs(cand) and os.path.isfile(cand) else None


def tokens_estimate(docs) -> int:
    """About how many tokens `docs` take, before any tokenizer is loaded: one per 3 characters, more than most
    tokenizers make of prose (about 4), so a plan made with it errs toward the longer document."""
    return sum(len(d.text) for d in docs) // 3
