"""Exit prediction: SpecEE's features, the per-layer predictor bank, and its calibration."""
from .bank import BankFormatError, BankMismatchError, PredictorBank
from .calibrate import ChatPrompt, calibrate, format_summary, load_calibration_prompts
from .features import FEATURE_LAYOUT, exit_features, spec_rows

__all__ = ["BankFormatError", "BankMismatchError", "PredictorBank", "ChatPrompt", "calibrate", "format_summary",
           "load_calibration_prompts", "FEATURE_LAYOUT", "exit_features", "spec_rows"]
