"""The Textual chat window (`localchat` with no subcommand)."""
