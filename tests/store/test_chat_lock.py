"""One writer per saved chat (localchat/store/chat_lock.py): concurrent `ask --session S` processes keep every turn, in the
order they got the chat's lock; the chat window's hold on a chat is refused at once; a wait that runs out is one
line; `sessions --delete` does not delete a chat in use."""

from __future__ import annotations

import contextlib
import io
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import save_tiny

from localchat.cli import main
from localchat.errors import UserError
from localchat.store.chat_lock import WAIT_ENV, WINDOW, ChatLock, wait_limit

FLAGS = ["--policy", "full", "--max-new-tokens", "3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-lock")))


def test_the_lock_is_exclusive_says_who_holds_it_and_is_free_after_release(tmp_path):
    a, b = ChatLock("s", tmp_path), ChatLock("s", tmp_path, WINDOW)
    assert a.try_acquire() and not b.try_acquire()
    assert a.holder() == ("ask", str(os.getpid()))
    assert ChatLock("other", tmp_path).try_acquire()  # another chat is another lock
    a.release()
    assert a.holder() == ("", "") and b.try_acquire() and b.holder()[0] == WINDOW
    said = []
    with pytest.raises(UserError, match="open in the chat window") as err:  # no waiting for a window
        a.acquire(30, said.append)
    assert said == [] and "\n" not in str(err.value)
    b.release()


def test_a_wait_that_runs_out_is_one_line_and_said_once(tmp_path):
    holder = ChatLock("s", tmp_path)
    assert holder.try_acquire()
    said = []
    t0 = time.monotonic()
    with pytest.raises(UserError, match="after waiting 0.3 s, so this question was not asked") as err:
        ChatLock("s", tmp_path).acquire(0.3, said.append)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert len(said) == 1 and "waiting for another localchat using chat 's'" in said[0]
    assert "\n" not in str(err.value) and WAIT_ENV in str(err.value)
    holder.release()


def test_a_waiter_gets_the_lock_when_the_holder_lets_go(tmp_path):
    holder = ChatLock("s", tmp_path)
    assert holder.try_acquire()
    threading.Timer(0.3, holder.release).start()
    waiter = ChatLock("s", tmp_path)
    waiter.acquire(20, lambda line: None)
    assert waiter.held and waiter.holder()[0] == "ask"
    waiter.release()


@pytest.mark.parametrize("raw, ok", [("", 600.0), ("2.5", 2.5), ("0", 0.0), ("nan", None), ("-1", None),
                                     ("inf", None), ("1e9", None), ("soon", None), ("\udcff", None)])
def test_the_wait_limit_from_the_environment(raw, ok):
    if ok is not None:
        assert wait_limit({WAIT_ENV: raw}) == ok
    else:
        with pytest.raises(UserError, match=WAIT_ENV):
            wait_limit({WAIT_ENV: raw})


def test_ask_on_a_chat_the_window_holds_is_refused_before_the_model_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    window = ChatLock("s", tmp_path / "locks", WINDOW)
    assert window.try_acquire()
    loaded = []
    monkeypatch.setattr("localchat.args.load_engine", lambda args: loaded.append(1))
    assert main(["--model", tiny_dir, *FLAGS, "ask", "--session", "s", "q"]) == 2
    err = capsys.readouterr().err
    assert "open in the chat window of another localchat" in err and err.count("\n") == 1 and loaded == []
    assert main(["sessions", "--delete", "s"]) == 2  # nor deleted under it
    assert "open in the chat window" in capsys.readouterr().err
    window.release()


def test_a_bad_wait_limit_is_one_line_before_anything_loads(tiny_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv(WAIT_ENV, "forever")
    assert main(["--model", tiny_dir, *FLAGS, "ask", "--session", "s", "q"]) == 2
    err = capsys.readouterr().err
    assert WAIT_ENV in err and err.count("\n") == 1


def test_in_process_asks_release_the_lock_even_when_they_fail(tiny_dir, tmp_path, monkeypatch, capsys):
    """A failed `ask --session` (here: a bad --model) leaves the chat free for the next one in the same process."""
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    assert main(["--model", str(tmp_path / "missing"), *FLAGS, "ask", "--session", "s", "q"]) == 2
    assert ChatLock("s", tmp_path / "locks").try_acquire()


# --- real concurrent processes --------------------------------------------------------------------------------


def _writers(n: int, model: str, data: Path, hold: float = 300.0) -> list[dict]:
    """Start `n` `ask --session S` processes at once; each one's question, first-stdout time, stderr, exit code.
    The chat's lock is held (as another `ask` would) until every writer has said that it waits (at most `hold`
    seconds), so the writers meet at the lock however slowly a loaded machine starts them (a fixed 6 s hold
    missed them once, with two benchmark lanes on the same two cores)."""
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(data), "OMP_NUM_THREADS": "1"}
    data.mkdir(mode=0o700, exist_ok=True)
    (data / "locks").mkdir(mode=0o700, exist_ok=True)
    first = ChatLock("S", data / "locks")
    assert first.try_acquire()
    runs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "localchat", "--model", model, *FLAGS, "ask", "--session", "S", "--stats",
               f"question {i} from writer {i}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        runs.append({"question": f"question {i} from writer {i}", "proc": proc, "waits": threading.Event()})

    def read(run):
        first = run["proc"].stdout.read(1)  # the answer streams while this process holds the chat's lock
        run["first"] = time.monotonic()
        run["out"] = first + run["proc"].stdout.read()

    def errs(run):
        lines = []
        for line in run["proc"].stderr:
            lines.append(line.decode())
            if "waiting for another localchat" in lines[-1]:
                run["waits"].set()
        run["waits"].set()  # ended without waiting: do not hold the others up
        run["err"] = "".join(lines)

    def let_go():
        for run in runs:
            run["waits"].wait(timeout=hold)
        first.release()

    threads = [threading.Thread(target=f, args=(r,)) for r in runs for f in (read, errs)]
    threads.append(threading.Thread(target=let_go))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for run in runs:
        run["code"] = run["proc"].wait(timeout=60)
    return runs


