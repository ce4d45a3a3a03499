"""Screens of the chat window, each with its own .tcss."""
