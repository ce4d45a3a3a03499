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
    result = conversation(lambda: Running(serve()), "Read: the pass key is 12345.\nWhat is the pass key?", "12345",
                          4, say=lambda line: None)
    turns = result["turns"]
    assert len(turns) == len(QUESTIONS) and all(t["ttft_s"] > 0 for t in turns)
    assert turns[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert turns[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # after the restart too
    table = markdown({"command": "localchat bench serve", "document_tokens": 40, "results": {"localchat": result},
                      "hardware": {"cpu": "cpu", "cores": 2}, "versions": {"torch": "t", "localchat": "l", "commit": "c"}})
    row = next(line for line in table.splitlines() if line.startswith("| localchat | "))
    assert row.count("x)") == 2 and row.endswith("| 100 MiB | 0 of 3 |")
