"""A writer killed (SIGKILL) at random points of a save: the database stays readable, the chat holds the turns before
that save or after it (never half a turn), the cache it points at is whole, and every file the kill left behind is
collected once it is old enough (and never while it is young: it may be another process's save in progress).

A driver process loads torch and the tiny model once, then forks one writer per trial. Each writer opens the chat,
answers one turn and saves it, printing a marker before each step of the save (and pausing a moment there); the
test kills it a random time after a randomly chosen marker."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tiny import tiny_llama

from localchat.engine.engine import Engine
from localchat.engine.policies import make_policy
from localchat.store import ORPHAN_GRACE, Store

DRIVER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from tiny import tiny_llama, tiny_tokenizer
    from localchat.engine.engine import Engine
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings
    import localchat.store as st
    from localchat.session import Session

    PAUSE = 0.02
    def mark(step):
        print("mark", step, flush=True)
        time.sleep(PAUSE)

    class Traced:  # the SQLite connection, marking each statement of the save
        def __init__(self, db):
            self.db = db
        def execute(self, sql, *args):
            mark("sql:" + sql.split()[0])
            return self.db.execute(sql, *args)
        def executemany(self, sql, rows):
            mark("many:" + sql.split()[2])
            return self.db.executemany(sql, rows)

    files = st.cache_files
    real_save_file, real_replace, real_remove = files.save_file, os.replace, files.CacheFiles.remove
    def save_file(*args, **kw):
        mark("write")
        real_save_file(*args, **kw)
        mark("written")
    def replace(*args):
        real_replace(*args)
        mark("renamed")
    def remove(self, name):
        mark("remove-old")
        real_remove(self, name)
    files.save_file, os.replace, files.CacheFiles.remove = save_file, replace, remove

    tok = tiny_tokenizer()
    engine = Engine(tiny_llama(len(tok)), tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("full"))
    for trial, line in enumerate(sys.stdin):
        pid = os.fork()
        if pid == 0:
            store = st.Store({db!r})
            if store.exists("loop"):
                session, _ = store.load("loop", engine)
            else:
                session = Session(engine, name="loop")
            for _ in session.send("turn %d: " % trial + "word " * 30, (),
                                  GenerationSettings(max_new_tokens=3, ignore_eos=True)):
                pass
            store.db = Traced(store.db)
            print("saving", os.getpid(), flush=True)
            store.save(session)
            print("mark saved", flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")


def _run(trials: int, seed: int, tmp_path: Path, tiny_tok) -> None:
    db = tmp_path / "k.sqlite3"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER.format(tests=str(Path(__file__).parents[1]), db=str(db))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    engine = Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("full"))
    rng = random.Random(seed)
    turns, seen, before = 0, set(), []
    try:
        for trial in range(trials):
            target, delay = rng.randrange(14), rng.choice([0.0, rng.uniform(0, 0.04)])
            where = f"seed {seed}, trial {trial}, kill after marker {target} + {delay * 1000:.0f} ms"
            driver.stdin.write("go\n")
            driver.stdin.flush()
            line = driver.stdout.readline()
            assert line.startswith("saving"), (where, line)
            writer, marks, killed = int(line.split()[1]), [], None
            # a writer killed inside a print leaves half a line, which the driver's "reaped" then ends
            while (line := driver.stdout.readline()).startswith("mark") and not line.rstrip().endswith("reaped"):
                marks.append(line.split()[1])
                if len(marks) - 1 == target and marks[-1] != "saved":
                    time.sleep(delay)
                    try:
                        os.kill(writer, signal.SIGKILL)
                        killed = marks[-1]
                    except ProcessLookupError:  # the save ended (and was reaped) within the delay: no kill
                        pass
            while not line.rstrip().endswith("reaped"):
                assert line, where
                line = driver.stdout.readline()
            seen.add(killed)
            where += f" (last marker {marks[-1]}, killed after {killed})"
            store = Store(db)
            assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok", where
            if not store.exists("loop"):
                assert turns == 0, where
                continue
            session, notices = store.load("loop", engine)
            # a marker is printed just before its step (written/renamed: just after); every marker printed happened
            committed = "saved" in marks or ("sql:COMMIT" in marks and marks[-1] != "sql:COMMIT")
            not_yet = "sql:COMMIT" not in marks
            assert session.turns in ((turns + 1,) if committed else (turns,) if not_yet else (turns, turns + 1)), where
            assert [m["role"] for m in session.messages] == ["user", "assistant"] * session.turns, where
            labels = [q.split(":")[0] for q in session.questions]
            assert labels in (before, [*before, f"turn {trial}"]), where  # the turns saved before, plus this one or not
            before = labels
            assert notices == [] and session.kv_units == session.fed, where  # the file it points at is whole
            turns = session.turns
            referenced = store.db.execute("SELECT cache_file FROM chats").fetchone()[0]
            files = _tree(tmp_path / "caches")  # a kill inside the write leaves files in caches/partial/
            assert referenced in files, where
            assert store.collect_orphans() == 0 or len(files) == 1, where  # young leftovers stay (grace period)
            store.collect_orphans(grace=0)  # as a later save will once they are old
            assert _tree(tmp_path / "caches") == {referenced}, where
            store.close()
    finally:
        driver.stdin.close()
        driver.kill()
        driver.wait()
    assert turns >= 1 and len(seen) >= min(trials // 2, 5), f"seed {seed}: too few kinds of kill points {seen}"


def test_killing_a_save_at_random_points_keeps_the_chat_whole(tmp_path, tiny_tok):
    seed = int(os.environ.get("LOCALCHAT_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (LOCALCHAT_TEST_SEED={seed} repeats this run)")
    _run(16, seed, tmp_path, tiny_tok)


@pytest.mark.slow
def test_killing_a_save_at_many_random_points(tmp_path, tiny_tok):
    seed = int(os.environ.get("LOCALCHAT_TEST_SEED", random.randrange(1 << 30)))
    print(f"seed {seed} (LOCALCHAT_TEST_SEED={seed} repeats this run)")
    _run(120, seed, tmp_path, tiny_tok)


def _orphans(caches: Path, outside: Path) -> dict[str, str]:
    """Files a killed save can leave, and files that are not ours, in `caches`; all but the young ones old."""
    old = time.time() - ORPHAN_GRACE - 10
    names = {"orphan": "0123456789ab-0123456789ab-1.safetensors", "tmp": "0123456789ab-0123456789ab-2.tmp",
             "young": "0123456789ab-0123456789ab-3.safetensors", "user": "notes.safetensors",
             "link": "0123456789ab-0123456789ab-4.safetensors", "dir": "0123456789ab-0123456789ab-5.safetensors",
             # safetensors writes through a temporary file of its own (".tmp" + 6 characters) beside its target:
             # in caches/ before caches/partial/ existed, in caches/partial/ now
             "legacy": ".tmpKlJOjc", "user tmp": ".tmpnotes.txt", "partial": "partial/0123456789ab-0123456789ab-6.tmp",
             "partial st": "partial/.tmpAbCd12", "partial young": "partial/.tmpYoung1", "partial dir": "partial/sub"}
    outside.write_text("not ours")
    (caches / "partial").mkdir(exist_ok=True)
    for key, name in names.items():
        path = caches / name
        if key == "link":
            path.symlink_to(outside)
        elif key.endswith("dir"):
            path.mkdir()
        else:
            path.write_text(key)
        if "young" not in key:
            os.utime(path, (old, old), follow_symlinks=False)
    return names


KEPT = ("young", "user", "link", "dir", "user tmp", "partial young", "partial dir")


def _tree(caches: Path) -> set[str]:
    return {str(p.relative_to(caches)) for p in caches.rglob("*")} - {"partial"}


def test_sessions_collects_old_orphans_only_plain_and_ours(tmp_path, monkeypatch, capsys):
    from localchat.cli import main

    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    Store().close()
    names = _orphans(tmp_path / "caches", tmp_path / "outside.safetensors")
    assert main(["sessions"]) == 2  # a link in caches/: refused in one line, nothing collected
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and names["link"] in err and err.count("\n") == 1
    assert _tree(tmp_path / "caches") == set(names.values()) - {"partial"}
    (tmp_path / "caches" / names["link"]).unlink()
    assert main(["sessions"]) == 0
    assert _tree(tmp_path / "caches") == {names[k] for k in KEPT if k != "link"}
    assert (tmp_path / "outside.safetensors").read_text() == "not ours"


def test_a_save_collects_old_orphans_and_keeps_its_own_file(tmp_path, tiny_engine):
    from localchat.engine.sampling import GenerationSettings
    from localchat.session import Session

    store = Store(tmp_path / "c.sqlite3")
    names = _orphans(tmp_path / "caches", tmp_path / "outside.safetensors")
    session = Session(tiny_engine, name="s")
    for _ in session.send("hello", (), GenerationSettings(max_new_tokens=2)):
        pass
    store.save(session)
    mine = store.db.execute("SELECT cache_file FROM chats").fetchone()[0]
    assert _tree(tmp_path / "caches") == {mine, *(names[k] for k in KEPT)}


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from tiny import tiny_llama, tiny_tokenizer
    from localchat.engine.engine import Engine
    from localchat.engine.sampling import GenerationSettings
    from localchat.session import Session
    from localchat.store import Store

    tok = tiny_tokenizer()
    session = Session(Engine(tiny_llama(len(tok)), tok, name="tiny", chunk=32), name="big")
    for _ in session.send("hello", (), GenerationSettings(max_new_tokens=2)):
        pass
    big = torch.ones(96 << 20, dtype=torch.uint8)  # 96 MiB: a write slow enough to be caught inside
    session.cache.tensors = lambda: {{"big": big}}
    print("saving", flush=True)
    Store({db!r}).save(session)
""")


def test_a_kill_inside_the_cache_write_leaves_only_files_a_later_save_collects(tmp_path):
    """safetensors writes through a temporary file of its own, beside its target and under its own name
    (".tmp" and 6 characters): a save killed inside that write used to leave a file no collection would remove."""
    db = tmp_path / "k.sqlite3"
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=str(Path(__file__).parents[1]), db=str(db))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert writer.stdout.readline().startswith("saving")
        partial, seen, t0 = tmp_path / "caches" / "partial", [], time.monotonic()
        while not seen and writer.poll() is None and time.monotonic() - t0 < 60:
            seen = [p.name for p in partial.iterdir()] if partial.is_dir() else []  # safetensors' file, or ours
        writer.kill()
    finally:
        writer.wait()
    assert seen, "the write ended before it could be killed inside"
    store = Store(db)
    assert not store.exists("big")
    assert _tree(tmp_path / "caches")  # the kill left the partial write behind
    assert store.collect_orphans() == 0  # young: it may be another process's write in progress
    assert store.collect_orphans(grace=0) >= 1 and _tree(tmp_path / "caches") == set()
