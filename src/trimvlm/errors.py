"""One error hierarchy: every message says what was wrong and what is allowed (and, for a mistyped name, the
names it was likely meant to be: `did_you_mean`). A warning points at the user's line: `caller_stacklevel`."""

import difflib
import os
import sys


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


class PluginError(TrimVLMError):
    """An installed package's method plugin (entry-point group `trimvlm.methods`) failed to load."""


def did_you_mean(name, known) -> str:
    """`"; did you mean X?"` (or `X or Y`) naming the known names closest to `name` (difflib's similarity
    ratio of at least 0.7, up to three), to end an error message with; `""` when none is close. `known`: the
    names, or a mapping from each name compared to the text shown for it."""
    pairs = known.items() if isinstance(known, dict) else ((k, k) for k in known)
    shown = {str(k): str(v) for k, v in pairs}
    close = difflib.get_close_matches(str(name), sorted(shown), n=3, cutoff=0.7)
    return f"; did you mean {' or '.join(shown[c] for c in close)}?" if close else ""


def caller_stacklevel(packages=("trimvlm", "torch")) -> int:
    """The `stacklevel` that makes a `warnings.warn` in the function calling this one point at the user's
    line: the first frame, walking out, whose file lies outside these packages (trimvlm's own calls and
    torch's decorators, such as `torch.inference_mode`, are skipped; Python 3.11 has no
    `skip_file_prefixes`)."""
    roots = tuple(
        os.path.dirname(module.__file__) + os.sep
        for module in map(sys.modules.get, packages)
        if module is not None and getattr(module, "__file__", None)
    )
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    return level
