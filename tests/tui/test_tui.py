"""The chat window driven through App.run_test() + Pilot against a real engine on the tiny random Llama."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tui_helpers import (
    answers,
    chips,
    errors,
    key,
    make_app,
    notes,
    paste,
    record_events,
    run,
    settle,
    status,
    type_text,
    users,
    wait_for,
)

from localchat.engine.events import Done, Progress, Token
from localchat.engine.policies import POLICIES, make_policy
from localchat.tui.widgets.chat_list import ChatList
from localchat.tui.widgets.progress import PrefillProgress
from localchat.tui.widgets.retained import RetainedMap


def doc(tmp_path, name="notes.txt", size=3000) -> Path:
    path = tmp_path / name
    words = "the quick brown fox jumps over the lazy dog while the pass key is 4821 ".split()
    path.write_text(" ".join(words[i % len(words)] for i in range(size // 5))[:size] + "\n")
    return path


def test_send_shows_the_streamed_answer_and_updates_the_footer(tiny_engine):
    async def scenario(app, pilot):
        seen = record_events(app)
        before = status(app)
        assert "kept 0 (no budget)" in before and "prefill - tok/s" in before
        await type_text(pilot, "hello there")
        await settle(pilot)
        tokens = [e for e in seen if isinstance(e, Token)]
        done = [e for e in seen if isinstance(e, Done)]
        assert tokens and len(done) == 1
        assert [str(u.render()) for u in users(app)] == ["hello there"]
        (answer,) = answers(app)
        assert answer.text == done[0].text == "".join(t.text for t in tokens)
        assert app.session.messages[-1] == {"role": "assistant", "content": done[0].text}
        after = status(app)
        assert after != before
        assert f"kept {app.session.kv_units:,} (no budget)" in after
        assert f"prefill {done[0].prefill_tps:,.0f} tok/s" in after
        assert "tiny" in after and "full" in after and "RAM 100 MiB" in after
        assert not app.screen.query_one(PrefillProgress).display
        assert app.screen.prompt.value == ""

    run(scenario, make_app(tiny_engine))


def test_attach_by_command_and_by_pasted_paths(tiny_engine, tmp_path):
    a = doc(tmp_path, "a.txt", 900)
    b = doc(tmp_path, "b b.txt", 700)
    c = doc(tmp_path, "c.md", 500)

    async def scenario(app, pilot):
        await type_text(pilot, f"/attach {a}")
        await settle(pilot)
        await paste(pilot, f"'{b}'")  # GNOME-style quoted drop
        await settle(pilot)
        await paste(pilot, c.as_uri())  # file:// URL
        await settle(pilot)
        counts = [tiny_engine.count_tokens(p.read_text()) for p in (a, b, c)]
        assert chips(app) == [f"{p.name} · {n:,} tokens ✕" for p, n in zip((a, b, c), counts)]
        assert app.screen.prompt.value == ""  # the paths never landed in the input
        await type_text(pilot, "what is in these?")
        await settle(pilot)
        assert chips(app) == []
        assert [x.name for x in app.session.attachments] == ["a.txt", "b b.txt", "c.md"]
        assert [x.tokens for x in app.session.attachments] == [tiny_engine.count_tokens(p.read_text().strip())
                                                               for p in (a, b, c)]
        assert "a.txt" in str(users(app)[0].render())

    run(scenario, make_app(tiny_engine))


def test_a_typed_absolute_path_attaches_and_is_not_called_a_command(tiny_engine, tmp_path):
    a = doc(tmp_path, "typed.txt", 300)

    async def scenario(app, pilot):
        assert "KV 0.0 MiB" in status(app) and "-x" not in status(app)  # no ratio before the first answer
        app.screen.prompt.focus()
        app.screen.prompt.value = str(a)  # typed into the input (a paste is another path)
        await pilot.pause()
        hint = str(app.screen.query_one("#hint").render())
        assert "no such command" not in hint and "Enter attaches typed.txt" in hint
        await pilot.press("enter")
        await settle(pilot)
        assert chips(app) == [f"typed.txt · {tiny_engine.count_tokens(a.read_text()):,} tokens ✕"] and not errors(app)

    run(scenario, make_app(tiny_engine))


def test_a_large_paste_becomes_a_chip_and_small_multiline_pastes_keep_every_line(tiny_engine):
    big = "line of pasted text\n" * 200

    async def scenario(app, pilot):
        await paste(pilot, big)
        await settle(pilot)
        assert chips(app) == [f"pasted-1.txt · {tiny_engine.count_tokens(big):,} tokens ✕"]
        assert app.screen.prompt.value == ""
        await paste(pilot, "first\nsecond\nthird")
        assert app.screen.prompt.value == "first second third"

    run(scenario, make_app(tiny_engine))


def test_bad_files_are_reported_and_the_conversation_is_kept(tiny_engine, tmp_path):
    binary = tmp_path / "x.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)

    async def scenario(app, pilot):
        await type_text(pilot, "hi")
        await settle(pilot)
        await type_text(pilot, f"/attach {binary}")
        await settle(pilot)
        await paste(pilot, f"'{tmp_path / 'missing.txt'}'")
        await settle(pilot)
        errs = errors(app)
        assert len(errs) == 2, errs
        assert "PNG image" in errs[0] and "x.png" in errs[0]
        assert "missing.txt" in errs[1]
        assert chips(app) == [] and len(users(app)) == 1 and app.session.turns == 1

    run(scenario, make_app(tiny_engine))


def test_esc_cancels_mid_prefill_keeps_the_ui_responsive_and_restores_the_input(tiny_engine, tmp_path):
    tiny_engine.set_policy(make_policy("streaming", budget=256, local=32))
    tiny_engine.chunk = 16  # many small chunks: a prefill of several seconds
    big = doc(tmp_path, "big.txt", 32_000)  # byte-level tokenizer: about 32K tokens

    async def scenario(app, pilot):
        seen = record_events(app)
        await type_text(pilot, f"/attach {big}")
        await settle(pilot)
        ticks = []
        app.set_interval(0.02, lambda: ticks.append(time.monotonic()))
        app.screen.prompt.value = "what is the pass key?"
        key(app, "enter")
        await wait_for(pilot, lambda: any(isinstance(e, Progress) for e in seen))
        await wait_for(pilot, lambda: app.screen.query_one(PrefillProgress).display)
        # key presses are handled while the engine reads
        key(app, "x", "x")
        key(app, "y", "y")
        assert await wait_for(pilot, lambda: app.screen.prompt.value == "xy") < 1.0
        assert "tokens" in str(app.screen.query_one("#progress-text").render())
        assert app.screen.turn is not None  # still reading
        key(app, "escape")
        assert await wait_for(pilot, lambda: app.screen.turn is None) < 2.0
        await settle(pilot)
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        assert max(gaps) < 0.5, max(gaps)  # the event loop never stalled
        progress = [e for e in seen if isinstance(e, Progress)]
        assert progress[-1].done < progress[-1].total  # stopped before the end
        (done,) = [e for e in seen if isinstance(e, Done)]
        assert done.stop_reason == "cancelled" and done.new_tokens == 0
        assert app.screen.prompt.value == "what is the pass key?"
        assert chips(app) == [f"big.txt · {tiny_engine.count_tokens(big.read_text()):,} tokens ✕"]
        assert users(app) == [] and answers(app) == []
        assert app.session.turns == 0
        assert any("stopped while reading" in n for n in notes(app))

    run(scenario, make_app(tiny_engine))


def test_a_follow_up_does_not_reread_the_document(tiny_engine, tmp_path):
    tiny_engine.set_policy(make_policy("streaming", budget=256, local=32))
    path = doc(tmp_path, "story.txt", 4000)

    async def scenario(app, pilot):
        seen = record_events(app)
        await paste(pilot, str(path))
        await settle(pilot)
        await type_text(pilot, "what is the pass key?")
        await settle(pilot)
        first = [e for e in seen if isinstance(e, Done)][-1]
        seen.clear()
        await type_text(pilot, "and again?")
        await settle(pilot)
        second = [e for e in seen if isinstance(e, Done)][-1]
        doc_tokens = tiny_engine.count_tokens(path.read_text())
        assert first.prompt_tokens > doc_tokens
        assert second.prompt_tokens < 100  # only the new question was read
        assert max(p.total for p in seen if isinstance(p, Progress)) < 100
        assert len(answers(app)) == 2 and app.session.turns == 2
        assert f"kept {app.session.kv_units:,}/256 ·" in status(app)

    run(scenario, make_app(tiny_engine))


def test_retained_map_shows_the_documents_cached_share(tiny_engine, tmp_path):
    tiny_engine.set_policy(make_policy("streaming", budget=256, local=32))
    path = doc(tmp_path, "book.txt", 3000)

    async def scenario(app, pilot):
        await pilot.press("ctrl+r")
        view = app.screen.query_one(RetainedMap)
        assert view.display and "no document" in str(view.render())
        await paste(pilot, str(path))
        await settle(pilot)
        await type_text(pilot, "summarise")
        await settle(pilot)
        text = str(view.render())
        assert "book.txt" in text
        row = text.splitlines()[1]
        # streaming keeps the sinks (before the document) and the recent end: the document's end only
        assert row[-1] == "█" and row[0] == " " and row[len(row) // 2] == " ", text
        assert len(row) > 40 and set(row) <= set(" ▁▂▃▄▅▆▇█")
        shares = app.session.retained_map(len(row))
        assert [c != " " for c in row] == [s > 0 for s in shares]
        await pilot.press("ctrl+r")
        assert not view.display

    run(scenario, make_app(tiny_engine))


def test_slash_commands(tiny_engine, tmp_path):
    out = tmp_path / "chat.md"

    async def scenario(app, pilot):
        await type_text(pilot, "/help")
        assert "/attach [PATH]" in notes(app)[-1] and "ctrl+r" in notes(app)[-1]
        await type_text(pilot, "/frobnicate")
        assert "unknown command /frobnicate" in errors(app)[-1]
        await type_text(pilot, "/budget 64")
        assert "keeps every token" in errors(app)[-1]
        await type_text(pilot, "/policy nonsense")
        assert "nonsense" in errors(app)[-1]
        await type_text(pilot, "/policy streaming")
        assert tiny_engine.policy.name == "streaming"
        await type_text(pilot, "/budget 128")
        assert tiny_engine.policy.budget == 128 and "kept 0/128 ·" in status(app)
        await type_text(pilot, "/budget lots")
        assert "whole number" in errors(app)[-1]
        await type_text(pilot, "/profile")
        assert "chunk 64" in notes(app)[-1] and "rtx4090" in notes(app)[-1] and "profile: none" in notes(app)[-1]
        from localchat.planning import profiles

        profiles.save_profile("small", {"policy": "streaming", "budget": 96, "chunk": 32, "weights": "fp32"})
        await type_text(pilot, "/profile small")  # applies its policy, budget and chunk to this chat
        assert (app.engine.policy.name, app.engine.policy.budget, app.engine.chunk) == ("streaming", 96, 32)
        assert "profile small" in notes(app)[-1] and "Restart with --profile small for its weights" in notes(app)[-1]
        await type_text(pilot, "/profile")
        assert "profile: small" in notes(app)[-1]
        await type_text(pilot, "/profile rtx9999")
        assert "rtx9999" in errors(app)[-1] and "rtx4090" in errors(app)[-1]  # names the known ones
        await type_text(pilot, "/policy streaming")
        await type_text(pilot, "/system Answer in French.")
        assert app.session.system == "Answer in French."
        await type_text(pilot, "bonjour")
        await settle(pilot)
        await type_text(pilot, f"/export {out}")
        assert "## You" in out.read_text() and "bonjour" in out.read_text()
        assert len(errors(app)) == 5  # the five bad commands above, nothing else
        await type_text(pilot, "/clear")
        assert app.session.turns == 0 and users(app) == []
        await type_text(pilot, "/new")
        assert app.chat_name is None and app.session.system is None

    run(scenario, make_app(tiny_engine))


def test_slash_completion_and_the_command_palette(tiny_engine):
    async def scenario(app, pilot):
        prompt = app.screen.prompt
        prompt.focus()
        await pilot.press("/", "p", "o")
        await pilot.pause(0.1)
        assert "/policy NAME" in str(app.screen.query_one("#hint").render())
        await pilot.press("tab")
        assert prompt.value == "/policy "
        assert "streaming" in str(app.screen.query_one("#hint").render())
        await pilot.press("s", "t")
        await pilot.pause(0.1)
        await pilot.press("tab")
        assert prompt.value == "/policy streaming"
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for name in ("attach", "new", "policy", "budget", "profile", "system", "export", "clear", "help"):
            assert f"/{name}" in titles

    run(scenario, make_app(tiny_engine))


def test_keys_are_remappable_through_config(tiny_engine, tmp_path, monkeypatch):
    config = tmp_path / "cfg"
    config.mkdir()
    (config / "config.toml").write_text('[keys]\nretained_map = "f5"\nteleport = "f6"\n')
    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(config))

    async def scenario(app, pilot):
        view = app.screen.query_one(RetainedMap)
        await pilot.press("ctrl+r")
        assert not view.display
        await pilot.press("f5")
        assert view.display
        assert "unknown action 'teleport'" in errors(app)[0]

    run(scenario, make_app(tiny_engine))


def test_no_subcommand_opens_the_chat_window(monkeypatch):
    from localchat import cli
    from localchat.tui import app as tui_app

    opened = []
    monkeypatch.setattr(tui_app, "run_tui", lambda spec, max_bytes: opened.append(spec) or 0)
    assert cli.main(["--max-new-tokens", "7"]) == 0
    assert [spec.generation.max_new_tokens for spec in opened] == [7]  # the settings, resolved before the window


def test_model_load_failure_keeps_the_app_alive():
    def broken():
        raise OSError("no such model: nowhere/nothing\nsecond line")

    async def scenario(app, pilot):
        await settle(pilot)
        assert "could not load the model: no such model: nowhere/nothing" in errors(app)[0]
        await type_text(pilot, "hello?")
        assert "no model is loaded" in errors(app)[-1]
        assert app.screen.prompt.value == "hello?"  # nothing lost
        await type_text(pilot, "/help")
        assert "/attach" in notes(app)[-1]
        assert "no model loaded" in status(app)

    run(scenario, make_app(None, loader=broken))


def test_the_loaded_heap_is_left_out_of_collections_while_chatting(tiny_engine):
    """Once the model has loaded, the objects alive then are frozen out of the garbage collector (a full collection
    over torch and the model holds the GIL about 0.3 s: a stall of the window); leaving the app unfreezes them."""
    import gc

    gc.unfreeze()
    loaded = []

    async def scenario(app, pilot):
        await settle(pilot)
        loaded.append(gc.get_freeze_count())
        assert "tiny" in notes(app)[-1]  # the welcome: the engine is in use

    run(scenario, make_app(None, loader=lambda: tiny_engine))
    assert loaded[0] > 10_000 and gc.get_freeze_count() == 0


def test_engine_errors_are_shown_and_the_question_restored(tiny_engine):
    tiny_engine.window = 64  # full attention on a 64-token window: a longer prompt is refused

    async def scenario(app, pilot):
        await type_text(pilot, "tell me everything " * 10)
        await settle(pilot)
        assert "reads at most 64" in errors(app)[-1]
        assert app.screen.prompt.value == ("tell me everything " * 10).strip()
        assert users(app) == [] and app.session.turns == 0

    run(scenario, make_app(tiny_engine))


def test_out_of_memory_is_reported_and_the_chat_kept(tiny_engine):
    import torch

    async def scenario(app, pilot):
        await type_text(pilot, "first question")
        await settle(pilot)
        send = app.session.send

        def oom(*args, **kw):
            for event in send(*args, **kw):
                if isinstance(event, Token):
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                yield event

        app.session.send = oom
        await type_text(pilot, "second question")
        await settle(pilot)
        assert "out of memory while answering; the chat is kept" in errors(app)[-1]
        assert app.screen.prompt.value == "second question"
        assert [str(u.render()) for u in users(app)] == ["first question"] and len(answers(app)) == 1
        app.session.send = send
        seen = record_events(app)
        await type_text(pilot, "second question")
        await settle(pilot)
        assert len(users(app)) == 2 and app.session.turns == 2
        # the session is as before the failed turn: only the new question is read
        assert [e for e in seen if isinstance(e, Done)][-1].prompt_tokens < 2 * len("second question") + 20

    run(scenario, make_app(tiny_engine))


def test_chats_are_saved_listed_and_reopened(tiny_engine, tmp_path):
    async def scenario(app, pilot):
        await type_text(pilot, "remember the word tangerine")
        await settle(pilot)
        name = app.chat_name
        assert name
        chat_list = app.screen.query_one(ChatList)
        await wait_for(pilot, lambda: chat_list.option_count == 1)
        await type_text(pilot, "/new")
        await settle(pilot)
        assert users(app) == []
        chat_list.highlighted = 0
        chat_list.action_select()
        await settle(pilot)
        assert app.chat_name == name
        assert [str(u.render()) for u in users(app)] == ["remember the word tangerine"]
        assert len(answers(app)) == 1 and app.session.turns == 1

    run(scenario, make_app(tiny_engine, store_path=tmp_path / "chats.sqlite3"))


def test_a_reopened_chat_continues_with_its_own_settings(tiny_engine, tmp_path):
    """A chat made with streaming, budget 128, opened after the window moved to budget 256 and then to full
    attention: the window takes the chat's settings back, and its follow-up reads only the new question."""
    async def scenario(app, pilot):
        await type_text(pilot, "/policy streaming")
        await type_text(pilot, "/budget 128")
        await type_text(pilot, "remember the word tangerine " * 20)
        await settle(pilot)
        name = app.chat_name
        chat_list = app.screen.query_one(ChatList)
        await wait_for(pilot, lambda: chat_list.option_count == 1)
        await type_text(pilot, "/new")
        await type_text(pilot, "/budget 256")
        await type_text(pilot, "/policy full")
        await settle(pilot)
        assert tiny_engine.policy.name == "full"
        chat_list.highlighted = 0
        chat_list.action_select()
        await settle(pilot)
        assert app.chat_name == name
        assert (tiny_engine.policy.name, tiny_engine.policy.budget) == ("streaming", 128)
        assert app.spec.policy.budget == 128 and tiny_engine.spec is app.spec
        seen = record_events(app)
        await type_text(pilot, "which word?")
        await settle(pilot)
        assert not [n for n in notes(app) if "re-read" in n]
        assert [e for e in seen if isinstance(e, Done)][-1].prompt_tokens < 40

    run(scenario, make_app(tiny_engine, store_path=tmp_path / "chats.sqlite3"))


