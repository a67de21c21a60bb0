"""Lines of a JSONL text, as JSONL defines them: split on ``"\\n"`` only.

Why not ``str.splitlines``: it also ends a line at U+2028, U+2029, ``\\x85``, ``\\x0b``, ``\\x0c``
and ``\\x1c``-``\\x1e``. JSON allows U+2028, U+2029 and ``\\x85`` unescaped inside a string (and
``json.dumps(..., ensure_ascii=False)`` writes them so), so ``splitlines`` cuts such a record in
two and a valid file reads as "Unterminated string". One reader for every JSONL file: prompt and
preference files (:mod:`nrl_tasks.stages.data`) and ``metrics.jsonl`` (:mod:`flows.observe.metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["jsonl_lines"]


def jsonl_lines(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for each line of ``text`` that is not blank, numbered from 1 by
    ``"\\n"``; a ``"\\r\\n"`` line end loses its ``"\\r"``, a last line needs no line end.

    >>> list(jsonl_lines('{"a": "x\\u2028y"}\\r\\n\\n{}'))
    [(1, '{"a": "x\\u2028y"}'), (3, '{}')]
    """
    for n, line in enumerate(text.split("\n"), start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if line.strip():
            yield n, line
