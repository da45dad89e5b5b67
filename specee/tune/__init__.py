"""`specee tune`: the fastest lossless decoding mode measured on the user's machine (measure.py), stored
per model, machine and thread count for `generate`, `chat` and `serve` to use (profile.py)."""