def test_every_key_reaches_its_action_while_typing(tiny_engine):
    from localchat.tui.keys import DEFAULT_KEYS

    async def scenario(app, pilot):
        assert app.screen.prompt.has_focus
        active = app.screen.active_bindings
        for ident, (pressed, action, _) in DEFAULT_KEYS.items():
            assert pressed in active and active[pressed].binding.action == action, ident  # not shadowed by the input

    run(scenario, make_app(tiny_engine))


def test_ctrl_o_file_picker_attaches_the_chosen_file(tiny_engine, tmp_path):
    from localchat.tui.screens.file_picker import FilePicker

    path = doc(tmp_path, "picked.txt", 600)

    async def scenario(app, pilot):
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, FilePicker)
        await pilot.press("escape")
        assert not isinstance(app.screen, FilePicker) and chips(app) == []
        await pilot.press("ctrl+o")
        app.screen.query_one("#picker-path").value = str(path)
        app.screen.query_one("#picker-path").focus()
        await pilot.press("enter")
        await settle(pilot)
        assert chips(app) == [f"picked.txt · {tiny_engine.count_tokens(path.read_text()):,} tokens ✕"]

    run(scenario, make_app(tiny_engine))


# the trained scorers need one made for the model: LOCRET in the window in test_tui_model.py, KVzap's refusal below
@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"locret", "kvzap"}))
def test_every_policy_answers_about_a_document_in_the_window(tiny_engine, tmp_path, name):
    """`/policy NAME` (and `/budget 128` where the policy takes one), a document, a question: an answer,
    no error, and the cache within what the policy may hold."""
    path = doc(tmp_path, "long.txt", 1500)

    async def scenario(app, pilot):
        seen = record_events(app)
        await type_text(pilot, f"/policy {name}")
        assert tiny_engine.policy.name == name
        cls = POLICIES[name]
        if cls.uses_budget():
            await type_text(pilot, "/budget 128")
            assert tiny_engine.policy.budget == 128
        await paste(pilot, str(path))
        await settle(pilot)
        await type_text(pilot, "what is the pass key?")
        await settle(pilot)
        assert errors(app) == [] and len(answers(app)) == 1 and app.session.turns == 1
        (done,) = [e for e in seen if isinstance(e, Done)]
        assert done.prompt_tokens > tiny_engine.count_tokens(path.read_text()) and done.new_tokens > 0
        if cls.evicts:  # budget + local tail + the answer (SAGE-KV: + its recent window)
            assert done.kv_tokens <= 128 + tiny_engine.policy.local + done.new_tokens + tiny_engine.policy.decode_window
        else:
            assert done.kv_tokens >= done.prompt_tokens

    run(scenario, make_app(tiny_engine))


