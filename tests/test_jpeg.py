"""The JPEG (LMDB) read path: libjpeg-turbo decoding with DCT scaling, Pillow as the fallback, and a
thread-safe first open of the store."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

RACE = textwrap.dedent('''
    import sys, threading
    from fastdata.formats.lmdb_store import LmdbReader

    path, threads = sys.argv[1], 8
    gate, errors = threading.Barrier(threads), []

    def first_read():
        gate.wait()  # every thread reaches the store's first open at the same moment
        try:
            assert len(LmdbReader(path).get_many([0])[0]) > 100
        except Exception as exc:
            errors.append(repr(exc))

    pool = [threading.Thread(target=first_read) for _ in range(threads)]
    [t.start() for t in pool]
    [t.join() for t in pool]
    sys.exit("; ".join(errors) or 0)
''')


def test_threads_opening_a_new_lmdb_at_once_all_read_it(indexed_datasets, tmp_path):
    # Before the lock, two threads could both miss the per-process cache and open the environment twice:
    # "lmdb.Error: The environment ... is already open in this process" (3 of 20 processes in one setup).
    script = tmp_path / "race.py"
    script.write_text(RACE)
    path = str(indexed_datasets["lmdb"] / "images.lmdb")
    procs = [subprocess.Popen([sys.executable, str(script), path], stderr=subprocess.PIPE, text=True)
             for _ in range(24)]
    failures = [p.communicate(timeout=120)[1] for p in procs if p.wait(timeout=120) != 0]
    assert not failures, failures[0][-2000:]
