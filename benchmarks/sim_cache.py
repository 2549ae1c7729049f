"""Bytes each node downloads per epoch from object storage, for datasets far larger than any run here:
pure arithmetic on the real order code (``fastdata.loading.order.EpochOrder``), no data.

A node reads its windows (K shards, read together) one after another, then its pieces of the pool at
the end of the epoch (NOTE [streamed order]); its cache holds ``cache`` bytes. Per node and epoch, the
shards downloaded under:
- fastdata: evict the shard whose next use is farthest, knowing this epoch's and the next one's order
  (what ``ShardCache`` knows: ``FastLoader`` plans the rest of the epoch and the next; its prefetches,
  which may evict a little earlier within a lookahead of a quarter of the cache, are not modelled:
  bench_remote_cache.py measures the real cache at 1.00x the optimum for its order);
- optimum: the same rule knowing every epoch (Belady: no policy downloads less for this order);
- LRU: least recently used goes first (Mosaic streaming's rule);
- "not dealt": windows not dealt to nodes (every rank reads every window: fastdata before this, and
  a per-sample shuffle): each node reads all of the data every epoch, so even the optimum downloads
  the dataset less its cache every warm epoch (arithmetic).
Reported as GB per node per epoch, epoch 1 (cold) and the mean of epochs 2..E, beside the node's share
of the data (the least a cold epoch can download).

    python benchmarks/sim_cache.py                       # the RESULTS.md table
    python benchmarks/sim_cache.py --dataset 10TB --shard 256MB --cache 1TB --nodes 1 8 64 --window 16
"""
from __future__ import annotations

import argparse
import heapq
import time
from collections import OrderedDict

import numpy as np

from fastdata.loading.order import EpochOrder
from fastdata.storage.opening import parse_size

INF = 1 << 62
PRESETS = [  # (name, dataset, shard, sample, caches per node)
    ("ImageNet-1k as npy", "150GB", "256MB", "150KB", ["25GB", "75GB"]),
    ("10 TB", "10TB", "256MB", "150KB", ["500GB", "2TB"]),
    ("1 PB", "1PB", "1GB", "150KB", ["4TB", "16TB"]),
]


def node_steps(order: EpochOrder, node: int) -> list[np.ndarray]:
    """The shard sets ``node`` reads in one epoch, in order: its windows, then its pieces of the tail."""
    steps = [order.window_shards(node, w) for w in range(len(order.cum[node]) - 1)]
    offsets, streams, firsts = order.tails[node]
    for c, first, count in zip(streams.tolist(), firsts.tolist(), np.diff(offsets).tolist()):
        if c == node or count == 0:
            continue  # its own leftovers: read with its windows
        cum = order.cum[c]
        for w in range(int(np.searchsorted(cum, first, "right")) - 1, int(np.searchsorted(cum, first + count))):
            steps.append(order.window_shards(c, w))
    return steps


def simulate(epochs: list[list[np.ndarray]], slots: int, policy: str) -> list[int]:
    """Shards downloaded per epoch by a cache of ``slots`` shards; ``policy``: fastdata, optimum, lru."""
    flat = [(e, step) for e, steps in enumerate(epochs) for step in steps]
    epoch_end = np.cumsum([len(steps) for steps in epochs])  # step index where each epoch ends
    nxt: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(flat)  # per step: next step reading each shard
    seen: dict[int, int] = {}
    reads: dict[int, list[int]] = {}  # shard -> the steps reading it, descending
    for i in range(len(flat) - 1, -1, -1):
        shards = flat[i][1]
        nxt[i] = np.array([seen.get(s, INF) for s in shards.tolist()], dtype=np.int64)
        for s in shards.tolist():
            seen[s] = i
            reads.setdefault(s, []).append(i)
    downloads = [0] * len(epochs)
    if policy == "lru":
        lru: OrderedDict[int, None] = OrderedDict()
        for i, (e, shards) in enumerate(flat):
            now = set(shards.tolist())
            for s in shards.tolist():
                if s in lru:
                    lru.move_to_end(s)
                    continue
                downloads[e] += 1
                while len(lru) >= slots:
                    victim = next((v for v in lru if v not in now), None)
                    if victim is None:
                        break
                    del lru[victim]
                lru[s] = None
        return downloads
    key: dict[int, int] = {}  # cached shard -> its next use as last recorded
    heap: list[tuple[int, int]] = []  # (-next use, shard), lazily cleaned
    starts = set((epoch_end - np.array([len(steps) for steps in epochs])).tolist())
    for i, (e, shards) in enumerate(flat):
        horizon = INF if policy == "optimum" else int(epoch_end[min(e + 1, len(epochs) - 1)])
        if policy == "fastdata" and i in starts:  # a new epoch's plan: the cached shards' next uses, seen afresh
            for c in key:
                later = [j for j in reads[c] if j >= i]  # (descending: the last is the soonest)
                key[c] = later[-1] if later and later[-1] < horizon else INF
            heap = [(-u, c) for c, u in key.items()]
            heapq.heapify(heap)
        now = set(shards.tolist())
        held: list[tuple[int, int]] = []
        for s, use in zip(shards.tolist(), nxt[i].tolist()):
            use = use if use < horizon else INF  # fastdata sees this epoch and the next
            if s not in key:
                downloads[e] += 1
                while len(key) >= slots and heap:
                    neg, victim = heapq.heappop(heap)
                    if key.get(victim) != -neg:
                        continue  # stale entry
                    if victim in now:
                        held.append((neg, victim))  # read by this very step: keep
                        continue
                    del key[victim]
            key[s] = use
            heapq.heappush(heap, (-use, s))
        for item in held:
            heapq.heappush(heap, item)
    return downloads