def test_kvzap_without_a_scorer_is_one_line_and_the_policy_stays(tiny_engine):
    """`/policy kvzap` on a model no KVzap scorer is made for: one line naming the ways on; the chat goes on with
    the policy it had."""
    async def scenario(app, pilot):
        await type_text(pilot, "/policy streaming")
        await type_text(pilot, "/policy kvzap")
        assert tiny_engine.policy.name == "streaming"
        assert "KVzap scorer" in errors(app)[-1] and "--heads DIR" in errors(app)[-1] and "\n" not in errors(app)[-1]

    run(scenario, make_app(tiny_engine))


def test_offload_from_the_flags_follows_only_omnikv(tiny_engine):
    async def scenario(app, pilot):
        await type_text(pilot, "/policy streaming")  # --offload is OmniKV's: other policies switch as usual
        assert tiny_engine.policy.name == "streaming" and not errors(app)
        await type_text(pilot, "/policy omnikv")  # and OmniKV gets it: on this CPU, the one-line refusal
        assert "this runs on the CPU" in errors(app)[-1] and tiny_engine.policy.name == "streaming"

    from localchat.config import PolicySpec, RunSpec

    asked = RunSpec(policy=PolicySpec("full"), asked=(("offload", True),))  # `localchat --offload`
    run(scenario, make_app(tiny_engine, spec=asked))


