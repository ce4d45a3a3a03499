"""Schema 2: the settings a chat was last answered with (policy and its parameters, positions, chunk, --kv)."""

SQL = "ALTER TABLE chats ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';"
