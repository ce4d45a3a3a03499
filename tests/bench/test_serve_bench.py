"""`bench serve`'s conversation runner against a real server, and its table."""

from __future__ import annotations

from localchat.bench.serve import QUESTIONS, conversation, markdown


class Running:
    """A started in-thread server, as `conversation` expects of a child process."""

    def __init__(self, service):
        self.service, self.url = service, service.url

    def peak_mib(self):
        return 100.0

    def stop(self):
        self.service.stop()


def test_the_conversation_runs_three_turns_across_a_restart_and_tabulates(serve):
    result = conversation(lambda: Running(serve()), "The pass key is 12345.", "12345", 4, say=lambda line: None)
    turns = result["turns"]
    assert len(turns) == len(QUESTIONS) and all(t["ttft_s"] > 0 for t in turns)
    assert turns[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert turns[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # after the restart too
    table = markdown({"command": "localchat bench serve", "document_tokens": 40, "results": {"localchat": result},
                      "hardware": {"cpu": "cpu", "cores": 2}, "versions": {"torch": "t", "localchat": "l", "commit": "c"}})
    row = next(line for line in table.splitlines() if line.startswith("| localchat | "))
    assert row.count("x)") == 2 and row.endswith("| 100 MiB | 0 of 3 |")


def test_open_webuis_layouts_read_the_document_once_and_answer_as_in_place(serve):
    """The document moved to each last question (and in the system message) is read once, also after the restart;
    the answers are those of the conversation that kept it where it was read."""
    document = " ".join(f"Line {i}: the tide log reads {i % 7}." for i in range(80)) + " The pass key is 12345."
    results = {layout: conversation(lambda: Running(serve()), document, "12345", 4, say=lambda line: None,
                                    layout=layout) for layout in ("open-webui", "open-webui-system", "in-place")}
    for layout, result in results.items():
        first, *later = result["turns"]
        assert all(t["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
                   for t in later), layout
    assert [t["answer"] for t in results["open-webui"]["turns"]] == [t["answer"] for t in results["in-place"]["turns"]]
    table = markdown({"command": "c", "document_tokens": 40, "hardware": {"cpu": "cpu", "cores": 2},
                      "versions": {"torch": "t", "localchat": "l", "commit": "c"},
                      "results": {f"localchat, {k}": {**v, "layout": k} for k, v in results.items()}})
    assert "- open-webui: 3 of 3 answers the same as in-place's" in table
