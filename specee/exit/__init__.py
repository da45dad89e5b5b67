"""Exit prediction: SpecEE's features and the per-layer predictor bank (calibrated by
`specee.calibration`)."""
from .bank import BankFormatError, BankMismatchError, PredictorBank
from .features import FEATURE_LAYOUT, exit_features, spec_rows

__all__ = ["BankFormatError", "BankMismatchError", "PredictorBank", "FEATURE_LAYOUT", "exit_features", "spec_rows"]
