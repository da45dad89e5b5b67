"""Draft-and-verify speculative decoding: chains and EAGLE-2 trees, greedy and sampled."""
from .speculative import SpecStats, SpeculativeDecoding
from .tree import TreeShape

__all__ = ["SpecStats", "SpeculativeDecoding", "TreeShape"]
