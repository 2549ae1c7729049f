"""The epoch's order, the distributed sampler, FastLoader and its threads."""
