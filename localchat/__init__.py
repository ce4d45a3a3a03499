"""localchat: chat with long documents on a local model, inside a fixed KV-cache budget."""

__version__ = "0.1.0"
