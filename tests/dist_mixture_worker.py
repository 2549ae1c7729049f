"""Run under torchrun by test_mixture.py: serve a Mixture with FastLoader on gloo and record what this rank saw.

argv: CONFIG_JSON OUT_DIR. The config: ``sets`` ({name: dataset folder}), ``weights``, ``seed``, ``batch``,
``stop_after`` (batches, -1: the whole epoch) and ``state`` (a state file to resume from, or null).
Each rank writes rank{r}.json: every batch's rows as ``[tag, id]`` pairs (tests/test_mixture.py tags_ids).
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from test_mixture import tags_ids  # noqa: E402

from fastdata.datasets.images import FastDataset  # noqa: E402
from fastdata.datasets.mixture import Mixture  # noqa: E402
from fastdata.loading.loader import FastLoader  # noqa: E402

cfg, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mix = Mixture({k: FastDataset(v) for k, v in cfg["sets"].items()}, weights=cfg["weights"], seed=cfg["seed"])
loader = FastLoader(mix, cfg["batch"], num_threads=2)  # rank/world from torch.distributed
if cfg.get("state"):
    loader.load_state_dict(json.loads(Path(cfg["state"]).read_text()))
batches = []
for x, y in loader:
    tag, ids = tags_ids(x)
    batches.append([[int(t), int(i)] for t, i in zip(tag, ids)])
    count = torch.tensor([len(batches)])
    dist.all_reduce(count)  # a collective per step, as DDP does: unequal batch counts would hang here
    if len(batches) == cfg["stop_after"]:
        break
(out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "batches": batches,
                                                   "len": len(loader), "state": loader.state_dict()}))
dist.barrier()
dist.destroy_process_group()
