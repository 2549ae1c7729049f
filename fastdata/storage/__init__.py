"""Where a dataset's bytes live while training: ``shards`` opens ``.npy`` shards as memory maps, one RAM
copy, the node's ``/dev/shm`` copy (``shm``) or GPU memory, checking them against the manifest."""
