"""On-disk formats, one module each, with their writers and readers: ``base`` (the resumable unit writer
and ``.npy`` headers), ``image_shards`` (uint8 image ``.npy`` shards), ``lmdb_store`` (JPEG bytes in LMDB:
written from resumable parts, read by ``LmdbReader``), ``token_shards`` (flat token streams, document
offsets and the train/val split hash). Reading ``.npy`` shards into memory is ``fastdata.storage``'s job."""
