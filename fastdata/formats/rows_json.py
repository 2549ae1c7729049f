"""`Rows` to and from JSON text: a manifest parsed with its long lists compacted a piece at a time
(`loads_with_rows`, NOTE [compact manifest] rule 4 in rows.py), and written as canonical JSON a few thousand
rows at a time (`canonical_pieces`, rule 3)."""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import numpy as np

from .rows import _CHUNK, _HEX, _INT, _TEXT, Rows, compact_rows

_WS = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
_ROW_END = re.compile(r"\}[ \t\n\r]*(?:,[ \t\n\r]*(?=\{)|(\]))")  # a row's end, and the list's
_LIST_END = re.compile(r"\}[ \t\n\r]*(\])")
_PIECE = 1 << 23  # characters of a long list parsed at once (NOTE [compact manifest] rule 4)
_DECODER = json.JSONDecoder()
ROWS = "rows"  # in a `loads_with_rows` layout: a list compacted as it is parsed


class EachKey:
    """In a `loads_with_rows` layout: the same layout for every key of an object (a token manifest's
    splits)."""

    def __init__(self, layout: dict[str, Any]) -> None:
        self.layout = layout

    def get(self, key: str) -> dict[str, Any]:
        return self.layout


def loads_with_rows(text: str, layout: Any) -> Any:
    """``json.loads(text)``, the lists that ``layout`` names (``{"files": ROWS, "splits": EachKey({"shards":
    ROWS})}``) compacted while they are parsed (NOTE [compact manifest] rule 4): equal to the parsed JSON
    with those lists passed through `compact_rows`, without a dict a row for a whole list at any time.

    Raises:
        json.JSONDecodeError: ``text`` is not JSON.
    """
    try:
        value, end = _value(text, _WS.match(text, 0).end(), layout)
        end = _WS.match(text, end).end()
        if end != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    except json.JSONDecodeError:  # json.loads' own words (they differ between Python versions): parsed whole
        json.loads(text)
        raise
    return value


def _value(text: str, i: int, layout: Any) -> tuple[Any, int]:
    if layout is ROWS and text.startswith("[", i):
        return _rows(text, i)
    if layout is not None and layout is not ROWS and text.startswith("{", i):
        return _object(text, i, layout)
    return _DECODER.raw_decode(text, i)


def _object(text: str, i: int, layout: Any) -> tuple[dict[str, Any], int]:
    """The object at ``text[i]`` (a ``{``), each value parsed by its layout; its end."""
    out: dict[str, Any] = {}
    i = _WS.match(text, i + 1).end()
    if text.startswith("}", i):
        return out, i + 1
    while True:
        if not text.startswith('"', i):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = _DECODER.raw_decode(text, i)
        i = _WS.match(text, i).end()
        if not text.startswith(":", i):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        out[key], i = _value(text, _WS.match(text, i + 1).end(), layout.get(key))
        i = _WS.match(text, i).end()
        if text.startswith("}", i):
            return out, i + 1
        if not text.startswith(",", i):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
        i = _WS.match(text, i + 1).end()


def _rows(text: str, i: int) -> tuple[Any, int]:
    """The list at ``text[i]`` (a ``[``) compacted a piece at a time; its end."""
    pos = _WS.match(text, i + 1).end()
    if not text.startswith("{", pos):  # empty, or not rows: as it is
        return _DECODER.raw_decode(text, i)
    pieces: list[Any] = []
    while True:
        # the list's end when it is within a piece's length, else the first row end after that length
        for end in (_LIST_END.search(text, pos, pos + _PIECE), _ROW_END.search(text, pos + _PIECE, pos + 2 * _PIECE)):
            if end is None:
                continue
            try:
                rows = json.loads("[" + text[pos:end.start() + 1] + "]")
            except json.JSONDecodeError:  # cut inside a string or a nested list, or past the list's end
                continue
            pieces.append(compact_rows(rows))
            if end.group(1):
                return _joined(pieces, text, i), end.end()
            pos = end.end()
            break
        else:  # one row at a time, a piece's length
            rows, stop = [], pos + _PIECE
            while True:
                row, pos = _DECODER.raw_decode(text, pos)
                rows.append(row)
                pos = _WS.match(text, pos).end()
                if text.startswith("]", pos):
                    pieces.append(compact_rows(rows))
                    return _joined(pieces, text, i), pos + 1
                if not text.startswith(",", pos):
                    raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
                pos = _WS.match(text, pos + 1).end()
                if pos >= stop:
                    break
            pieces.append(compact_rows(rows))


