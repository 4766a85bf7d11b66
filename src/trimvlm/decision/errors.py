"""What can be wrong with a System One request, as `InputError`s (so every caller of trimvlm sees one hierarchy).

A server maps them to status codes: `RequestError` is the request's shape (422 in `transformers serve`), a
`QuestionError` or `AssetError` a bad question or image in a well-formed request (400); `DecisionError` itself
is anything else the prompts could not be built from (the decision config's template or labels).
"""

from __future__ import annotations

from trimvlm.errors import InputError


class DecisionError(InputError):
    """A decision request could not be answered as given. `index`: the request's place in a batch (or None)."""

    index: int | None = None

    def at(self, index: int | None) -> DecisionError:
        """The same error, its message naming request `index` of a batch."""
        if index is None:
            return self
        err = type(self)(f"request {index}: {self}")
        err.index = index
        return err


class RequestError(DecisionError):
    """The request is not `{"state": ..., "questions": {name: question}, "assets": {placeholder: image}}`."""


class QuestionError(DecisionError):
    """A question is invalid (unknown type, bad criteria, more options than labels) or there are too many."""


class AssetError(DecisionError):
    """An asset is not a decodable image, is not referenced by the request, or the model reads no images."""
