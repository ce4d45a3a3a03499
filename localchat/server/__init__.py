"""`localchat serve`: an OpenAI- and Ollama-compatible HTTP server over the engine, Session and Store of the CLI.

- turns.py: a chat request as one value (messages, generation settings), and BadRequest, the 4xx it may raise;
- openai.py, ollama.py: each API's request fields and response shapes;
- conversations.py: finds the conversation a request continues (by its messages), keeps some in memory (LRU) and
  saves every answered turn in the store, so a follow-up reads only its new messages, after a restart too;
- worker.py: the one thread that runs the engine, one request at a time in arrival order, from a bounded queue;
- app.py: the routes (Starlette), body limits, disconnects; serve.py: the command, uvicorn.

Starlette + uvicorn, not FastAPI: both are pure Python (about 0.9 MB each installed) and import in about 0.18 s
together, where FastAPI adds pydantic (about 10 MB, a compiled core) and imports in about 0.6 s; the requests are
checked by hand anyway, to answer with one sentence that names the field.
"""
