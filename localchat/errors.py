"""User-facing errors: one line that names the problem and what to do."""


class UserError(Exception):
    """Bad input from the user (a path, a flag, a model name). The CLI exits 2 with the message."""


class ModelError(UserError):
    """A model could not be found, fetched, verified or loaded."""
