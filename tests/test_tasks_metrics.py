"""The benchmarks' metrics on hand-made cases: ANLS thresholds, the 10-answer VQA rule with the official
normalisation, POPE's F1 and predicted-yes ratio, option letters in free text, ChartQA's relaxed accuracy, MM-Vet's
local containment check."""

import pytest

from trimvlm.evals import metrics as M
from trimvlm.evals.open_match import open_match
from trimvlm.evals.relaxed_accuracy import relaxed_accuracy
from trimvlm.evals.vqa_accuracy import normalize_vqa_answer, vqa_accuracy

# --------------------------------------------------------------------------------------------- ANLS


def test_anls_threshold_edges():
    # NL = 2/5 = 0.4 < 0.5: similarity 0.6
    assert M.anls("abcxx", "abcde") == pytest.approx(0.6)
    # NL = 1/2 exactly: not below the threshold, 0
    assert M.anls("ab", "ax") == 0.0
    # NL = 3/5 = 0.6 above: 0
    assert M.anls("abxxx", "abcde") == 0.0
    assert M.anls("ab", "ax", threshold=0.6) == pytest.approx(0.5)  # the threshold is a parameter
    assert M.anls("  The  DATE ", ["date", "the date"]) == 1.0  # case and spaces ignored, max over references
    assert M.get_metric("anls").score("1/2/99", ["1/2/1999", "1/2/99"]) == 1.0


# --------------------------------------------------------------------------------------------- VQA


@pytest.mark.parametrize(
    "matches, expected",
    [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)],
)
def test_vqa_ten_answer_rule(matches, expected):
    # leave-one-out over the 10 humans: with m matching, m subsets see m-1 matches, 10-m subsets see m
    answers = ["nokia"] * matches + ["samsung"] * (10 - matches)
    assert vqa_accuracy("nokia", answers) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction, reference",
    [
        ("Two", "2"),  # number words
        ("the dog.", "dog"),  # articles, a final period
        ("dont", "don't"),  # a contraction without its apostrophe
        ("couldntve", "couldn't've"),
        ("100,978", "100978"),  # a comma between digits is deleted
        ("hello-world", "hello world"),  # other punctuation: a space
        ("yes!", "yes"),  # punctuation next to the end is deleted
        ("A Red, Bus", "red bus"),
        ("3.5", "3.5"),  # a decimal point stays
    ],
)
def test_vqa_normalisation(prediction, reference):
    assert normalize_vqa_answer(prediction) == normalize_vqa_answer(reference)
    assert vqa_accuracy(prediction, [reference] * 10) == 1.0


def test_vqa_normalisation_keeps_what_it_should():
    assert normalize_vqa_answer("3.5") == "3.5" and normalize_vqa_answer("35") != "3.5"
    # plain words, not contractions without their apostrophe
    assert normalize_vqa_answer("well") == "well" and normalize_vqa_answer("shell") == "shell"
    assert normalize_vqa_answer("12:30") == "12:30"  # colons are kept
    answers = ["Nokia"] * 2 + ["nokia phone"] * 3 + ["samsung"] * 5
    assert M.get_metric("vqa").score("nokia.", answers) == pytest.approx(0.6)
    assert M.get_metric("vqa").canonical("The Nokia.") == "nokia"


# --------------------------------------------------------------------------------------------- POPE


def test_pope_accuracy_f1_and_predicted_yes_ratio():
    preds = ["Yes", "yes.", "No", "no", "Yes, there is a dog.", "There is no cat.", "maybe"]
    golds = ["yes", "no", "yes", "no", "yes", "no", "no"]
    metric = M.get_metric("yesno")
    assert [metric.score(p, [g]) for p, g in zip(preds, golds, strict=True)] == [1, 0, 0, 1, 1, 1, 0]
    s = metric.summary(preds, [[g] for g in golds], [None] * len(golds))
    # tp = 2 (0, 4), fp = 1 (1), fn = 1 (2); 3 of 7 answers are yes
    assert s["precision"] == pytest.approx(2 / 3) and s["recall"] == pytest.approx(2 / 3)
    assert s["f1"] == pytest.approx(2 / 3)
    assert s["predicted_yes_ratio"] == pytest.approx(3 / 7) and "yes_ratio" not in s


# --------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "prediction, index",
    [
        ("The answer is (B).", 1),
        ("B. cat", 1),
        ("b", 1),
        ("(C)", 2),
        ("Answer: D", 3),
        ("the correct option is c.", 2),
        ("I would pick (d) here", 3),
        ("It is B", 1),
        ("The picture shows a dog.", 0),  # the one option whose text the answer holds
        ("I think it is the red bird", 2),  # "bird" is in "red bird": the longer option
        ("A cat sits on the mat", 0),  # leading capital letter
    ],
)
def test_option_letter_from_free_text(prediction, index):
    options = ["dog", "cat", "red bird", "bird"]
    assert M.option_index(prediction, options) == index


@pytest.mark.parametrize(
    "prediction",
    ["the answer is a mystery", "maybe A or B", "E", "(E)", "none of them", "it shows A and C"],
)
def test_option_letter_none_when_ambiguous_or_absent(prediction):
    assert M.option_index(prediction, ["dog", "cat", "red bird", "bird"]) is None


def test_option_accuracy_with_letter_references():
    metric = M.get_metric("option")
    assert metric.score("The answer is (B).", ["B"], ["x", "y"]) == 1.0
    assert metric.score("The answer is (A).", ["B"], ["x", "y"]) == 0.0
    assert metric.canonical("(B) y", ["x", "y"]) == metric.canonical("b", ["x", "y"]) == 1


# --------------------------------------------------------------------------------------------- ChartQA


@pytest.mark.parametrize(
    "prediction, reference, right",
    [
        ("10.4", "10", True),  # 4% off
        ("10.5", "10", True),  # 5% exactly
        ("10.6", "10", False),  # 6% off
        ("9.5", "10", True),
        ("12%", "0.12", True),  # a trailing % divides by 100
        (" 42 ", "42", True),
        ("Yes", "yes", True),  # strings: equal ignoring case
        ("yes.", "yes", False),  # nothing else normalised
        ("0", "0", True),  # a zero reference: exact only
        ("0.01", "0", False),
        ("1,000", "1000", False),  # a thousands comma makes it a string
        ("nan", "nan", True),
    ],
)
def test_relaxed_accuracy(prediction, reference, right):
    assert relaxed_accuracy(prediction, [reference]) == float(right)
    assert M.get_metric("relaxed").score(prediction, [reference]) == float(right)


# --------------------------------------------------------------------------------------------- MM-Vet local


def test_open_match_and_or():
    norm = M.normalize_answer
    assert open_match("x = -1 or x = -5", ["-1 <AND> -5"], norm) == 1.0
    assert open_match("x = -5", ["-1<AND>-5"], norm) == 0.5  # the share of <AND> parts found
    assert open_match("It is a Golden Retriever.", ["golden retriever<OR>labrador"], norm) == 1.0
    assert open_match("a retriever", ["golden retriever"], norm) == 0.0  # the reference's words, all of them
    assert open_match("cathedral", ["cat"], norm) == 0.0  # whole words only
    assert M.get_metric("open_match").score("The answer is 42.", ["42"]) == 1.0


def test_new_metrics_are_registered():
    assert {"vqa", "relaxed", "open_match", "anls", "option", "yesno"} <= set(M.METRICS)