def _joined(pieces: list[Any], text: str, i: int) -> Any:
    """The pieces of the list at ``text[i]``, compacted each, as `compact_rows` makes the whole list: `Rows`
    when every piece is `Rows` of the same keys and of kinds that join (digests join text as text), else
    the list as json.loads gives it (parsed again whole: a list no column holds, refused by the checks)."""
    first = pieces[0]
    if not all(isinstance(p, Rows) and set(p.keys) == set(first.keys) for p in pieces):
        return _DECODER.raw_decode(text, i)[0]
    if len(pieces) == 1:
        return first
    cols = []
    for key in first.keys:
        parts = [p._cols[p.keys.index(key)] for p in pieces]
        kinds = {c[0] for c in parts}
        if kinds == {_INT} or kinds == {_HEX}:
            cols.append((parts[0][0], np.concatenate([c[1] for c in parts])))
        elif _INT in kinds:  # ints and text: no column, as for the whole list
            return _DECODER.raw_decode(text, i)[0]
        else:
            texts = [c if c[0] == _TEXT else _hex_as_text(c[1]) for c in parts]
            offsets = np.zeros(sum(len(c[2]) - 1 for c in texts) + 1, dtype=np.int64)
            at, base = 0, 0
            for c in texts:
                n = len(c[2]) - 1
                offsets[at + 1:at + n + 1] = c[2][1:] + base
                at, base = at + n, base + int(c[2][-1])
            cols.append((_TEXT, b"".join(c[1] for c in texts), offsets))
    return Rows(first.keys, tuple(cols), sum(len(p) for p in pieces))


def _hex_as_text(digests: np.ndarray) -> tuple[str, bytes, np.ndarray]:
    """A digest column as the text column it would be: 64 hex characters a row."""
    return (_TEXT, digests.tobytes().hex().encode("ascii"), np.arange(len(digests) + 1, dtype=np.int64) * 64)


def canonical_pieces(obj: Any) -> Iterator[str]:
    """``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` in pieces, `Rows`
    written as the lists they hold, a few thousand rows a piece (so a million rows are never dicts at once)."""
    def dumps(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    if isinstance(obj, Rows):
        order = sorted(range(len(obj.keys)), key=lambda k: obj.keys[k])
        row = "{" + ",".join(dumps(obj.keys[k]).replace("%", "%%") + ":%s" for k in order) + "}"
        yield "["
        for start in range(0, len(obj), _CHUNK):
            values = [obj._json_values(k, start, min(start + _CHUNK, len(obj))) for k in order]
            yield ("," if start else "") + ",".join([row % v for v in zip(*values)])
        yield "]"
    elif isinstance(obj, dict) and any(isinstance(v, (dict, list, Rows)) for v in obj.values()):
        yield "{"
        for i, key in enumerate(sorted(obj)):
            yield ("," if i else "") + dumps(key) + ":"
            yield from canonical_pieces(obj[key])
        yield "}"
    elif isinstance(obj, list) and any(isinstance(v, (dict, list, Rows)) for v in obj):
        yield "["
        for i, value in enumerate(obj):
            if i:
                yield ","
            yield from canonical_pieces(value)
        yield "]"
    else:
        yield dumps(obj)

