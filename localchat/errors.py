"""User-facing errors: one line that names the problem and what to do."""

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2  # answered; any other failure; bad input (one line)


class UserError(Exception):
    """Bad input from the user (a path, a flag, a model name). The CLI exits 2 with the message."""


class ModelError(UserError):
    """A model could not be found, fetched, verified or loaded."""


class TooLong(UserError):
    """The conversation does not fit: the model's window, or the memory a policy that keeps every token needs."""


def first_line(exc: BaseException | str, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when the message is empty), at most `limit`
    characters."""
    text = exc if isinstance(exc, str) else str(exc)
    lines = text.strip().splitlines()
    line = lines[0] if lines else (type(exc).__name__ if not isinstance(exc, str) else "")
    return line[:limit] if limit is not None else line


def check_text(text: str, what: str) -> str:
    """`text` when it can be written out as UTF-8; else a UserError that names `what` and where it breaks (a lone
    surrogate: bytes that were not UTF-8 on the command line, or an escape such as \\ud800 in a JSON request)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{what} is not valid text: character {exc.start + 1} ({text[exc.start]!r}) is half of a "
                        f"UTF-16 pair or a byte that is not UTF-8; send it as UTF-8 text") from None
    return text
