"""Offline preprocessing: ``images`` and ``text`` (the two entry points), ``sources`` (finding the input
files), ``parallel`` (ordered worker pools), ``journal`` (resuming a killed run). Decoding an image is
``fastdata.imaging.decode_file``'s job, shared with the readers; the tokenizers are ``fastdata.formats.tokenizer``'s."""
