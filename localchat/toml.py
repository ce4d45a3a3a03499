"""tomllib on 3.11+, tomli before."""

try:
    import tomllib as toml  # noqa: F401
except ModuleNotFoundError:  # Python 3.10
    import tomli as toml  # type: ignore[no-redef]  # noqa: F401
