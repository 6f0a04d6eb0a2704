"""specheads: train learned acceptance predictors for speculative decoding."""

__version__ = "0.1.0"
