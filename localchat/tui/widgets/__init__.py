"""Widgets of the chat window."""
