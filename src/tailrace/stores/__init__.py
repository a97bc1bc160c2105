"""Stores: the saved vector index (faiss, ``vector_index``), the live index that streams
upserts and deletes (``live_index`` on the snapshot and log files of ``live_store``),
structured memory of turns and facts (``memory``: SQLite or PostgreSQL), the bundled
corpus (``corpus``) and atomic directory versions (``atomic``)."""
