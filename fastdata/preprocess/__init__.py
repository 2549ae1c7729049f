"""Offline preprocessing: ``images`` (decode, resize, shard) and its helpers."""