def _saved(data: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(data / "chats.sqlite3")
    return db.execute("SELECT role, content FROM messages m JOIN chats c ON c.id = m.chat_id WHERE c.name = 'S' "
                      "ORDER BY idx").fetchall()


def _read_tokens(stderr: str) -> int:
    return int(stderr.split(" read ")[1].split(" tokens")[0].replace(",", ""))


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_concurrent_writers_keep_every_turn_in_order(n, tiny_dir, tmp_path, monkeypatch, capsys):
    runs = _writers(n, tiny_dir, tmp_path / "data")
    report = "\n".join(f"{r['question']}: exit {r['code']}, stderr {r['err']!r}" for r in runs)
    assert all(r["code"] == 0 for r in runs), report
    order = sorted(runs, key=lambda r: r["first"])
    saved = _saved(tmp_path / "data")
    questions = [content for role, content in saved if role == "user"]
    assert sorted(questions) == sorted(r["question"] for r in runs), report  # every turn, exactly once
    assert questions == [r["question"] for r in order], report  # in the order they answered
    assert [role for role, _ in saved] == ["user", "assistant"] * n
    waited = 0
    for r in runs:
        lines = r["err"].splitlines()
        waits = [line for line in lines if "waiting for another localchat using chat 'S'" in line]
        assert len(waits) <= 1 and len(lines) == 1 + len(waits), report  # the stats line, and the wait said once
        assert "not reused" not in r["err"] and "Traceback" not in r["err"]
        waited += len(waits)
    assert waited == n  # they did meet: each waited for the lock the test held, then for the writers before it
    # The same questions one after another in one process: the same chat, and each writer read only its own
    # turn's tokens (it continued from the saved cache of the one before, not from a re-read).
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path / "replay"))
    for r in order:
        assert main(["--model", tiny_dir, *FLAGS, "ask", "--session", "S", "--stats", r["question"]]) == 0
        assert _read_tokens(capsys.readouterr().err) == _read_tokens(r["err"]), report
    assert _saved(tmp_path / "replay") == saved


# --- the chat window ------------------------------------------------------------------------------------------


def test_the_window_holds_the_chat_it_shows(tiny_engine, tiny_dir, tmp_path, monkeypatch):
    """The window holds the lock of the chat it shows (saved or opened): an `ask` on it is refused in one line, so
    neither side's turn is lost; /new lets it go; the window does not open a chat an `ask` is answering in."""
    from tui_helpers import errors, make_app, run, settle, type_text, wait_for

    from localchat.tui.widgets.chat_list import ChatList

    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path))
    shown = {}

    async def scenario(app, pilot):
        await type_text(pilot, "hello")
        await settle(pilot)
        name = shown["name"] = app.chat_name
        lock = ChatLock(name, tmp_path / "locks")
        assert name and not lock.try_acquire() and lock.holder()[0] == WINDOW
        err = io.StringIO()
        with contextlib.redirect_stderr(err):  # (the window holds sys.stderr: capsys sees nothing here)
            assert main(["--model", tiny_dir, *FLAGS, "ask", "--session", name, "q"]) == 2
        assert "open in the chat window" in err.getvalue() and err.getvalue().count("\n") == 1
        await type_text(pilot, "/new")
        await settle(pilot)
        assert lock.try_acquire()  # /new let it go; now an `ask` holds it
        chat_list = app.screen.query_one(ChatList)
        await wait_for(pilot, lambda: chat_list.option_count == 1)
        chat_list.highlighted = 0
        chat_list.action_select()
        await settle(pilot)
        assert app.chat_name is None and "in use by another localchat" in errors(app)[-1]
        lock.release()
        chat_list.action_select()
        await settle(pilot)
        assert app.chat_name == name and app.session.turns == 1 and not lock.try_acquire()

    run(scenario, make_app(tiny_engine, store_path=tmp_path / "chats.sqlite3"))
    assert ChatLock(shown["name"], tmp_path / "locks").try_acquire()  # the closed window let it go


@pytest.mark.slow
def test_soak_eight_writers_twenty_turns_each(tiny_dir, tmp_path):
    """Eight writers, each asking 20 questions one after another on chat S (160 processes, eight at a time):
    every turn saved exactly once, each writer's turns in its own order, every exit 0, and nothing written
    outside the data directory."""
    data, turns, writers = tmp_path / "data", 20, 8
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(data), "OMP_NUM_THREADS": "1"}
    codes: list[tuple[str, int, str]] = []

    def writer(w: int) -> None:
        for t in range(turns):
            question = f"writer {w} turn {t}"
            out = subprocess.run([sys.executable, "-m", "localchat", "--model", tiny_dir, *FLAGS, "ask", "--session",
                                  "S", question], capture_output=True, text=True, env=env, timeout=900, check=False)
            codes.append((question, out.returncode, out.stderr))

    before = sorted(p.name for p in tmp_path.iterdir())
    threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [c for c in codes if c[1] != 0 or "Traceback" in c[2]]
    assert not bad, bad[:3]
    questions = [content for role, content in _saved(data) if role == "user"]
    assert sorted(questions) == sorted(q for q, _, _ in codes) and len(questions) == writers * turns
    for w in range(writers):
        mine = [q for q in questions if q.startswith(f"writer {w} ")]
        assert mine == [f"writer {w} turn {t}" for t in range(turns)]
    assert [role for role, _ in _saved(data)] == ["user", "assistant"] * writers * turns
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*before, "data"})
