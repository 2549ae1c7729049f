"""On-disk formats, one module each: ``image_shards`` (uint8 .npy), ``lmdb_store`` (JPEG bytes in LMDB)."""
