"""Tests for localchat.documents: text/PDF/HTML loading, errors, pasted paths."""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest

from localchat.documents import (
    DEFAULT_MAX_BYTES,
    Document,
    DocumentError,
    load_document,
    parse_path_input,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def make_pdf(path: Path, pages: list[str | None], password: str | None = None,
             owner_password: str | None = None) -> Path:
    """Write a PDF with one Helvetica text line per page (None = blank page)."""
    from pypdf import PdfWriter
    from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

    writer = PdfWriter()
    for text in pages:
        page = writer.add_blank_page(612, 792)
        if text is None:
            continue
        font = DictionaryObject({
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        })
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        stream = DecodedStreamObject()
        stream.set_data(f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1"))
        page.replace_contents(stream)
    if password is not None:
        writer.encrypt(user_password=password, owner_password=owner_password)
    with open(path, "wb") as f:
        writer.write(f)
    return path


def error_of(path: str | Path, **kwargs: int) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg
    return msg


# ---------------------------------------------------------------- text files


def test_utf8_text_and_metadata(tmp_path: Path) -> None:
    raw = "héllo wörld ✓\nsecond line\n".encode()
    f = write(tmp_path / "notes.txt", raw)
    doc = load_document(f)
    assert isinstance(doc, Document)
    assert doc.text == "héllo wörld ✓\nsecond line\n"
    assert doc.kind == "text"
    assert doc.name == "notes.txt"
    assert doc.path == f.resolve() and doc.path.is_absolute()
    assert doc.sha256 == hashlib.sha256(raw).hexdigest()
    assert doc.n_bytes == len(raw)


def test_relative_path_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "rel.md", "# Title\n")
    monkeypatch.chdir(tmp_path)
    doc = load_document("rel.md")
    assert doc.path == (tmp_path / "rel.md").resolve()
    assert doc.text == "# Title\n"


def test_utf8_bom_is_stripped(tmp_path: Path) -> None:
    f = write(tmp_path / "bom.txt", codecs.BOM_UTF8 + "café".encode())
    assert load_document(f).text == "café"


@pytest.mark.parametrize("codec, bom", [
    ("utf-16-le", codecs.BOM_UTF16_LE),
    ("utf-16-be", codecs.BOM_UTF16_BE),
    ("utf-32-le", codecs.BOM_UTF32_LE),
    ("utf-32-be", codecs.BOM_UTF32_BE),
])
def test_utf16_utf32_with_bom(tmp_path: Path, codec: str, bom: bytes) -> None:
    text = "Grüße, мир ✓\r\nline two"
    f = write(tmp_path / "wide.txt", bom + text.encode(codec))
    assert load_document(f).text == "Grüße, мир ✓\nline two"


def test_cp1252_fallback(tmp_path: Path) -> None:
    # 0x93/0x94 are curly quotes and 0x96 an en dash in cp1252, invalid as UTF-8.
    f = write(tmp_path / "win.txt", "“café” – naïve".encode("cp1252"))
    assert load_document(f).text == "“café” – naïve"


def test_latin1_fallback_when_cp1252_fails(tmp_path: Path) -> None:
    # 0x81 is undefined in cp1252, so latin-1 is the last resort.
    f = write(tmp_path / "old.txt", b"caf\xe9 cr\xe8me br\xfbl\xe9e \x81 ok")
    assert load_document(f).text == "café crème brûlée \x81 ok"


def test_newlines_normalised(tmp_path: Path) -> None:
    f = write(tmp_path / "crlf.txt", b"a\r\nb\rc\nd\r\n")
    assert load_document(f).text == "a\nb\nc\nd\n"


def test_python_source_file(tmp_path: Path) -> None:
    src = 'def f(x: int) -> int:\n    """Double."""\n    return x * 2\n'
    doc = load_document(write(tmp_path / "mod.py", src))
    assert doc.kind == "text" and doc.text == src


@pytest.mark.parametrize("name", ["data.json", "Cargo.toml", "main.rs", "Makefile", "README"])
def test_other_text_files(tmp_path: Path, name: str) -> None:
    doc = load_document(write(tmp_path / name, "key = 'value'\n"))
    assert doc.kind == "text" and doc.text == "key = 'value'\n"


def test_ansi_coloured_log_is_text(tmp_path: Path) -> None:
    log = "\x1b[31mERROR\x1b[0m disk almost full on /dev/sda1\n" * 50
    assert load_document(write(tmp_path / "app.log", log)).text == log


# ---------------------------------------------------------------- PDF


def test_pdf_pages_in_order(tmp_path: Path) -> None:
    f = make_pdf(tmp_path / "two.pdf", ["hello pass key 12345", "second page text"])
    doc = load_document(f)
    assert doc.kind == "pdf"
    assert doc.text == "hello pass key 12345\n\nsecond page text"
    assert doc.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()


def test_pdf_detected_by_content_without_extension(tmp_path: Path) -> None:
    f = make_pdf(tmp_path / "download", ["magic sniffing"])
    doc = load_document(f)
    assert doc.kind == "pdf" and doc.text == "magic sniffing"


def test_encrypted_pdf_with_user_password(tmp_path: Path) -> None:
    f = make_pdf(tmp_path / "secret.pdf", ["top secret"], password="hunter2")
    msg = error_of(f)
    assert "secret.pdf" in msg and "password" in msg


def test_pdf_with_empty_user_password_opens(tmp_path: Path) -> None:
    f = make_pdf(tmp_path / "owner.pdf", ["readable"], password="", owner_password="owner")
    assert load_document(f).text == "readable"


def test_corrupt_pdf(tmp_path: Path) -> None:
    f = write(tmp_path / "broken.pdf", random.Random(7).randbytes(2048))
    msg = error_of(f)
    assert "broken.pdf" in msg and "is not a PDF" in msg


def test_truncated_pdf(tmp_path: Path) -> None:
    good = make_pdf(tmp_path / "good.pdf", ["some text"]).read_bytes()
    f = write(tmp_path / "cut.pdf", good[: len(good) // 3])
    assert "cut.pdf" in error_of(f)


def test_pdf_without_text(tmp_path: Path) -> None:
    f = make_pdf(tmp_path / "scan.pdf", [None, None])
    msg = error_of(f)
    assert "scan.pdf" in msg and "no text layer (scanned images?)" in msg


def _damaged(good: bytes) -> dict[str, bytes]:
    return {"cut.pdf": good[: len(good) // 3], "no-eof.pdf": good[:-10], "no-xref.pdf": good.replace(b"xref", b"xreg"),
            "header-only.pdf": b"%PDF-1.4\n",
            "flipped.pdf": bytes(b ^ 0x55 if 200 < i < 260 else b for i, b in enumerate(good))}


def test_damaged_pdfs_say_damaged_in_one_line_and_pypdf_stays_quiet(tmp_path: Path, capfd) -> None:
    """pypdf logs "EOF marker not found" and the like; that reaches the message, not the terminal; and a damaged
    file is never called a scan."""
    good = make_pdf(tmp_path / "good.pdf", ["some text here"]).read_bytes()
    for name, data in _damaged(good).items():
        msg = error_of(write(tmp_path / name, data))
        assert name in msg and "damaged" in msg and "scanned" not in msg and "\n" not in msg, msg
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # nothing printed by pypdf, at the file-descriptor level
    assert logging.getLogger("pypdf").propagate and not logging.getLogger("pypdf").handlers  # put back


def test_a_non_pdf_named_pdf_says_so(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "page.pdf", b"<html><body>hello</body></html>"))
    assert "page.pdf is not a PDF" in msg


def test_pypdf_is_imported_lazily() -> None:
    code = "import sys, localchat.documents; assert 'pypdf' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)


# ---------------------------------------------------------------- HTML

HTML = """<!DOCTYPE html>
<html><head><title>My   Page</title>
<style>body { color: red }</style>
<script>var x = "<p>hidden</p>";</script>
</head>
<body>
<h1>Fish &amp; Chips</h1>
<p>Some    spaced
   text &lt;tag&gt; &eacute;t&#233;</p>
<div>one</div><div>two<br>three</div>
<ul><li>apple</li><li>pear</li></ul>
<pre>  keep   this
    indented</pre>
<script>alert("nope")</script>
<p>The <b>end</b>.</p>
</body></html>
"""


def test_html_text_extraction(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path / "page.html", HTML))
    assert doc.kind == "html"
    assert doc.text == (
        "My Page\n\n"
        "Fish & Chips\n"
        "Some spaced text <tag> été\n"
        "one\ntwo\nthree\n"
        "apple\npear\n"
        "  keep   this\n    indented\n"
        "The end."
    )


def test_htm_without_head_and_sniffed_html(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path / "a.htm", "<p>x</p><style>p{}</style><p>y</p>"))
    assert doc.text == "x\ny"
    doc = load_document(write(tmp_path / "saved", "<html><body><p>z</p></body></html>"))
    assert doc.kind == "html" and doc.text == "z"


def test_html_without_visible_text(tmp_path: Path) -> None:
    html = "<html><head><script>x()</script></head><body> </body></html>"
    f = write(tmp_path / "blank.html", html)
    assert "blank.html" in error_of(f)


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert error_of("nope.txt").startswith("no such file: nope.txt")  # path as typed


def test_directory(tmp_path: Path) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    msg = error_of(d)
    assert "folder is a directory" in msg and "attach a file" in msg


def test_empty_file(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "empty.txt", b""))
    assert "empty.txt" in msg and "empty" in msg and "0 bytes" in msg


