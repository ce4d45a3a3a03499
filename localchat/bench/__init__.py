"""Offline long-context benchmark: task generators, runner, report."""
