"""Candidate scoring (FastJEV): encode image + question once, score many candidates as branches of one shared,
uncopied prefix; executors `independent`, `batched`, `segments`, `tree`, `auto`; readouts `loglik` and `head`;
decision-guided calibration of candidate layers."""

from trimvlm.scoring.request import CandidateScore, ScoreBatch, ScoreRequest, ScoreResult

__all__ = ["CandidateScore", "ScoreBatch", "ScoreRequest", "ScoreResult"]