def test_whitespace_only_file(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "blank.txt", " \n\t\r\n  \n"))
    assert "blank.txt" in msg and "whitespace" in msg


def test_binary_with_nul_bytes(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "data.txt", b"abc\x00\x01\x02def" * 100))
    assert "data.txt" in msg and "binary" in msg


def test_binary_control_characters_without_nul(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "blob.dat", bytes(range(1, 32)) * 100))
    assert "blob.dat" in msg and "binary" in msg


def test_png_header(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "photo.txt", b"\x89PNG\r\n\x1a\n" + b"IHDR" + b"x" * 64))
    assert "photo.txt" in msg and "binary" in msg and "PNG" in msg


def test_zip_header(tmp_path: Path) -> None:
    msg = error_of(write(tmp_path / "report.docx", b"PK\x03\x04" + b"y" * 64))
    assert "report.docx" in msg and "ZIP" in msg


def test_sparse_1gb_file_rejected_without_reading(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "huge.log"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: takes no disk space

    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the oversized file was opened for reading")

    monkeypatch.setattr(Path, "open", no_reading)
    monkeypatch.setattr(Path, "read_bytes", no_reading)
    msg = error_of(big)
    assert "huge.log is 1 GB" in msg
    assert "over the 64 MB limit" in msg and "--max-file-mb" in msg
    assert DEFAULT_MAX_BYTES == 64 * 1024 * 1024


def test_small_max_bytes(tmp_path: Path) -> None:
    f = write(tmp_path / "k.txt", "x" * 3000)
    msg = error_of(f, max_bytes=1024)
    assert "k.txt is 2.9 KB, over the 1 KB limit" in msg
    assert load_document(f, max_bytes=3000).n_bytes == 3000  # exactly at the limit is fine


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = write(tmp_path / "locked.txt", "secret")

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", denied)  # chmod is ignored when tests run as root
    msg = error_of(f)
    assert "locked.txt" in msg and "permission denied" in msg


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_fifo_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert "not a regular file" in error_of(fifo)


def _bad_files(tmp: Path) -> dict[str, Callable[[], Path]]:
    def folder() -> Path:
        (tmp / "dir_x").mkdir()
        return tmp / "dir_x"

    return {
        "missing.txt": lambda: tmp / "missing.txt",
        "dir_x": folder,
        "empty.md": lambda: write(tmp / "empty.md", b""),
        "spaces.txt": lambda: write(tmp / "spaces.txt", "   \n\n"),
        "nul.bin": lambda: write(tmp / "nul.bin", b"\x00" * 10 + b"text"),
        "img.png": lambda: write(tmp / "img.png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 20),
        "toolarge.txt": lambda: write(tmp / "toolarge.txt", "y" * 200),
        "corrupt.pdf": lambda: write(tmp / "corrupt.pdf", b"%PDF-1.7\nnot really\n"),
        "locked.pdf": lambda: make_pdf(tmp / "locked.pdf", ["x"], password="pw"),
        "blank.pdf": lambda: make_pdf(tmp / "blank.pdf", [None]),
        "line\nbreak.txt": lambda: write(tmp / "line\nbreak.txt", b""),
    }


@pytest.mark.parametrize("name", list(_bad_files(Path("/unused"))))
def test_every_error_is_one_line_and_names_the_file(tmp_path: Path, name: str) -> None:
    path = _bad_files(tmp_path)[name]()
    msg = error_of(path, max_bytes=100)
    assert name.split("\n")[-1] in msg
    assert ";" in msg  # problem; hint


# ---------------------------------------------------------------- pasted paths


@pytest.fixture
def spaced(tmp_path: Path) -> Path:
    return write(tmp_path / "my notes.txt", "hi")


def test_paste_single_and_double_quoted(spaced: Path) -> None:
    assert parse_path_input(f"'{spaced}'") == str(spaced)
    assert parse_path_input(f'"{spaced}"') == str(spaced)
    assert parse_path_input(f"  '{spaced}' \n") == str(spaced)  # terminals add a space


def test_paste_backslash_escaped(spaced: Path) -> None:
    assert parse_path_input(str(spaced).replace(" ", "\\ ")) == str(spaced)


def test_paste_file_urls(spaced: Path) -> None:
    url_path = quote(str(spaced))
    assert "%20" in url_path
    assert parse_path_input("file://" + url_path) == str(spaced)
    assert parse_path_input("file://localhost" + url_path) == str(spaced)
    assert parse_path_input("file://otherhost" + url_path) is None


def test_paste_plain_path(tmp_path: Path) -> None:
    f = write(tmp_path / "plain.txt", "x")
    assert parse_path_input(str(f)) == str(f)


def test_paste_home_relative(spaced: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(spaced.parent))
    assert parse_path_input("~/my\\ notes.txt") == str(spaced)
    assert parse_path_input("'~/my notes.txt'") == str(spaced)


@pytest.mark.parametrize("text", [
    "", "   ", "hello there", "please summarise this file", "it's broken",
    "/no/such/file.txt", "'/no such/file.txt'", "file:///no%20such/file.txt",
])
def test_paste_non_paths(text: str) -> None:
    assert parse_path_input(text) is None


def test_paste_rejects_dirs_multiple_and_bare_names(
        tmp_path: Path, spaced: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = write(tmp_path / "b.txt", "x")
    assert parse_path_input(str(tmp_path)) is None  # a directory
    assert parse_path_input(f"'{spaced}' '{other}'") is None  # two paths
    assert parse_path_input(f"look at {other}") is None  # prose around a path
    monkeypatch.chdir(tmp_path)
    assert parse_path_input("b.txt") is None  # a bare word stays prose
