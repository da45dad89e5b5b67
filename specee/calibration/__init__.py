"""Offline training of what decoding reads: the EAGLE draft head (`train_draft`).

Outside the engine's import graph: the engine loads what this package writes, never imports it.
"""
from .train_draft import Recipe, train_draft

__all__ = ["Recipe", "train_draft"]
