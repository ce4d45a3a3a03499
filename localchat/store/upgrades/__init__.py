"""The chats database's schema, one module per version: vN.SQL brings version N - 1 to N.

A new version is a new module here and a row in MIGRATIONS; COLUMNS names what this version reads, so a
file with other tables is refused as not ours.
"""

from __future__ import annotations

import sqlite3

from localchat.errors import UserError
from localchat.store.upgrades import v1, v2

MIGRATIONS = {1: v1.SQL, 2: v2.SQL}  # version -> SQL that brings version - 1 to it
SCHEMA = max(MIGRATIONS)
COLUMNS = {
    "chats": {"id", "name", "title", "model", "policy", "system", "created", "updated", "fed", "kept_units",
              "kept_bytes", "cache_file", "settings"},
    "messages": {"chat_id", "idx", "role", "content", "question"},
    "attachments": {"chat_id", "turn", "name", "path", "sha256", "tokens", "tok_start", "tok_end", "char_offset"},
}


def version(db: sqlite3.Connection, path) -> int:
    """The file's schema version; UserError when a newer localchat wrote it."""
    found = db.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA:
        raise UserError(f"{path} was written by a newer localchat (schema {found}, this one reads {SCHEMA}); "
                        f"upgrade localchat or point LOCALCHAT_DATA_DIR elsewhere")
    return found


def upgrade(db: sqlite3.Connection, path, read_version=version) -> None:
    """Bring the database to SCHEMA. Under the write lock the version is read again: two processes creating one
    new database must not both run the steps (the second would find "table chats already exists")."""
    if read_version(db, path) == SCHEMA:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        for v in range(read_version(db, path) + 1, SCHEMA + 1):
            for statement in MIGRATIONS[v].split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {v}")
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def check(db: sqlite3.Connection) -> None:
    """sqlite3.DatabaseError unless the tables and columns this version reads are there."""
    for table, columns in COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if not columns <= have:
            raise sqlite3.DatabaseError(f"table {table} lacks {', '.join(sorted(columns - have))}")
