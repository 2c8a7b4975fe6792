"""What training (oomb.train) and evaluation (oomb.eval) both read: token sources (tokens.py: the
copy task, token files, their windows), document files (documents.py), text as ids (codec.py),
key-value needles (needles.py) and single-token recall pairs (recall.py)."""
