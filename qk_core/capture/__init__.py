"""Q/K capture (SPEC 1): sampling, layer metadata, the AttentionInterface capture function, the run.

Heavy imports (torch, transformers) happen inside the functions of :mod:`qk_core.capture.run`, so
importing this package stays cheap.
"""

from qk_core.capture.run import CaptureResult, capture_model

__all__ = ["CaptureResult", "capture_model"]
