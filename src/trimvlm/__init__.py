"""trimvlm: cheaper VLM inference without retraining, with honest measurements."""

from trimvlm.errors import TrimVLMError

__version__ = "0.1.0"
__all__ = ["TrimVLMError", "__version__"]
