"""The bundled pipelines: ``wiki-qa-escalate.yaml`` (verified RAG over Wikipedia: a small
model answers, a larger one when the answer is not grounded in the retrieved page; run by
``tailrace demo`` and the default of ``tailrace eval``), ``wiki-qa.yaml`` (the same RAG
with the small model alone) and ``text-stats.yaml`` (text statistics over ``sample.jsonl``
with the functions of ``textops``; no model needed)."""
