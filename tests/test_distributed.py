"""Real torchrun processes on gloo: every sample exactly once across ranks, and resumption with a new world."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import INDEXED_N, torchrun as run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).parent / "dist_loader_worker.py"


def torchrun(nproc: int, out: Path, *args: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    r = run_torchrun(nproc, str(WORKER), *args[:1], str(out), *args[1:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in range(nproc)]


def test_two_ranks_serve_every_sample_once(indexed_datasets, tmp_path):
    ranks = torchrun(2, tmp_path / "run", str(indexed_datasets["npy"]), "8", "-1")
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["len"] == 7  # 50 samples a rank, batches of 8
    seen = Counter(i for r in ranks for i in r["seen"])
    assert set(seen) == set(range(INDEXED_N)) and sum(seen.values()) == INDEXED_N  # 100 divides by 2: no padding
    assert not set(ranks[0]["seen"]) & set(ranks[1]["seen"])


def test_resume_with_a_different_world_size(indexed_datasets, tmp_path):
    first = torchrun(2, tmp_path / "a", str(indexed_datasets["npy"]), "8", "3")
    assert first[0]["state"] == first[1]["state"] and first[0]["state"]["position"] == 48
    state = tmp_path / "state.json"
    state.write_text(json.dumps(first[0]["state"]))
    second = torchrun(3, tmp_path / "b", str(indexed_datasets["npy"]), "8", "-1", str(state))
    assert len({r["batches"] for r in second}) == 1  # equal batch counts on the new world
    before = Counter(i for r in first for i in r["seen"])
    after = Counter(i for r in second for i in r["seen"])
    assert max(before.values()) == 1 and set(before) | set(after) == set(range(INDEXED_N))
    assert not set(before) & set(after)  # nothing served twice across the cut
    assert sum(after.values()) - len(after) <= 2  # only the new world's padding repeats (52 left, 3 ranks)
