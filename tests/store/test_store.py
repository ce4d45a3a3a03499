"""Saved conversations: SQLite + the compressed cache in safetensors, atomic saves, fingerprints."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny import save_tiny, tiny_llama

from localchat.cli import main
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Notice, Token
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.session import Session
from localchat.store import Store

SETTINGS = GenerationSettings(max_new_tokens=10, temperature=1.5, seed=5, ignore_eos=True)  # sampled: equal answers mean equal logits
HEADS = {}


@pytest.fixture()
def engine(tiny_tok):
    e = Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=32)
    HEADS.setdefault("h", RetainingHeads.random(e.model, seed=3))
    e.set_policy(make_policy("locret", budget=40, local=8, stabilizers=8, heads=HEADS["h"]))
    return e


def _answer(events):
    evs = list(events)
    return evs, "".join(e.text for e in evs if isinstance(e, Token)), evs[-1]


def _chat(engine, tmp_path) -> Session:
    doc = tmp_path / "notes.txt"
    doc.write_text("The pass key is 81723. " + "Grass is green and the sky is blue. " * 40)
    from localchat.documents import load_document

    s = Session(engine, system="Answer briefly.")
    _answer(s.send("What is the pass key?", [load_document(doc)], SETTINGS))
    _answer(s.send("Thanks. Anything else?", (), SETTINGS))
    return s


def test_save_and_reopen_continues_without_rereading(engine, tmp_path):
    s = _chat(engine, tmp_path)
    store = Store(tmp_path / "chats.sqlite3")
    name = store.save(s, "notes")
    reopened, notices = Store(tmp_path / "chats.sqlite3").load(name, engine)
    assert notices == []
    assert reopened.messages == s.messages and reopened.questions == s.questions
    assert reopened.attachments == s.attachments and reopened.system == "Answer briefly."
    assert all(torch.equal(a, b) for a, b in zip(reopened.cache.tensors().values(), s.cache.tensors().values()))
    evs_a, want, done_a = _answer(s.send("Last question?", (), SETTINGS))
    evs_b, got, done_b = _answer(reopened.send("Last question?", (), SETTINGS))
    assert got == want and done_b.prompt_tokens == done_a.prompt_tokens < 60
    assert not any(isinstance(e, Notice) for e in evs_b)
    info = store.list()[0]
    assert (info.name, info.turns, info.model, info.policy) == ("notes", 2, "tiny", "locret")
    assert info.kept_bytes > 0 and info.tokens == s.fed - done_a.prompt_tokens - done_a.new_tokens


def test_a_saved_cache_is_not_reused_with_other_settings(engine, tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    store.save(_chat(engine, tmp_path), "x")
    engine.set_policy(make_policy("locret", budget=48, local=8, stabilizers=8, heads=HEADS["h"]))
    reopened, notices = store.load("x", engine)
    assert len(notices) == 1 and "another model, policy" in notices[0]
    evs, _, done = _answer(reopened.send("Next?", (), SETTINGS))
    assert not any(isinstance(e, Notice) for e in evs)  # why it is read again was said once, by the load
    assert isinstance(done, Done) and done.prompt_tokens > 300  # the whole conversation, once


def test_a_cache_saved_with_other_int4_weights_is_reread(tiny_tok, tmp_path):
    """`--weights int4` on the CPU was quanto's groups of 128 before torch's packed groups of 32: other weights,
    so a cache saved with one is re-read, not reused, with the other."""
    from optimum.quanto import freeze, qint4, quantize

    from localchat.engine.quantize import quantize_after_load

    def int4_engine(packed: bool) -> Engine:
        e = Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=32)
        if packed:
            quantize_after_load(e.model, "int4", torch.device("cpu"))
        else:
            with torch.inference_mode():
                quantize(e.model, weights=qint4, exclude=["lm_head"])
                freeze(e.model)
        e.weights = "int4"
        e.set_policy(make_policy("streaming", budget=40, local=8))
        return e

    store = Store(tmp_path / "c.sqlite3")
    store.save(_chat(int4_engine(packed=False), tmp_path), "x")
    again, notices = store.load("x", int4_engine(packed=False))
    assert notices == []  # the same weights: the cache is reused
    _, notices = store.load("x", int4_engine(packed=True))
    assert len(notices) == 1 and "another model, policy" in notices[0]


def test_a_corrupt_cache_file_means_a_notice_and_a_reread(engine, tmp_path):
    store = Store(tmp_path / "c.sqlite3")
    store.save(_chat(engine, tmp_path), "x")
    (cache_file,) = (tmp_path / "caches").glob("*.safetensors")
    cache_file.write_bytes(cache_file.read_bytes()[:200])
    reopened, notices = Store(tmp_path / "c.sqlite3").load("x", engine)
    assert "damaged" in notices[0]
    _, _, done = _answer(reopened.send("Next?", (), SETTINGS))
    assert isinstance(done, Done) and reopened.turns == 3


def test_a_save_that_dies_before_the_rename_keeps_the_last_good_state(engine, tmp_path, monkeypatch):
    store = Store(tmp_path / "c.sqlite3")
    s = _chat(engine, tmp_path)
    store.save(s, "x")
    _answer(s.send("One more?", (), SETTINGS))

    def killed(*args):
        raise KeyboardInterrupt  # stands for the process dying between the write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        store.save(s, "x")
    monkeypatch.undo()
    reopened, notices = Store(tmp_path / "c.sqlite3").load("x", engine)
    assert notices == [] and reopened.turns == 2 and reopened.kv_units > 0


KILLER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from tiny import tiny_llama, tiny_tokenizer
    from localchat.engine.engine import Engine
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings
    from localchat.session import Session
    from localchat.store import Store
    tok = tiny_tokenizer()
    engine = Engine(tiny_llama(len(tok)), tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("full"))
    s = Session(engine)
    store = Store({db!r})
    for i in range(10000):
        for _ in s.send("Turn %d: " % i + "word " * 200, (), GenerationSettings(max_new_tokens=4, ignore_eos=True)):
            pass
        store.save(s, "loop")
        print(i, flush=True)
""")


