"""System One decision requests through trimvlm (docs/decisions.md).

transformers' `decision` package parses the requests, renders and tokenizes the prompts and turns option
scores into answers; trimvlm runs every prompt of every request in one batch through its runner, with a
recipe, and reads the label logits (any supported VLM) or a decision model's head (JevForDecision).
"""

from trimvlm.decision.costs import RequestCosts
from trimvlm.decision.decide import DecisionResult, decide, run
from trimvlm.decision.errors import AssetError, DecisionError, QuestionError, RequestError
from trimvlm.decision.limits import Limits
from trimvlm.decision.prompts import PreparedRequest, prepare_request

__all__ = [
    "AssetError",
    "DecisionError",
    "DecisionResult",
    "Limits",
    "PreparedRequest",
    "QuestionError",
    "RequestCosts",
    "RequestError",
    "decide",
    "prepare_request",
    "run",
]
