"""The localchat Textual app: holds the engine, the session and the settings; the chat screen draws."""

from __future__ import annotations

import threading
from collections.abc import Callable

from textual.app import App, SystemCommand

from localchat.documents import DEFAULT_MAX_BYTES
from localchat.engine.sampling import GenerationSettings
from localchat.tui import commands, keys
from localchat.tui.widgets.status import device_memory


class LocalChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "localchat"

    def __init__(self, engine=None, *, loader: Callable | None = None, settings: GenerationSettings | None = None,
                 policy_args: dict | None = None, max_bytes: int = DEFAULT_MAX_BYTES, store_path=None,
                 memory_probe: Callable | None = None, keymap: dict[str, str] | None = None):
        super().__init__()
        self.engine = None
        self.session = None
        self.chat_name: str | None = None
        self.loader = loader
        self.settings = settings or GenerationSettings()
        self.policy_args = dict(policy_args or {})  # policy_for() keywords from the flags + positions
        self.profile_name: str | None = None  # the device profile in force (/profile)
        self.max_bytes = max_bytes
        self.store_path = store_path
        self.memory_probe = memory_probe or device_memory
        self.engine_lock = threading.Lock()  # one engine user at a time (tokenizers are not thread-safe)
        if keymap is None:
            keymap, self.key_problems = keys.load_keymap()
        else:
            self.key_problems = []
        self.keymap_overrides = keymap
        if engine is not None:
            self.use_engine(engine)

    def on_mount(self) -> None:
        from localchat.tui.screens.chat import ChatScreen

        self.set_keymap(self.keymap_overrides)
        self.push_screen(ChatScreen())

    # --- state -----------------------------------------------------------------------------------

    def use_engine(self, engine) -> None:
        self.engine = engine
        self.new_session()

    def new_session(self) -> None:
        from localchat.session import Session

        self.session = Session(self.engine)
        self.chat_name = None

    def store(self):
        from localchat.store import Store

        return Store(self.store_path)

    def policy_names(self) -> list[str]:
        from localchat.engine.policies import POLICIES

        return list(POLICIES)

    def change_policy(self, name: str | None = None, budget: int | None = None) -> None:
        """Rebuild the policy (policy_setup) with a new name or budget; raises UserError."""
        from localchat.engine.policy_setup import policy_for

        args = dict(self.policy_args)
        positions = args.pop("positions", None)
        if budget is not None:
            args["budget"] = budget
        name = name or self.engine.policy.name
        policy = policy_for(self.engine, name, **_for_policy(name, args))
        self.session.set_policy(policy, positions)
        if budget is not None:
            self.policy_args["budget"] = budget

    def use_profile(self, name: str) -> str:
        """Apply profile `name`'s policy, budget, n_s, n_loc, positions and chunk to this chat; returns
        what changed (raises UserError for an unknown name or a bad value)."""
        from localchat import profiles
        from localchat.engine.policy_setup import policy_for

        profile = profiles.find(name)
        values = profile.values
        args = dict(self.policy_args)
        for key in ("budget", "stabilizers", "local", "positions"):
            if key in values:
                args[key] = values[key]
        positions = args.pop("positions", None)
        name = values.get("policy", self.engine.policy.name)
        policy = policy_for(self.engine, name, **_for_policy(name, args))
        if "chunk" in values:
            self.engine.chunk = int(values["chunk"])
        self.session.set_policy(policy, positions)
        self.policy_args = {**args, "positions": positions}
        self.profile_name = profile.name
        budget = f", budget {policy.budget:,}" if policy.evicts or policy.selects else ""
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


def _for_policy(name: str, args: dict) -> dict:
    """policy_for() keywords for `name`: --offload and --sparse-prefill are OmniKV's alone."""
    return {k: v for k, v in args.items() if k not in ("offload", "sparse_prefill") or name == "omnikv"}


def run_tui(args, settings) -> int:
    """`localchat` with no subcommand: the chat window; the model loads in the background."""
    from localchat.cli import load_engine

    policy_args = {"budget": args.budget, "stabilizers": args.stabilizers, "local": args.local,
                   "heads": args.heads, "decode_window": args.decode_window, "positions": args.positions,
                   "offload": getattr(args, "offload", False), "sparse_prefill": getattr(args, "sparse_prefill", None)}
    def load():
        engine = load_engine(args)  # applies the profile and the plan to args
        app.policy_args.update({k: getattr(args, k) for k in ("budget", "stabilizers", "local", "positions")})
        resolved = getattr(args, "_resolved", None)
        app.profile_name = resolved.profile.name if resolved is not None and resolved.profile else None
        return engine

    app = LocalChatApp(loader=load, settings=settings, policy_args=policy_args,
                       max_bytes=int(args.max_file_mb * 1024 * 1024))
    app.run()
    return 0
