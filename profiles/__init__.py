"""Built-in device profiles (TOML); installed as localchat.builtin_profiles."""
