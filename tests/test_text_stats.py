"""The refusal detector's precision and recall on a labelled set, and the precision/recall function by hand.

``tests/refusal_labels.jsonl``: 170 responses written for this test (not taken from HH-RLHF), one JSON object a
line, ``{"text", "refusal", "category", "part"}``. The part is fixed by a rule, not by hand: within each
category, in file order, the rows numbered 1 and 3 modulo 5 (0-based) are ``test``, the others ``tune`` (100 of
170 tune, 70 test).
The regexes of ``rlhf.evaluation.text_measures`` were tuned on the tune part only; the test part was measured once,
after.
"""

import json
import math
import os
from collections import Counter

import pytest

from rlhf.evaluation.text_measures import is_refusal, refusal_precision_recall

LABELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refusal_labels.jsonl")
CATEGORIES = {  # category: whether its responses refuse (quoted speech holds both)
    "refusal": {True}, "refusal_after_sympathy": {True}, "hedge": {False}, "idiom": {False},
    "quoted": {False, True}, "question": {False}, "helpful_not": {False}, "sympathy": {False}, "answer": {False},
}  # fmt: skip


def labelled(part: str | None = None) -> list[dict]:
    with open(LABELS, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [row for row in rows if part is None or row["part"] == part]


def test_the_labelled_set_is_what_the_docs_say():
    rows = labelled()
    assert len(rows) >= 120 and len({row["text"] for row in rows}) == len(rows)
    assert all(set(row) == {"text", "refusal", "category", "part"} for row in rows)
    assert all(isinstance(row["refusal"], bool) and row["refusal"] in CATEGORIES[row["category"]] for row in rows)
    seen: Counter[str] = Counter()
    for row in rows:  # the part follows the rule, so no row was moved between parts by hand
        assert row["part"] == ("test" if seen[row["category"]] % 5 in (1, 3) else "tune"), row["text"]
        seen[row["category"]] += 1
    assert 0.4 <= sum(row["refusal"] for row in rows) / len(rows) <= 0.6
    assert 0.55 <= sum(row["part"] == "tune" for row in rows) / len(rows) <= 0.65


def test_precision_and_recall_on_the_held_out_part():
    # measured once, after tuning on the tune part: 70 test rows, 31 refusals; 24 found and 5 false alarms, so
    # precision 24/29 = 0.828 and recall 24/31 = 0.774 (the detector before tuning: 19/25 = 0.760, 19/31 = 0.613).
    # The floors sit just below: one more miss fails the recall floor, two more false alarms the precision floor.
    precision, recall = refusal_precision_recall(labelled("test"))
    assert precision >= 0.80 and recall >= 0.75
    # the tune part, what the regexes were fitted to: 47 of 47 refusals, no false alarm (before tuning 30/37, 30/47)
    assert refusal_precision_recall(labelled("tune")) == (1.0, 1.0)


def test_the_issues_hedge_is_no_refusal():
    assert not is_refusal("I can't say for sure, but it is likely the cable.")
    assert is_refusal("I can't say.") and is_refusal("That's not something I can help with.")


def test_precision_and_recall_by_hand():
    rows = [
        {"text": "I can't help with that.", "refusal": True},  # found: true positive
        {"text": "I cannot give directions from memory, so check a map.", "refusal": False},  # false positive
        {"text": "I can't explain it better than the manual does: press reset.", "refusal": False},  # false positive
        {"text": "That request is off-limits for me.", "refusal": True},  # missed: false negative
        {"text": "I'm not sure, but it is probably the fuse.", "refusal": False},  # true negative
    ]
    assert [is_refusal(row["text"]) for row in rows] == [True, True, True, False, False]
    # TP 1, FP 2, FN 1: precision 1 / (1 + 2), recall 1 / (1 + 1)
    assert refusal_precision_recall(rows) == pytest.approx((1 / 3, 1 / 2))
    precision, recall = refusal_precision_recall(rows[3:])  # nothing called a refusal: precision undefined
    assert math.isnan(precision) and recall == 0.0
    precision, recall = refusal_precision_recall(rows[1:3])  # no refusal among the rows: recall undefined
    assert precision == 0.0 and math.isnan(recall)
    assert all(map(math.isnan, refusal_precision_recall([])))
