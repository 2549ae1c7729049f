"""Run under torchrun by test_distributed.py: iterate a FastLoader on gloo and record what this rank saw.

argv: DATASET OUT_DIR BATCH STOP_AFTER [STATE_IN]
Serves epoch 1; with STOP_AFTER >= 0, stops after that many batches and saves the loader state.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from conftest import sample_ids  # noqa: E402

from fastdata.datasets.images import FastDataset  # noqa: E402
from fastdata.loading.loader import FastLoader  # noqa: E402

dataset, out, batch, stop_after = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loader = FastLoader(FastDataset(dataset), batch, seed=7, num_threads=2)  # rank/world from torch.distributed
if len(sys.argv) > 5:
    loader.load_state_dict(json.loads(Path(sys.argv[5]).read_text()))
loader.set_epoch(1)
seen, batches = [], 0
for x, y in loader:
    seen += sample_ids(x).tolist()
    batches += 1
    count = torch.tensor([batches])
    dist.all_reduce(count)  # a collective per step, as DDP does: unequal batch counts would hang here
    if batches == stop_after:
        break
state = loader.state_dict()
(out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "seen": seen, "batches": batches,
                                                   "len": len(loader), "state": state}))
dist.barrier()
dist.destroy_process_group()
