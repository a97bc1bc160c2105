"""Command line: ``tailrace run | plan | demo | ingest | eval | serve`` (``main`` parses
and dispatches; ``demo``, ``ingest``, ``evaluate`` and ``serve`` hold the larger commands,
``jsonl`` the reading and writing of JSONL records)."""
