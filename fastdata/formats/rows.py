"""A manifest's long lists (its files, its shards) held as columns, not as a dict a row.

NOTE [compact manifest]
1. A manifest a dataset opens (`storage.opening.open_path`) holds its per-file and per-shard lists as
   `Rows`: a column per key, integers in an int64 array, text in one UTF-8 buffer with offsets, sha256
   digests as 32 bytes. Parsed JSON keeps a dict, its strings and their hashes for every row: ~1.2 GB in
   every rank at a million shards, and a spawned or forkserver DataLoader worker unpickles a copy of it.
   Columns are a few arrays (`benchmarks/bench_open.py` gives the figures).
2. `Rows` is a read-only sequence of dicts: ``rows[i]`` and iteration build each dict when asked (a copy:
   changing it changes nothing), so code written for a list reads both. What touches every row at opening
   takes whole columns (`column`, `ints`, `pairs`); many rows by their paths come in one pass (`rows_by`);
   a manifest is compacted before it is checked, so the checks read columns too (`suspect_paths`,
   `has_columns`). One row by its path is a search of the text buffer for its first few lookups (an open
   looks up one labels file), then a binary search through the column's order (`Rows.find`).
3. Compacting never changes what a manifest says: a list whose rows have different keys, or values other
   than str and int (bools, floats, nested lists, ints past int64), stays a list; `to_list` gives the rows
   back equal to the parsed ones (keys in the first row's order), and `manifest_digest` streams them to the
   same canonical JSON, written a column at a time (`rows_json.canonical_pieces`, `Rows._json_values`).
   `load_manifest` itself returns plain JSON data, for users who edit or write it.
4. A manifest a dataset opens is compacted while it is parsed (`rows_json.loads_with_rows`): each long list a piece
   of about 8 MB of text at a time, each piece parsed by `json.loads` and compacted, the pieces joined.
   Parsed whole, its dicts were ~1.2 GB at a million shards at the peak of every rank's open, though gone
   once compacted. A piece ends where a row does (``}`` then ``,`` or ``]``); where that text is inside a
   string or a nested list, the piece does not parse and its rows are read one at a time instead. The
   result equals the whole list compacted: a list no column holds (pieces of other keys or kinds) is
   parsed again whole and kept as json.loads gives it, as compacting would have left it.
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

_INT, _TEXT, _HEX = "int", "text", "hex"
_CHUNK = 8192  # rows built at once when iterating or serialising
_SCANS = 8  # lookups of a key that search its buffer before it is sorted (each ~10 ms a million rows)
_UNSURE = object()
_SORTING = threading.Lock()  # one thread sorts a column; the others (the cache's download threads) wait for it
_ESCAPED = re.compile(rb'[\x00-\x1f"\\]')  # bytes JSON writes escaped (ensure_ascii=False)


def _hex_column(joined: str, n: int) -> Optional[np.ndarray]:
    """``(n, 32)`` uint8 when ``joined`` is ``n`` lowercase hex sha256 digests end to end, else None."""
    if len(joined) != 64 * n:
        return None
    try:
        raw = bytes.fromhex(joined)
    except ValueError:
        return None
    # fromhex also takes spaces (then fewer bytes come back) and capitals: only what reads back the same
    if len(raw) != 32 * n or raw.hex() != joined:
        return None
    return np.frombuffer(raw, np.uint8).reshape(n, 32)


def _column(values: Sequence[Any]) -> Optional[tuple[Any, ...]]:
    """One key's values as a column, or None when they are not all str or all int within int64."""
    n = len(values)
    kinds = set(map(type, values))  # (C loops throughout: a million rows are opened by every rank)
    if kinds == {int}:
        try:
            return (_INT, np.array(values, dtype=np.int64))
        except OverflowError:
            return None
    if kinds != {str}:
        return None
    joined = "".join(values)
    digests = _hex_column(joined, n) if set(map(len, values)) == {64} else None
    if digests is not None:
        return (_HEX, digests)
    if joined.isascii():  # a character is a byte: the lengths are the strings' own
        blob, lengths = joined.encode("ascii"), np.fromiter(map(len, values), np.int64, n)
    else:
        encoded = [v.encode("utf-8", "surrogatepass") for v in values]
        blob, lengths = b"".join(encoded), np.fromiter(map(len, encoded), np.int64, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (_TEXT, blob, offsets)


class Rows(Sequence[dict[str, Any]]):
    """A list of flat records (``{"path": str, "bytes": int, "sha256": str}``, a shard's names and counts)
    held as columns (NOTE [compact manifest]); read-only. Make one with `compact_rows`."""

    __slots__ = ("keys", "_cols", "_n", "_index", "_scans")

    def __init__(self, keys: tuple[str, ...], cols: tuple[tuple[Any, ...], ...], n: int) -> None:
        self.keys, self._cols, self._n = keys, cols, n
        self._index: dict[str, tuple[Any, Any]] = {}  # key -> (fixed-width keys, order) or (dict, None): `find`
        self._scans: dict[str, int] = {}  # key -> lookups that searched the buffer

    def __reduce__(self) -> tuple[Any, ...]:  # (arrays and one buffer: a spawned worker gets no row objects)
        return (Rows, (self.keys, self._cols, self._n))

    def __len__(self) -> int:
        return self._n

    def _values(self, k: int, start: int, stop: int) -> list[Any]:
        col = self._cols[k]
        if col[0] == _INT:
            return col[1][start:stop].tolist()
        if col[0] == _HEX:
            return [bytes(d).hex() for d in col[1][start:stop]]
        blob, offsets = col[1], col[2]
        ends = offsets[start:stop + 1].tolist()
        text = blob[ends[0]:ends[-1]].decode("utf-8", "surrogatepass")
        if len(text) == ends[-1] - ends[0]:  # ASCII: slice the text, not the bytes
            base = ends[0]
            return [text[a - base:b - base] for a, b in zip(ends, ends[1:])]
        return [blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip(ends, ends[1:])]

    def _json_values(self, k: int, start: int, stop: int) -> list[str]:
        """Column ``k``'s values as `canonical_pieces` writes them (compact JSON, non-ASCII as it is)."""
        col = self._cols[k]
        if col[0] == _INT:
            return list(map(str, col[1][start:stop].tolist()))
        values = self._values(k, start, stop)
        if col[0] == _HEX or not _ESCAPED.search(col[1], int(col[2][start]), int(col[2][stop])):
            return ['"' + v + '"' for v in values]  # (nothing to escape: the text between quotes)
        return [json.dumps(v, ensure_ascii=False) for v in values]

    def _chunk(self, start: int, stop: int) -> list[dict[str, Any]]:
        columns = [self._values(k, start, stop) for k in range(len(self.keys))]
        return [dict(zip(self.keys, vals)) for vals in zip(*columns)]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = _position(i, self._n)
        return self._chunk(i, i + 1)[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, self._n, _CHUNK):
            yield from self._chunk(start, min(start + _CHUNK, self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Rows, list)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Rows({self._n} rows of {list(self.keys)})"

    def to_list(self) -> list[dict[str, Any]]:
        """The rows as a list of dicts, equal to the list they were made from."""
        return list(self)

    def take(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at ``positions``, each column read once for all of them."""
        pos = np.asarray(positions, dtype=np.int64)
        columns = []
        for col in self._cols:
            if col[0] == _INT:
                columns.append(col[1][pos].tolist())
            elif col[0] == _HEX:
                columns.append([d.hex() for d in map(bytes, col[1][pos])])
            else:
                blob = col[1]
                columns.append([blob[a:b].decode("utf-8", "surrogatepass")
                                for a, b in zip(col[2][pos].tolist(), col[2][pos + 1].tolist())])
        return [dict(zip(self.keys, vals)) for vals in zip(*columns)]

    def column(self, key: str) -> list[Any]:
        """Every row's value of ``key``, in order (KeyError when the rows have no such key)."""
        return self._values(self.keys.index(key), 0, self._n)

    def ints(self, key: str) -> np.ndarray:
        """An int64 column as an array (read-only), without a Python object a row."""
        col = self._cols[self.keys.index(key)]
        if col[0] != _INT:
            raise TypeError(f"{key!r} is not a column of integers")
        out = col[1].view()
        out.flags.writeable = False
        return out

    def find(self, key: str, value: str) -> Optional[int]:
        """The position of the (first) row whose text ``key`` is ``value``, or None. The first few lookups of a
        key search its buffer (`_scan`: an open looks up one labels file); later ones a binary search through
        the column's order, found once (fixed-width bytes and an order: no object a row)."""
        if key not in self._index:
            scans = self._scans.get(key, 0)
            if scans < _SCANS:
                self._scans[key] = scans + 1
                found = self._scan(key, value)
                if found is not _UNSURE:
                    return found
            with _SORTING:
                if key not in self._index:
                    self._index[key] = self._sorted(key)
        keys, order = self._index[key]
        probe = value.encode("utf-8", "surrogatepass")
        if isinstance(keys, dict):
            return keys.get(probe)
        j = int(np.searchsorted(keys, probe, sorter=order))
        if b"\0" not in probe and j < self._n and keys[order[j]] == probe:
            return int(order[j])
        return None

    def find_many(self, key: str, values: Sequence[str]) -> np.ndarray:
        """`find` for many values at once (one sorted search for all of them): the positions, -1 where no
        row has the value."""
        with _SORTING:
            if key not in self._index:
                self._index[key] = self._sorted(key)
        keys, order = self._index[key]
        probes = [v.encode("utf-8", "surrogatepass") for v in values]
        if isinstance(keys, dict) or any(b"\0" in p for p in probes):
            return np.array([-1 if (i := self.find(key, v)) is None else i for v in values], dtype=np.int64)
        if not self._n or not probes:
            return np.full(len(probes), -1, dtype=np.int64)
        wanted = np.array(probes, dtype=keys.dtype if max(map(len, probes)) <= keys.itemsize else None)
        found = order[np.minimum(np.searchsorted(keys, wanted, sorter=order), self._n - 1)]
        return np.where(keys[found] == wanted, found, -1).astype(np.int64)

    def _scan(self, key: str, value: str) -> Any:
        """``find`` by searching the text column's buffer for ``value`` where a row starts and ends there
        (the first such row); `_UNSURE` for another kind of column, an empty value, or a value found inside
        many longer rows first."""
        col = self._cols[self.keys.index(key)]
        probe = value.encode("utf-8", "surrogatepass")
        if col[0] != _TEXT or not probe:
            return _UNSURE
        blob, offsets = col[1], col[2]
        at = blob.find(probe)
        for _ in range(64):
            if at < 0:
                return None
            j = int(np.searchsorted(offsets, at, side="right")) - 1  # (the last row starting there: others are empty)
            if offsets[j] == at and offsets[j + 1] == at + len(probe):
                return j
            at = blob.find(probe, at + 1)
        return _UNSURE

    def _sorted(self, key: str) -> tuple[Any, Any]:
        col = self._cols[self.keys.index(key)]
        if col[0] == _TEXT and b"\0" not in col[1]:  # (numpy's bytes drop trailing NULs: none may be there)
            lengths = np.diff(col[2])
            if len(lengths) and (lengths == lengths[0]).all() and lengths[0] > 0:
                keys = np.frombuffer(col[1], dtype=f"S{int(lengths[0])}")  # the buffer itself
            else:  # each row padded with NULs to the longest (as numpy's bytes compare), without a row object
                width, starts = max(1, int(lengths.max(initial=0))), col[2][:-1]
                blob, padded = np.frombuffer(col[1], dtype=np.uint8), np.zeros((self._n, width), dtype=np.uint8)
                for j in range(width):  # (a byte column at a time: no index array as long as the buffer)
                    has = np.flatnonzero(lengths > j)
                    padded[has, j] = blob[starts[has] + j]
                keys = padded.view(f"S{width}").ravel()
            return keys, np.argsort(keys, kind="stable")  # (equal widths: the order is all that is added)
        found: dict[bytes, int] = {}  # (digests, integers, text with NULs: rare; a dict serves them)
        for i, v in enumerate(self.column(key)):
            found.setdefault(str(v).encode("utf-8", "surrogatepass"), i)
        return found, None


def _position(i: Any, n: int) -> int:
    """Row ``i`` of ``n`` as a position (from the end when negative); IndexError outside them."""
    i = int(i) + (n if int(i) < 0 else 0)
    if not 0 <= i < n:
        raise IndexError(f"row {i} of {n}")
    return i


class Column(Sequence[Any]):
    """One column of `Rows` read as a sequence (a shard's file names), each value made when asked: a view
    that keeps no object a row."""

    __slots__ = ("_rows", "_k")

    def __init__(self, rows: Rows, key: str) -> None:
        self._rows, self._k = rows, rows.keys.index(key)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = _position(i, len(self))
        return self._rows._values(self._k, i, i + 1)[0]

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self), _CHUNK):
            yield from self._rows._values(self._k, start, min(start + _CHUNK, len(self)))

    def rows_among(self, values: Sequence[str]) -> np.ndarray:
        """The rows whose value is one of ``values`` (the first row, for a value held twice): `Rows.find_many`,
        no value made a row."""
        at = self._rows.find_many(self._rows.keys[self._k], values)
        return at[at >= 0]


class Pairs(Sequence[tuple[Any, Any]]):
    """Two columns of `Rows` read as ``(a, b)`` tuples (a shard's file and its rows), each made when asked."""

    __slots__ = ("_a", "_b")

    def __init__(self, rows: Rows, a: str, b: str) -> None:
        self._a, self._b = Column(rows, a), Column(rows, b)

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._a[i], self._b[i]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        return zip(self._a, self._b)


def unzipped(items: Sequence[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """The first and the second values of ``items`` (`Pairs`: its two columns, no tuple built)."""
    if isinstance(items, Pairs):
        return list(items._a), list(items._b)
    return [a for a, _ in items], [b for _, b in items]


def pairs(rows: Sequence[dict[str, Any]], a: str, b: str) -> Sequence[tuple[Any, Any]]:
    """Each row's ``(a, b)``: a view of `Rows` (no tuple kept a row), a list for a list of dicts."""
    return Pairs(rows, a, b) if isinstance(rows, Rows) else [(r[a], r[b]) for r in rows]


def compact_rows(items: Any) -> Any:
    """``items`` as `Rows` when it is a non-empty list of dicts with the same keys whose values are all str
    or all int for each key (NOTE [compact manifest] rule 3), else ``items`` itself."""
    if isinstance(items, Rows) or not isinstance(items, list) or not items or set(map(type, items)) != {dict}:
        return items
    keys = tuple(items[0])
    if not keys or sum(map(len, items)) != len(keys) * len(items):
        return items
    try:  # every row has each key, and no more (the lengths add up): the same keys
        values = [[r[key] for r in items] for key in keys]  # (no tuple a row: the collector would walk them)
    except KeyError:
        return items
    cols = []
    for column_values in values:
        col = _column(column_values)
        if col is None:
            return items
        cols.append(col)
    return Rows(keys, tuple(cols), len(items))


_NO_DEFAULT = object()


def column(rows: Sequence[dict[str, Any]], key: str, default: Any = _NO_DEFAULT) -> list[Any]:
    """Every row's ``key``, from `Rows` or a list of dicts; ``default`` where a row has none (when given)."""
    if default is _NO_DEFAULT:
        return rows.column(key) if isinstance(rows, Rows) else [r[key] for r in rows]
    if isinstance(rows, Rows):
        return rows.column(key) if key in rows.keys else [default] * len(rows)
    return [r.get(key, default) for r in rows]


def column_view(rows: Sequence[dict[str, Any]], key: str, default: Any = _NO_DEFAULT) -> Sequence[Any]:
    """`column` as a sequence: a `Column` view of `Rows` that have ``key`` (no object kept a row), else the
    list `column` makes."""
    if isinstance(rows, Rows) and key in rows.keys:
        return Column(rows, key)
    return column(rows, key, default)


def suspect_paths(rows: Sequence[dict[str, Any]], key: str = "path") -> list[Any]:
    """The values of ``key`` that may not be plain relative paths (NOTE [manifest paths] in _io.py): every
    value of a list; of `Rows`, the empty ones, those starting with ``/``, holding ``..`` or a NUL, found by
    whole-buffer tests (a million paths are checked at every open). Digests are never suspect."""
    if not isinstance(rows, Rows):
        return column(rows, key)
    col = rows._cols[rows.keys.index(key)]
    if col[0] != _TEXT:
        return [] if col[0] == _HEX else rows.column(key)
    data, offsets = np.frombuffer(col[1], np.uint8), col[2]
    starts, lengths = offsets[:-1], np.diff(offsets)
    odd = lengths == 0
    odd[~odd] = data[starts[~odd]] == ord("/")
    dots = np.flatnonzero((data[:-1] == ord(".")) & (data[1:] == ord(".")))
    row = np.searchsorted(offsets, dots, side="right") - 1
    odd[row[offsets[row + 1] > dots + 1]] = True  # (a `..` inside a row, not a row ending and the next starting `.`)
    odd[np.searchsorted(offsets, np.flatnonzero(data == 0), side="right") - 1] = True  # a NUL: no path has one
    return [r[key] for r in rows.take(np.flatnonzero(odd))]


def int_column(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """Every row's integer ``key`` as an int64 array (read-only for `Rows`: its own column)."""
    return rows.ints(key) if isinstance(rows, Rows) else np.array(column(rows, key), dtype=np.int64)


def present(rows: Sequence[dict[str, Any]], key: str) -> list[Any]:
    """The ``key`` of every row that has one, from `Rows` or a list of dicts."""
    if isinstance(rows, Rows):
        return rows.column(key) if key in rows.keys else []
    return [r[key] for r in rows if key in r]


def lookup(rows: Sequence[dict[str, Any]], key: str = "path") -> Callable[[str], Optional[dict[str, Any]]]:
    """``row_of(value)``: the (first) row whose ``key`` is ``value``, or None; a binary search in `Rows`, a
    dict made once for a list."""
    if isinstance(rows, Rows):
        def row_of(value: str) -> Optional[dict[str, Any]]:
            i = rows.find(key, value)
            return None if i is None else rows[i]
        return row_of
    table: dict[str, dict[str, Any]] = {}
    for r in rows:
        table.setdefault(r[key], r)
    return table.get


def rows_by(rows: Sequence[dict[str, Any]], values: Iterable[str], key: str = "path") -> dict[str, dict[str, Any]]:
    """The (first) row whose ``key`` is each of ``values``, by that value; a value no row has is left out.
    For many values at once: one pass over the column, no search a value."""
    wanted = set(values)
    if isinstance(rows, Rows):
        at: dict[str, int] = {}
        for i, v in enumerate(rows.column(key)):
            if v in wanted and v not in at:
                at[v] = i
        return dict(zip(at, rows.take(list(at.values()))))
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r[key] in wanted and r[key] not in out:
            out[r[key]] = r
    return out


def has_columns(rows: Any, ints: tuple[str, ...] = (), texts: tuple[str, ...] = ()) -> bool:
    """``rows`` is `Rows` or a list of dicts, and every row has each of ``ints`` as an int >= 0 within int64
    (not a bool) and each of ``texts`` as a str."""
    if isinstance(rows, Rows):
        kinds = dict(zip(rows.keys, (c[0] for c in rows._cols)))
        return (all(kinds.get(k) == _INT and (not len(rows) or rows.ints(k).min() >= 0) for k in ints)
                and all(kinds.get(k) in (_TEXT, _HEX) for k in texts))
    return isinstance(rows, list) and all(
        isinstance(r, dict) and all(type(r.get(k)) is int and 0 <= r[k] < 1 << 63 for k in ints)
        and all(isinstance(r.get(k), str) for k in texts) for r in rows)


def is_rows(value: Any) -> bool:
    """A list of rows, or `Rows`: what a manifest's lists may be once read."""
    return isinstance(value, (list, Rows))