def test_killing_the_process_while_it_saves_never_corrupts_the_chat(tmp_path, tiny_tok):
    db = tmp_path / "k.sqlite3"
    script = KILLER.format(tests=str(Path(__file__).parents[1]), db=str(db))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    saved = -1
    while saved < 3:  # let it save a few times, then kill it mid-flight
        saved = int(proc.stdout.readline().split()[0])
    time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    engine = Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("full"))
    reopened, notices = Store(db).load("loop", engine)
    assert reopened.turns >= saved + 1
    assert notices == []  # the cache that the database points at is whole and matches
    assert reopened.kv_units == reopened.fed
    leftovers = list((tmp_path / "caches").glob("*.safetensors"))
    assert len(leftovers) <= 2  # at most the current file and one being written


def test_schema_version_and_listing(tmp_path, engine):
    db = tmp_path / "v.sqlite3"
    store = Store(db)
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 2
    assert store.list() == []
    store.save(_chat(engine, tmp_path))
    assert [c.name for c in store.list()] == ["chat-1"]
    store.delete("chat-1")
    assert store.list() == [] and not list((tmp_path / "caches").glob("*.safetensors"))
    with pytest.raises(UserError, match="no chat named"):
        store.load("chat-1", engine)
    store.close()
    sqlite3.connect(db).execute("PRAGMA user_version = 7").connection.commit()
    with pytest.raises(UserError, match="newer localchat"):
        Store(db)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-store")))


def test_cli_session_continues_across_runs(tmp_path_factory, tmp_path, capsys):
    model = str(save_tiny(tmp_path_factory.mktemp("tiny-session")))
    doc = tmp_path / "d.txt"
    doc.write_text("The code word is pelican. " + "Filler text goes here. " * 60)
    flags = ["--model", model, "--max-new-tokens", "6", "--policy", "full"]
    assert main([*flags, "ask", "--session", "work", "--file", str(doc), "--stats", "What is the code word?"]) == 0
    first = capsys.readouterr().err
    assert main([*flags, "ask", "--session", "work", "--stats", "Say it again."]) == 0
    second = capsys.readouterr().err
    read = [int(line.split("read ")[1].split(" tokens")[0].replace(",", "")) for line in (first, second)]
    assert read[1] < 60 < 600 < read[0]  # the follow-up read only its own tokens
    assert main(["sessions"]) == 0
    listing = capsys.readouterr().out
    assert "work" in listing and "What is the code word?" in listing
    assert main(["sessions", "--delete", "work"]) == 0 and main(["sessions", "--delete", "work"]) == 2


