"""The read side: FastDataset (images), TokenDataset, fields, splits."""
