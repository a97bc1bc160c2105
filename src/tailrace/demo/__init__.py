"""The bundled pipelines: ``wiki-qa.yaml`` (RAG over Wikipedia, run by ``tailrace demo``
and the default of ``tailrace eval``) and ``text-stats.yaml`` (text statistics over
``sample.jsonl`` with the functions of ``textops``; no model needed)."""