def test_a_cache_saved_with_another_kv_format_is_reread_not_misread(engine, tmp_path):
    store = Store(tmp_path / "q.sqlite3")
    store.save(_chat(engine, tmp_path), "x")
    engine.kv = "int8"  # the same model and policy, but the retained cache is now stored quantized
    reopened, notices = store.load("x", engine)
    assert len(notices) == 1 and "another model, policy" in notices[0]
    evs, _, done = _answer(reopened.send("Next?", (), SETTINGS))
    assert isinstance(done, Done) and done.prompt_tokens > 300  # read again whole, not misread


def test_a_version_1_database_is_migrated_and_its_chats_still_open(engine, tmp_path):
    from localchat.store import MIGRATIONS

    db = tmp_path / "old.sqlite3"
    old = sqlite3.connect(db)
    old.executescript(MIGRATIONS[1] + "PRAGMA user_version = 1;")
    old.execute("INSERT INTO chats (name, title, model, policy, system, created, updated) "
                "VALUES ('kept', 'Hello?', 'tiny', 'locret', NULL, 1.0, 2.0)")
    old.execute("INSERT INTO messages VALUES (1, 0, 'user', 'Hello?', 'Hello?'), (1, 1, 'assistant', 'Hi.', NULL)")
    old.commit()
    old.close()
    store = Store(db)
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 2
    assert store.settings("kept") == {}  # saved before settings were kept
    reopened, notices = store.load("kept", engine)
    assert reopened.questions == ["Hello?"] and "no cache was saved" in notices[0]
    _, _, done = _answer(reopened.send("Again?", (), SETTINGS))
    assert isinstance(done, Done)
    store.save(reopened)
    saved = store.settings("kept")
    assert (saved["policy"], saved["budget"], saved["chunk"], saved["kv"]) == ("locret", 40, 32, "none")


def test_hostile_or_damaged_rows_never_touch_files_outside_the_caches_and_never_break_the_list(engine, tmp_path,
                                                                                               monkeypatch, capsys):
    """A row's cache_file of `../victim` or an absolute path is neither read nor deleted; a row whose settings are
    not JSON stays listed; the database is readable by its owner only."""
    store = Store(tmp_path / "chats.sqlite3")
    assert os.stat(store.path).st_mode & 0o077 == 0  # 0600: chats hold whole documents
    victims = [tmp_path / "victim.safetensors", tmp_path / "elsewhere" / "abs.safetensors"]
    victims[1].parent.mkdir()
    for v in victims:
        v.write_text("keep me")
    for name, cache_file in (("a", "../victim.safetensors"), ("b", str(victims[1]))):
        session = Session(engine, name=name)
        _answer(session.send("hello", settings=SETTINGS))
        store.save(session)
        store.db.execute("UPDATE chats SET cache_file = ?, settings = 'not json' WHERE name = ?", (cache_file, name))
        reopened, notices = store.load(name, engine)  # the file is not read: the conversation is re-read instead
        assert any("not one localchat writes" in n for n in notices)
        store.delete(name)
    assert all(v.read_text() == "keep me" for v in victims)
    session = Session(engine, name="c")
    _answer(session.send("hello", settings=SETTINGS))
    store.save(session)
    store.db.execute("UPDATE chats SET settings = '{broken' WHERE name = 'c'")
    assert store.settings("c") == {}
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    assert main(["sessions"]) == 0 and "c " in capsys.readouterr().out


