"""Offline training of what decoding reads: the exit predictor bank (`calibrate`, see
`exit_bank`) and the EAGLE draft head (`train_draft`).

Outside the engine's module-level import graph: the engine loads what this package writes;
only `LLM.calibrate` imports `calibrate`, when a bank must be made (the CLI asks before the first request;
the API on first use).
"""
from .exit_bank import calibrate, format_summary
from .prompts import ChatPrompt, load_calibration_prompts
from .train_draft import Recipe, train_draft

__all__ = ["calibrate", "format_summary", "ChatPrompt", "load_calibration_prompts", "Recipe", "train_draft"]
