"""Stores: the vector index (faiss) and, later, state and memory stores."""