def test_two_processes_answering_in_one_chat_lose_no_turn(engine, tmp_path):
    """Both open chat S and answer; the first save lands, the second is refused in one line instead of writing over
    it (the lost-turn bug), and a re-opened chat holds the first one's turn."""
    path = tmp_path / "chats.sqlite3"
    first = Session(engine, name="s")
    _answer(first.send("hello", settings=SETTINGS))
    Store(path).save(first)
    a, _ = Store(path).load("s", engine)
    b, _ = Store(path).load("s", engine)
    _answer(a.send("from process a", settings=SETTINGS))
    _answer(b.send("from process b", settings=SETTINGS))
    Store(path).save(a)
    with pytest.raises(UserError, match="changed in another process") as err:
        Store(path).save(b)
    assert "\n" not in str(err.value)
    saved, _ = Store(path).load("s", engine)
    assert saved.questions == ["hello", "from process a"]
    Store(path).save(a)  # the process that saved keeps saving its later turns
    fresh = Session(engine, name="s")  # a new chat under a taken name does not replace the saved one either
    _answer(fresh.send("unrelated", settings=SETTINGS))
    with pytest.raises(UserError, match="changed in another process"):
        Store(path).save(fresh)


def test_flipped_bytes_in_a_saved_cache_mean_a_notice_and_a_reread(engine, tmp_path):
    """A cache file whose header is intact but whose tensor bytes were damaged is not reused (it read as a wrong cache
    before: garbage answers, saved into the chat)."""
    store = Store(tmp_path / "c.sqlite3")
    store.save(_chat(engine, tmp_path), "x")
    (cache_file,) = (tmp_path / "caches").glob("*.safetensors")
    data = bytearray(cache_file.read_bytes())
    for i in range(len(data) - 400, len(data) - 300):  # inside the last tensors' bytes, past the header
        data[i] ^= 0xFF
    cache_file.write_bytes(bytes(data))
    reopened, notices = Store(tmp_path / "c.sqlite3").load("x", engine)
    assert len(notices) == 1 and "checksum" in notices[0]
    _, _, done = _answer(reopened.send("Next?", (), SETTINGS))
    assert isinstance(done, Done) and reopened.turns == 3


def test_a_locked_database_is_reported_before_the_model_answers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    monkeypatch.setattr("localchat.store.LOCK_WAIT", 0.2)
    holder = Store(tmp_path / "chats.sqlite3")
    holder.db.execute("BEGIN IMMEDIATE")  # another process in the middle of a save that never ends
    answered = []
    monkeypatch.setattr("localchat.args.load_engine", lambda args: answered.append(1))
    assert main(["ask", "--session", "s", "q"]) == 2
    err = capsys.readouterr().err
    assert "cannot save chats" in err and "locked" in err and err.count("\n") == 1
    assert answered == []  # refused before the model was even loaded
    holder.db.execute("ROLLBACK")


def test_a_new_data_directory_is_private(tmp_path, monkeypatch):
    from localchat import paths

    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path / "new" / "data"))
    directory = paths.data_dir()
    assert directory.is_dir() and directory.stat().st_mode & 0o777 == 0o700
    (tmp_path / "mine").mkdir(mode=0o755)
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path / "mine"))  # one the user made keeps its mode
    assert paths.data_dir().stat().st_mode & 0o777 == 0o755


def test_the_rooms_are_private_and_a_wider_data_directory_is_named_once(tiny_dir, tmp_path, monkeypatch, capsys):
    from localchat.cli import main

    data = tmp_path / "wide"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(data))
    assert main(["--model", tiny_dir, "--max-new-tokens", "2", "ask", "--session", "s", "q"]) == 0
    err = capsys.readouterr().err
    assert err.count("is open to other users (mode 755)") == 1 and "chmod 700" in err
    assert data.stat().st_mode & 0o777 == 0o755  # named, not changed behind the user's back
    for room in ("caches", "caches/partial", "locks"):
        assert (data / room).stat().st_mode & 0o777 == 0o700, room
    for f in [data / "chats.sqlite3", *(data / "caches").glob("*.safetensors"), *(data / "locks").iterdir()]:
        assert f.stat().st_mode & 0o777 == 0o600, f
    data.chmod(0o700)
    assert main(["sessions"]) == 0 and "open to other users" not in capsys.readouterr().err


