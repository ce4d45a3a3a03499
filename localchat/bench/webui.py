"""Requests as Open WebUI 0.12.4 makes them for a chat with a file in whole-document mode, written from its code
(the `open-webui` wheel: utils/middleware.py `get_source_context` and `apply_source_context_to_messages`,
utils/task.py `rag_template`, utils/misc.py `add_or_update_user_message`, `add_or_update_system_message` and
`update_message_content`, config.py `DEFAULT_RAG_TEMPLATE`, env.py `RAG_SYSTEM_CONTEXT`).

Each file becomes `<source id="1" name="..." resource-type="file" resource-id="...">TEXT</source>` (no other
attributes: RAG_SOURCE_METADATA_KEYS is empty by default); the sources, stripped, replace `{{CONTEXT}}` in the RAG
template. By default (RAG_SYSTEM_CONTEXT false) the filled template goes in front of the last user message
("template\\nquestion") and the history keeps the bare questions; with RAG_SYSTEM_CONTEXT true it is the system
message (appended to one the chat has, after a line break), the same on every turn."""

from __future__ import annotations

from pathlib import Path

# Open WebUI's DEFAULT_RAG_TEMPLATE, verbatim (open-webui 0.12.4, open_webui/config.py): the text it sends
TEMPLATE = (Path(__file__).parent / "open_webui_rag_template.txt").read_text(encoding="utf-8")


def context(files: list[tuple[str, str, str]]) -> str:
    """`files`: (name, file id, text) in the chat's order."""
    blocks = [f'<source id="{i}" name="{name}" resource-type="file" resource-id="{fid}">{text}</source>\n'
              for i, (name, fid, text) in enumerate(files, start=1)]
    return "".join(blocks).strip()


def filled(files: list[tuple[str, str, str]]) -> str:
    return TEMPLATE.replace("{{CONTEXT}}", context(files))


def request(turns: list[tuple[str, str | None]], files, system_context: bool = False,
            system: str | None = None) -> list[dict]:
    """The messages of the request for the last of `turns` ((question, answer or None for the one asked now));
    `files`: (name, file id, text)."""
    messages = [{"role": "system", "content": system}] if system else []
    for question, answer in turns:
        messages.append({"role": "user", "content": question})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    block = filled(files)
    if system_context:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n{block}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
    else:
        messages[-1] = {"role": "user", "content": f"{block}\n{messages[-1]['content']}"}
    return messages
