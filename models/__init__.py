"""Model cards (TOML) and trained retaining heads; installed as localchat.models."""
