"""The localchat Textual app: holds the engine, the session and the settings; the chat screen draws."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

from textual.app import App, SystemCommand

from localchat.config import RunSpec
from localchat.documents import DEFAULT_MAX_BYTES
from localchat.engine.sampling import GenerationSettings
from localchat.tui import commands, heap, keys
from localchat.tui.widgets.status import device_memory


class LocalChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"

    def __init__(self, engine=None, *, loader: Callable | None = None, settings: GenerationSettings | None = None,
                 spec: RunSpec | None = None, max_bytes: int = DEFAULT_MAX_BYTES, store_path=None,
                 memory_probe: Callable | None = None, keymap: dict[str, str] | None = None):
        super().__init__()
        self.engine = None
        self.session = None
        self.chat_name: str | None = None
        self.chat_lock = None  # the lock of the saved chat shown (localchat/store/chat_lock.py): no `ask` writes into it
        self.loader = loader
        self.load_say: Callable[[str], None] = lambda line: None  # the loader's lines: the chat screen shows them
        self._spec = spec  # the run's settings (localchat/config.py) until an engine loads: then the engine's
        self.settings = settings or (spec.generation if spec is not None else GenerationSettings())
        self.profile_name: str | None = spec.profile if spec is not None else None  # the device profile (/profile)
        self.max_bytes = max_bytes
        self.store_path = store_path
        self.said: set[str] = set()  # the store's notices already shown in this window
        self.memory_probe = memory_probe or device_memory
        self.engine_lock = threading.Lock()  # one engine user at a time (tokenizers are not thread-safe)
        if keymap is None:
            keymap, self.key_problems = keys.load_keymap()
        else:
            self.key_problems = []
        self.keymap_overrides = keymap
        if engine is not None:
            heap.freeze()
            self.use_engine(engine)

    def on_mount(self) -> None:
        from localchat.tui.screens.chat import ChatScreen

        self.set_keymap(self.keymap_overrides)
        self.push_screen(ChatScreen())

    # --- state -----------------------------------------------------------------------------------

    @property
    def spec(self) -> RunSpec | None:
        """The settings in force: the engine's (a turn may change them, fitting a long document), or the ones
        resolved at start-up while it loads."""
        if self.engine is not None and self.engine.spec is not None:
            return self.engine.spec
        return self._spec

    @spec.setter
    def spec(self, value: RunSpec | None) -> None:
        self._spec = value

    def use_engine(self, engine) -> None:
        self.engine = engine
        if engine.spec is None:  # an engine built without settings (tests, embedders): its own as they stand
            engine.configure(spec=self._spec or spec_of(engine))
        self.profile_name = self.spec.profile
        self.new_session()

    def new_session(self) -> None:
        from localchat.session import Session

        self.session = Session(self.engine)
        self.chat_name = None
        self.hold_chat(None)

    def hold_chat(self, lock) -> None:
        """Hold `lock` (the lock of the chat now shown, or None) and let go of the one held before."""
        old, self.chat_lock = self.chat_lock, lock
        if old is not None and old is not lock:
            old.release()

    def on_unmount(self) -> None:
        self.hold_chat(None)
        heap.unfreeze()

    def store(self):
        from localchat.store import Store

        return Store(self.store_path)

    def policy_names(self) -> list[str]:
        from localchat.engine.policies import POLICIES

        return list(POLICIES)

    def change_policy(self, name: str | None = None, budget: int | None = None) -> None:
        """Another policy or budget, resolved as at start-up from what the user asked; raises UserError."""
        from localchat.planning.resolve import with_policy

        self._use_spec(with_policy(self.spec, self.engine.card, self.engine.device.type, name, budget=budget))

    def _use_spec(self, spec: RunSpec) -> None:
        from localchat.planning.load import use_spec

        use_spec(self.engine, spec, session=self.session)
        self.spec = spec

    def spec_for_chat(self, saved: dict) -> RunSpec | None:
        """The window's settings with a saved chat's own (policy, budget, n_s, positions, chunk, heads), or None
        where there are none or the chat was made with another model or precision (a restart with those flags)."""
        from dataclasses import replace

        from localchat.planning.resolve import CHAT_POLICY_KEYS, option_keys, with_policy

        if not saved or self.spec is None or self.engine is None:
            return None
        if (saved.get("model"), saved.get("weights"), saved.get("kv", "none")) != \
                (self.spec.model, self.spec.weights, self.spec.kv):
            return None
        keys = (*CHAT_POLICY_KEYS, *option_keys())
        spec = with_policy(self.spec, self.engine.card, self.engine.device.type, saved.get("policy"),
                           **{k: v for k, v in saved.items() if k in keys})
        return replace(spec, chunk=int(saved.get("chunk", spec.chunk)))

    @contextmanager
    def engine_settings(self, spec: RunSpec | None):
        """The engine set to `spec` (nothing when None); its earlier settings back if the block fails."""
        from localchat.planning.load import build_policy

        engine = self.engine
        before = (engine.policy, engine.positions, engine.chunk, engine.spec)
        if spec is not None:
            engine.configure(build_policy(engine, spec.policy), positions=spec.policy.positions, chunk=spec.chunk,
                             spec=spec)
        try:
            yield
        except BaseException:
            engine.configure(before[0], positions=before[1], chunk=before[2], spec=before[3])
            raise

    def use_profile(self, name: str) -> str:
        """Apply profile `name`'s policy, budget, n_s, n_loc, positions and chunk to this chat; returns
        what changed (raises UserError for an unknown name or a bad value)."""
        from dataclasses import replace

        from localchat.planning import profiles
        from localchat.planning.resolve import option_keys, with_policy

        profile = profiles.find(name)
        values = profile.values
        changes = {k: v for k, v in values.items() if k in ("budget", "local", "positions", *option_keys())}
        spec = with_policy(self.spec, self.engine.card, self.engine.device.type, values.get("policy"), **changes)
        if "chunk" in values:
            spec = replace(spec, chunk=int(values["chunk"]))
        self._use_spec(replace(spec, profile=profile.name))
        policy = self.engine.policy
        self.profile_name = profile.name
        budget = f", budget {policy.budget:,}" if policy.uses_budget() else ""
        later = [k for k in ("model", "weights", "kv", "margin_mib") if k in values]
        rest = f" Restart with --profile {profile.name} for its {', '.join(later)}." if later else ""
        again = " The next question re-reads this chat once." if self.session.turns else ""
        return (f"profile {profile.name}: policy {policy.name}{budget}, chunk {self.engine.chunk:,}, "
                f"positions {self.engine.positions}.{again}{rest}")

    def fit_note(self, tokens: int) -> str:
        """What will happen to a document of `tokens` tokens: never drop tokens without saying so."""
        engine = self.engine
        policy = engine.policy
        if policy.evicts:
            share = min(1.0, policy.budget / max(tokens, 1))
            return (f"{policy.name} keeps {policy.budget:,} units per KV head per layer "
                    f"(about {share:.0%} of it) in a compressed cache; "
                    f"{self.key_for('retained_map')} shows which parts stay.")
        if engine.window and tokens >= engine.window:
            return (f"That is more than {engine.name} reads with full attention ({engine.window:,} tokens): "
                    f"/policy locret (or streaming) first, or the question will be refused.")
        if policy.selects:
            return (f"{policy.name} keeps every token and reads {policy.budget:,} units per KV head in its "
                    f"sparse layers.")
        return "Full attention keeps every token."

    def key_for(self, ident: str) -> str:
        return self._keymap.get(ident, keys.DEFAULT_KEYS[ident][0]) if ident in keys.DEFAULT_KEYS else ident

    # --- command palette: one entry per slash command ---------------------------------------------

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for name in commands.COMMANDS:
            arg, what = commands.COMMANDS[name]
            yield SystemCommand(f"/{name}", what, lambda name=name: self._palette(name))

    async def _palette(self, name: str) -> None:
        from localchat.tui.screens.chat import ChatScreen

        screen = self.screen
        if not isinstance(screen, ChatScreen):
            return
        arg = commands.COMMANDS[name][0]
        if arg and not arg.startswith("[") or name == "system":
            screen.prompt.value = f"/{name} "
            screen.prompt.cursor_position = len(screen.prompt.value)
            screen.prompt.focus()
            return
        await screen.run_command(commands.Command(name, ""))


def spec_of(engine) -> RunSpec:
    """The settings of an engine built without a RunSpec (tests, embedders): its policy as it stands."""
    from localchat.config import PolicySpec

    p = engine.policy
    return RunSpec(policy=PolicySpec(p.name, p.budget if p.uses_budget() else None, p.local, engine.positions,
                                     p.decode_window), model=None, chunk=engine.chunk, kv=engine.kv,
                   card=engine.card)


def run_tui(spec: RunSpec, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """`localchat` with no subcommand: the chat window; the plan is made and the model loads in the background,
    saying how far it is in the window (the first start fetches and converts the default model). What child
    processes and C libraries print goes to a log in the cache directory, never onto the window."""
    from localchat import paths
    from localchat.tui.output import window_only

    def load():
        from localchat.planning.load import load_engine
        from localchat.planning.resolve import complete

        return load_engine(complete(spec), say=lambda line: app.load_say(line))

    with window_only(paths.cache_dir() / "window-output.log"):
        app = LocalChatApp(loader=load, spec=spec, max_bytes=max_bytes)
        app.run()
    return 0
