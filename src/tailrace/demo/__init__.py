"""The bundled demo pipeline (text statistics) used by ``tailrace demo``."""