def run(dataset: int, shard: int, sample: int, cache: int, nodes: int, ranks: int, window: int, epochs: int,
        seed: int = 0) -> dict[str, float]:
    n_shards = -(-dataset // shard)
    per_shard = max(1, shard // sample)
    counts = np.full(n_shards, per_shard, dtype=np.int64)
    counts[-1] = max(1, (dataset - (n_shards - 1) * shard) // sample)  # the short last shard
    bounds = np.r_[0, np.cumsum(counts)]
    orders = [EpochOrder(int(bounds[-1]), seed, e, window=window, bounds=bounds, layout=(nodes, ranks))
              for e in range(epochs)]
    slots = max(1, cache // shard)
    gb = shard / 1e9
    out: dict[str, list[list[int]]] = {p: [] for p in ("fastdata", "optimum", "lru")}
    for node in range(min(nodes, n_shards)):
        steps = [node_steps(o, node) for o in orders]
        for policy in out:
            out[policy].append(simulate(steps, slots, policy))
    row: dict[str, float] = {"share": dataset / nodes / 1e9}
    for policy, per_node in out.items():
        arr = np.array(per_node, dtype=np.float64) * gb  # nodes x epochs, GB
        row[f"{policy}_cold"] = float(arr[:, 0].max())
        row[f"{policy}_warm"] = float(arr[:, 1:].mean(axis=1).max())
    row["not_dealt_warm"] = max(0, dataset - cache) / 1e9  # every node reads all: Belady keeps its cache's worth
    return row


def gb(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset"), ap.add_argument("--shard"), ap.add_argument("--sample", default="150KB")
    ap.add_argument("--cache", nargs="*")
    ap.add_argument("--nodes", nargs="*", type=int, default=[1, 8, 64, 512])
    ap.add_argument("--ranks", type=int, default=8, help="ranks a node")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    presets = ([("custom", a.dataset, a.shard, a.sample, a.cache)] if a.dataset else PRESETS)
    print(f"window {a.window} shards, {a.ranks} ranks a node, {a.epochs} epochs; GB per node per epoch "
          "(the worst node): cold = epoch 1, warm = mean of the later epochs")
    print("| dataset | shard | cache/node | nodes | node's share | fastdata cold / warm | optimum cold / warm "
          "| LRU cold / warm | not dealt: cold / warm | fastdata ÷ optimum (all epochs) | sim s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, dataset, shard, sample, caches in presets:
        for cache in caches:
            for nodes in a.nodes:
                t = time.perf_counter()
                r = run(parse_size(dataset), parse_size(shard, "shard"), parse_size(sample, "sample"),
                        parse_size(cache), nodes, a.ranks, a.window, a.epochs)
                best = r["optimum_cold"] + r["optimum_warm"]
                ratio = (r["fastdata_cold"] + r["fastdata_warm"]) / best if best else 1.0
                print(f"| {name} | {shard} | {cache} | {nodes} | {gb(r['share'])} "
                      f"| {gb(r['fastdata_cold'])} / {gb(r['fastdata_warm'])} "
                      f"| {gb(r['optimum_cold'])} / {gb(r['optimum_warm'])} "
                      f"| {gb(r['lru_cold'])} / {gb(r['lru_warm'])} "
                      f"| {gb(parse_size(dataset) / 1e9)} / {gb(r['not_dealt_warm'])} | {ratio:.3f} "
                      f"| {time.perf_counter() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
