"""``confkv serve``: an OpenAI-compatible server whose requests each state their KV memory.

- :mod:`~confkv.serve.engine`: the scheduler (one loop, one cache per row, round-robin steps).
- :mod:`~confkv.serve.app`: the FastAPI app (completions, chat, SSE, models, health, metrics).
- :mod:`~confkv.cli.serve`: the ``serve`` subcommand (uvicorn).

Needs the optional extra: ``pip install "confkv[serve]"``.
"""