def test_a_database_another_process_just_created_is_not_created_again(tmp_path, monkeypatch):
    """Two processes open one new database at once: the second read the version (0) before the first created the
    tables. It must read it again under the write lock and find the tables, not create them again (before:
    "table chats already exists", refused as a damaged database; seen with two concurrent `ask --session`)."""
    from localchat import store as store_mod

    path = tmp_path / "chats.sqlite3"
    store_mod.Store(path).close()  # the first process created it
    real, calls = store_mod.Store._version, []

    def stale_first(self):
        calls.append(1)
        return 0 if len(calls) == 1 else real(self)  # the version as it was read before the other's commit

    monkeypatch.setattr(store_mod.Store, "_version", stale_first)
    store = store_mod.Store(path)
    assert len(calls) == 2 and store.db.execute("PRAGMA user_version").fetchone()[0] == store_mod.SCHEMA
    store.close()


def test_follow_ups_without_flags_keep_the_chats_settings_and_read_only_new_tokens(tmp_path_factory, tmp_path, capsys,
                                                                                   monkeypatch):
    """Two turns with non-default flags, then two plain follow-ups: each reads only its own tokens and keeps the
    first turn's model, policy, budget and chunk, even with LOCALCHAT_BUDGET set. A flag that changes what the
    cache means says so in one line and reads the conversation once."""
    model = str(save_tiny(tmp_path_factory.mktemp("tiny-settings")))
    capsys.readouterr()
    doc = tmp_path / "d.txt"
    doc.write_text("The code word is pelican. " + "Filler text goes here. " * 60)
    flags = ["--model", model, "--policy", "streaming", "--budget", "128", "--chunk", "64"]

    def turn(argv, *question):
        assert main([*argv, "--max-new-tokens", "6", "ask", "--session", "s", "--stats", *question]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        return int(err[-1].split("read ")[1].split(" tokens")[0].replace(",", "")), err[:-1]

    read, said = turn(flags, "--file", str(doc), "What is the code word?")
    assert read > 600 and said == []
    read, said = turn(flags, "Say it again.")
    assert read < 60 and said == []
    monkeypatch.setenv("LOCALCHAT_BUDGET", "4096")  # the environment sits below a chat's own settings
    for question in ("And now?", "Last one?"):
        read, said = turn([], question)
        assert read < 60 and said == []  # no re-read, no notice
    assert main(["sessions", "--show", "s"]) == 0
    shown = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert (shown["model"], shown["policy"], shown["budget"], shown["chunk"]) == (model, "streaming", "128", "64")
    read, said = turn(["--budget", "256"], "Bigger?")
    assert read > 600 and said == ["localchat: chat 's' continues with budget 128 -> 256: its saved cache was made "
                                   "with the earlier settings, so the conversation is read again once"]
    read, said = turn([], "Kept?")
    assert read < 60 and said == []  # the new budget is the chat's now


# --- a save that hits a limit keeps the turn ------------------------------------------------------------------


def _ask_limited(model: str, data: Path, limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    """`localchat ask --session t ...` in a process whose files cannot grow past `limit_bytes` (ulimit -f)."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(data), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "localchat", "--model", model, "--max-new-tokens", "3", "--policy",
                           "full", "ask", "--session", "t", *args], capture_output=True, text=True, env=env,
                          preexec_fn=limit, timeout=300, check=False)


def _saved_questions(data: Path, chat: str = "t") -> list[str]:
    db = sqlite3.connect(data / "chats.sqlite3")
    try:
        return [q for (q,) in db.execute("SELECT m.question FROM messages m JOIN chats c ON c.id = m.chat_id "
                                         "WHERE c.name = ? AND m.role = 'user' ORDER BY m.idx", (chat,))]
    finally:
        db.close()


def test_a_save_past_the_file_size_limit_keeps_the_turn(tiny_dir, tmp_path, monkeypatch, capsys):
    """The database cannot grow: the turn goes to the journal (exit 2, one line naming the file) and the next run
    puts it back. The cache file cannot be written: the chat is saved without it (exit 2, one line), and the next
    question reads the conversation again and saves a cache as before."""
    data = tmp_path / "data"
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(data))
    flags = ["--model", tiny_dir, "--max-new-tokens", "3", "--policy", "full"]
    assert main([*flags, "ask", "--session", "t", "first"]) == 0
    capsys.readouterr()

    run = _ask_limited(tiny_dir, data, 8192, "second")  # the database is larger than that already
    kept = sorted((data / "journal").glob("*.json"))
    assert run.returncode == 2 and len(kept) == 1, run.stderr
    assert run.stderr.count("\n") == 1 and f"this turn is kept in {kept[0]}" in run.stderr and run.stdout  # the answer was shown
    assert _saved_questions(data) == ["first"]
    assert main(["sessions"]) == 0  # the next run puts it back
    err = capsys.readouterr().err
    assert "a turn of chat 't' that a failed save kept aside is saved now" in err
    assert _saved_questions(data) == ["first", "second"] and not list((data / "journal").glob("*.json"))

    doc = tmp_path / "doc.txt"
    doc.write_text("The code word is pelican. " + "Filler words go here. " * 300)
    limit = (data / "chats.sqlite3").stat().st_size + 64 * 1024  # the database may grow, the cache (MBs) may not
    run = _ask_limited(tiny_dir, data, limit, "--file", str(doc), "third")
    assert run.returncode == 2 and run.stderr.count("localchat: error: ") == 1, run.stderr
    assert run.stderr.count("\n") == 2 and "no cache was saved with it" in run.stderr  # the put-back turn: read again
    assert "is saved, but not its compressed cache (File too large)" in run.stderr
    assert _saved_questions(data) == ["first", "second", "third"]
    assert not list((data / "caches").rglob("*.safetensors")) and not list((data / "caches" / "partial").iterdir())

    assert main([*flags, "ask", "--session", "t", "--stats", "fourth"]) == 0
    err = capsys.readouterr().err
    assert "no cache was saved with it" in err and err.count("\n") == 2  # that notice, and the stats line
    assert _saved_questions(data) == ["first", "second", "third", "fourth"]
    assert len(list((data / "caches").glob("*.safetensors"))) == 1


def test_a_kept_turn_whose_chat_changed_since_is_saved_as_a_chat_of_its_own(tiny_dir, tmp_path, monkeypatch,
                                                                              capsys):
    data = tmp_path / "data"
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(data))
    assert main(["--model", tiny_dir, "--max-new-tokens", "3", "--policy", "full", "ask", "--session", "t",
                 "first"]) == 0
    assert _ask_limited(tiny_dir, data, 8192, "second").returncode == 2
    db = sqlite3.connect(data / "chats.sqlite3")
    db.execute("UPDATE chats SET updated = updated + 1")  # as if another save came first
    db.commit()
    db.close()
    capsys.readouterr()
    assert main(["sessions"]) == 0
    out, err = capsys.readouterr()
    assert "is saved now, as chat 't (kept)' (the chat changed since)" in err and "t (kept)" in out
    assert _saved_questions(data) == ["first"] and _saved_questions(data, "t (kept)") == ["second"]


def test_a_chat_read_past_the_window_at_compact_positions_reopens_without_a_re_read(tiny_tok, tmp_path):
    """An evicting policy at original positions reads a document longer than the window at compact positions; the
    saved cache says so and is reused as it is after a restart."""
    engine = Engine(tiny_llama(len(tiny_tok), window=512), tiny_tok, name="tiny", chunk=64)
    engine.set_policy(make_policy("streaming", budget=128, local=16), "original")
    chat = Session(engine)
    _answer(chat.send("lorem ipsum " * 300 + "What?", (), SETTINGS))
    assert chat.cache.positions == "compact" and engine.positions == "original"
    name = Store(tmp_path / "c.sqlite3").save(chat, "long")
    reopened, notices = Store(tmp_path / "c.sqlite3").load(name, engine)
    assert notices == [] and reopened.cache.positions == "compact"
    _, want, done_a = _answer(chat.send("And?", (), SETTINGS))
    _, got, done_b = _answer(reopened.send("And?", (), SETTINGS))
    assert got == want and done_b.prompt_tokens == done_a.prompt_tokens < 40