def test_a_document_full_attention_cannot_hold_turns_the_default_to_the_bounded_policy(tiny_engine, tmp_path,
                                                                                       monkeypatch):
    """A model without trained heads on the default full attention, a document longer than the memory found
    holds: the window reads it with the bounded policy without heads, says so in one note, and answers."""
    from localchat.config import PolicySpec, RunSpec
    from localchat.planning import load, memory

    path = doc(tmp_path, "long.txt", 10000)
    monkeypatch.setattr(tiny_engine, "admit", load.admit)  # what planning/load.py installs on every engine it loads
    assert tiny_engine.count_tokens(path.read_text()) > 8000
    unit = memory.kv_unit_bytes(memory.Shape.from_config(tiny_engine.model.config), "fp32")
    device = memory.Device("cpu", "test", 2**40, 512 * memory.MIB + unit * 8000)  # ~8,000 tokens of K/V
    monkeypatch.setattr(memory, "detect", lambda kind=None: device)
    default = RunSpec(policy=PolicySpec("full"), sources={"policy": "default"})

    async def scenario(app, pilot):
        await paste(pilot, str(path))
        await settle(pilot)
        await type_text(pilot, "what is the pass key?")
        await settle(pilot, timeout=300)  # ~10K tokens read
        assert errors(app) == [] and len(answers(app)) == 1 and tiny_engine.policy.name == "sirllm"
        assert [n for n in notes(app) if "reading it with sirllm" in n and "localchat train-heads" in n]
        assert app.spec.policy.name == "sirllm" and app.spec.sources["policy"].startswith("default (no trained")

    run(scenario, make_app(tiny_engine, spec=default))
