"""tomllib on 3.11+, tomli before; a file nested too deep to parse is a TOMLDecodeError, not a RecursionError."""

from types import SimpleNamespace

try:
    import tomllib as _toml
except ModuleNotFoundError:  # Python 3.10
    import tomli as _toml  # type: ignore[no-redef]


def _loads(text: str, **kw) -> dict:
    try:
        return _toml.loads(text, **kw)
    except RecursionError:
        raise _toml.TOMLDecodeError("nested too deeply to read") from None


def _load(fp, **kw) -> dict:
    return _loads(fp.read().decode("utf-8"), **kw)


toml = SimpleNamespace(loads=_loads, load=_load, TOMLDecodeError=_toml.TOMLDecodeError)
