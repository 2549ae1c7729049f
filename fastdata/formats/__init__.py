"""The on-disk contract, one module per job, each format's writer beside its reader: ``manifest`` (the
index written last, its checksums and versions), ``schema`` (sample fields), ``tokenizer``, ``base`` (the
resumable unit writer and ``.npy`` headers), ``image_shards`` (uint8 image ``.npy`` shards),
``lmdb_store`` (JPEG bytes in LMDB: written from resumable parts, read by ``LmdbReader``),
``token_shards`` (flat token streams, document offsets and the train/val split hash). Reading ``.npy``
shards into memory is ``fastdata.storage``'s job."""
