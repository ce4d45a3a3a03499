"""What each slash command does (mixed into the chat screen)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from localchat.errors import UserError
from localchat.tui import commands
from localchat.tui.keys import DEFAULT_KEYS


class CommandHandlers:
    """Each `cmd_NAME(arg)` returns nothing and reports in the chat; errors are one line."""

    async def run_command(self, command: commands.Command) -> None:
        handler = getattr(self, f"cmd_{command.name}", None)
        if command.name not in commands.COMMANDS or handler is None:
            self.note(f"unknown command /{command.name}; /help lists the commands", error=True)
            return
        needs_session = command.name in ("new", "policy", "budget", "system", "export", "clear")
        if needs_session and self.app.session is None:
            self.note(f"/{command.name} needs a loaded model", error=True)
            return
        if command.name in ("new", "policy", "budget", "system", "clear") and self.turn is not None:
            self.note(f"/{command.name} must wait until the answer is done (Esc stops it)", error=True)
            return
        try:
            await handler(command.arg)
        except UserError as exc:
            self.note(str(exc), error=True)

    async def cmd_attach(self, arg: str) -> None:
        if not arg:
            self.action_attach()
            return
        from localchat.documents import parse_path_input

        self.attach(parse_path_input(arg) or arg.strip("'\""))

    async def cmd_new(self, arg: str) -> None:
        self.app.new_session()
        await self.conversation.remove_children()
        self.note("new chat")
        self.refresh_status()
        self.refresh_map()
        self.refresh_chats()

    async def cmd_clear(self, arg: str) -> None:
        self.app.session.clear()
        await self.conversation.remove_children()
        self.note("cleared this chat and its cache")
        self.refresh_status()
        self.refresh_map()

    async def cmd_policy(self, arg: str) -> None:
        names = self.app.policy_names()
        if not arg:
            self.note(f"policy is {self.app.engine.policy.name}; choose one of: {', '.join(names)}")
            return
        self.app.change_policy(name=arg)
        self._policy_changed()

    async def cmd_budget(self, arg: str) -> None:
        if not re.fullmatch(r"\d+", arg) or int(arg) < 1:
            raise UserError(f"/budget needs a whole number of units, at least 1 (got {arg or 'nothing'})")
        if not self.app.engine.policy.uses_budget():
            raise UserError(f"policy {self.app.engine.policy.name} keeps every token, so it has no budget; "
                            f"/policy locret first")
        self.app.change_policy(budget=int(arg))
        self._policy_changed()

    def _policy_changed(self) -> None:
        policy = self.app.engine.policy
        budget = f", budget {policy.budget:,} units" if policy.evicts else ""
        if policy.selects:
            budget = f", keeps every unit and reads {policy.budget:,} per KV head in its sparse layers"
        again = " The next question re-reads this chat once." if self.app.session.turns else ""
        self.note(f"policy {policy.name}{budget}.{again}")
        self.refresh_status()

    async def cmd_profile(self, arg: str) -> None:
        from localchat.planning import profiles

        known = ", ".join(profiles.all_profiles())
        if arg:
            if self.app.engine is None:
                raise UserError("/profile NAME needs a loaded model; start with `localchat --profile NAME`")
            self.note(self.app.use_profile(arg))
            self.refresh_status()
            return
        engine = self.app.engine
        if engine is None:
            self.note(f"no model loaded yet. Profiles: {known}")
            return
        policy = engine.policy
        budget = f"{policy.budget:,}" if policy.uses_budget() else "none (keeps everything)"
        settings = self.app.settings
        plan = self.app.spec.plan if self.app.spec is not None else None
        lines = [f"model {engine.name} on {engine.device.type}; policy {policy.name}, budget {budget}, "
                 f"chunk {engine.chunk:,}, positions {engine.positions}; answers up to "
                 f"{settings.max_new_tokens} tokens, temperature {settings.temperature}.",
                 f"profile: {self.app.profile_name or 'none'}. Profiles: {known} (/profile NAME applies one)."]
        if plan is not None:
            lines += plan.lines()
        self.note("\n".join(lines))

    async def cmd_system(self, arg: str) -> None:
        self.app.session.set_system(arg or None)
        again = " The next question re-reads this chat once." if self.app.session.turns else ""
        self.note((f"system prompt set: {arg}" if arg else "system prompt removed") + "." + again)

    async def cmd_export(self, arg: str) -> None:
        name = re.sub(r"[^\w.-]+", "-", self.app.chat_name or "chat").strip("-") or "chat"
        path = Path(arg).expanduser() if arg else Path.cwd() / f"localchat-{name}-{time.strftime('%Y%m%d-%H%M%S')}.md"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.app.session.export_markdown(), encoding="utf-8")
        except OSError as exc:
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.note(f"exported this chat to {path}")

    async def cmd_help(self, arg: str) -> None:
        lines = ["Commands:"] + [f"  {commands.usage(n)}" for n in commands.COMMANDS]
        lines.append("Keys:")
        lines += [f"  {self.app.key_for(ident):<10} {label}" for ident, (_, _, label) in DEFAULT_KEYS.items()]
        lines.append("  ctrl+p     command palette")
        lines.append("Paste or drop a file path to attach it; large pastes become attachments too. "
                     "Keys can be changed in config.toml under [keys], e.g. retained_map = \"f2\".")
        self.note("\n".join(lines))
