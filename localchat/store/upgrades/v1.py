"""Schema 1: chats, their messages, and the documents attached to them."""

SQL = """
CREATE TABLE chats (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, title TEXT NOT NULL, model TEXT NOT NULL,
    policy TEXT NOT NULL, system TEXT, created REAL NOT NULL, updated REAL NOT NULL,
    fed INTEGER NOT NULL DEFAULT 0, kept_units INTEGER NOT NULL DEFAULT 0,
    kept_bytes INTEGER NOT NULL DEFAULT 0, cache_file TEXT);
CREATE TABLE messages (
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, idx INTEGER NOT NULL,
    role TEXT NOT NULL, content TEXT NOT NULL, question TEXT, PRIMARY KEY (chat_id, idx));
CREATE TABLE attachments (
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE, turn INTEGER NOT NULL,
    name TEXT NOT NULL, path TEXT NOT NULL, sha256 TEXT NOT NULL, tokens INTEGER NOT NULL,
    tok_start INTEGER NOT NULL, tok_end INTEGER NOT NULL, char_offset INTEGER NOT NULL);
"""
