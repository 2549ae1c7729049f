"""Pixels: decoding files and JPEG records, libjpeg-turbo, the random crop draws, the transforms."""
