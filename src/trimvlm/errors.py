"""One error hierarchy: every message says what was wrong and what is allowed."""


class TrimVLMError(Exception):
    """Base class of every error trimvlm raises on purpose."""


class UnsupportedModelError(TrimVLMError):
    """The checkpoint's model family has no adapter."""


class CheckpointError(TrimVLMError):
    """A checkpoint path is missing or is not a supported checkpoint folder."""


class InputError(TrimVLMError):
    """A user input (image, prompt, candidate list, limit...) is invalid."""


class RecipeError(TrimVLMError):
    """A recipe names an unknown method/option or a value out of range."""
