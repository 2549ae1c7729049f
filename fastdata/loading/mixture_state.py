"""A mixture state checked before it is resumed: saved by this mixture (NOTE [mixture] in
fastdata/datasets/mixture.py), with its sources, options and data, and undamaged."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .schedule import Q

END = 1 << 62  # "num_samples" of a mixture state: past the end of any epoch (MixtureSampler.state_dict)


def check_state(sampler: Any, state: dict[str, Any]) -> None:
    """Refuse a state ``sampler`` (a `MixtureSampler`) cannot resume exactly: another mixture's (seed, mix,
    stop, epoch size, draws a position, sources and their sizes, orders or data versions: named), or a damaged
    one (`_check_shape`).

    Raises:
        ConfigError: what differs, or what is damaged, and what to do.
    """
    m, saved = sampler.mixture, state.get("mixture") if isinstance(state, dict) else None
    if not isinstance(saved, dict) or "segments" not in state:
        raise ConfigError("the state is not a Mixture's (it has no 'mixture' entry): it was saved by a loader "
                          "over one dataset")
    mine = {"seed": m.seed, "mix": m.mix, "stop": m.stop, "epoch_size": m.epoch_size_given}
    for key, value in mine.items():
        if saved.get(key) != value:
            raise ConfigError(f"the state is from another mixture: it was saved with {key}={saved.get(key)!r}, "
                              f"this mixture has {key}={value!r}")
    _check_shape(state)
    unit = saved.get("draws_a_position", sampler.unit)  # (states saved before it was recorded: unchecked)
    if unit != sampler.unit:
        raise ConfigError(f"the state was saved with mix='batch' and batch_size={unit} (a position is a batch "
                          f"of {unit} draws), this loader has batch_size={sampler.batch_size}: resume with "
                          f"batch_size={unit} (any number of ranks)")
    sizes = dict(zip(saved["sources"], saved["sizes"]))
    mine_now = sampler.orders_and_versions()
    for key, said in (("shuffle", "shuffle={} (now {})"), ("shuffle_window", "shuffle_window={} (now {})"),
                      ("versions", "other data: its manifest's sha256 was {}, now {}"),
                      ("keys", "other samples of its data: {} (now {})")):
        then = saved.get(key)
        if not isinstance(then, dict):
            continue  # (a state saved before these were recorded)
        for name, value in then.items():
            now = mine_now[key].get(name, value)
            if name in sizes and now != value:
                raise ConfigError(f"source {name!r} was saved with " + said.format(_short(value), _short(now)) +
                                  ": its order would repeat and skip samples; resume with the sources and "
                                  "options the run started with, or start the run over")
    for name in sizes:
        if name not in m.names:
            raise ConfigError(f"the state has source {name!r}, which this mixture lacks (sources: {m.names})")
    for name, n in zip(m.names, m.sizes):
        if name not in sizes and not m.allow_new_sources:
            raise ConfigError(f"source {name!r} is not in the saved state: pass allow_new_sources=True to Mixture "
                              "(fastdata train: --allow-new-sources) to start it at its epoch 0")
        if name in sizes and sizes[name] != n:
            raise ConfigError(f"source {name!r} has {n} samples but the state's had {sizes[name]}: it is "
                              "another dataset")


def _short(value: Any) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 64 else repr(value)


def _check_shape(state: dict[str, Any]) -> None:
    """Refuse a mixture state whose entries are not what `MixtureSampler.state_dict` writes (a damaged or
    edited state would otherwise resume at a wrong place, or fail later with a bare Python error)."""
    def count(value: Any, what: str) -> None:
        if type(value) is not int or not 0 <= value <= END:
            raise ConfigError(f"the mixture state is damaged: {what} is {value!r}, not an integer in [0, 2**62]; "
                              "load the state the loader saved, unchanged")

    def by_source(value: Any, what: str) -> None:
        if not isinstance(value, dict) or set(value) != set(names):
            raise ConfigError(f"the mixture state is damaged: {what} must give each of its sources {names} a "
                              f"value, got {value!r}; load the state the loader saved, unchanged")
        for name in names:
            count(value[name], f"{what}[{name!r}]")

    saved = state["mixture"]
    names, sizes = saved.get("sources"), saved.get("sizes")
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names) and isinstance(sizes, list)
            and len(sizes) == len(names) and len(set(names)) == len(names)):
        raise ConfigError(f"the mixture state is damaged: its sources {names!r} and sizes {sizes!r} do not match; "
                          "load the state the loader saved, unchanged")
    for k, n in enumerate(sizes):
        count(n, f"sizes[{k}]")
    count(state.get("epoch"), "epoch")
    count(state.get("position"), "position")
    segments = state["segments"]
    if not isinstance(segments, list) or not 1 <= len(segments) <= 2 or not all(isinstance(r, dict) for r in segments):
        raise ConfigError(f"the mixture state is damaged: 'segments' must be a list of one or two records, got "
                          f"{segments!r}; load the state the loader saved, unchanged")
    for i, rec in enumerate(segments):
        for key in ("epoch", "start", "end"):
            count(rec.get(key), f"segments[{i}][{key!r}]")
        for key in ("cursors", "targets", "weights"):
            by_source(rec.get(key), f"segments[{i}][{key!r}]")
        if sum(rec["weights"].values()) != Q:
            raise ConfigError(f"the mixture state is damaged: segments[{i}]'s weights {rec['weights']} do not sum "
                              f"to {Q}; load the state the loader saved, unchanged")
