"""HH-RLHF parsing, pair splitting, quarantine and prompt-hash splits."""

import gzip
import json

import pytest

from rlhf.data import (
    RowError,
    Source,
    assign_split,
    prepare_rows,
    read_jsonl,
    to_examples,
)

FRACTIONS = {"sft": 0.2, "rm_train": 0.45, "rm_eval": 0.1, "ppo_prompts": 0.12, "ptx_text": 0.05, "eval_prompts": 0.08}


def one(row):
    examples = to_examples(row)
    assert len(examples) == 1
    return examples[0]


def prepare(rows, fmt="auto"):
    return prepare_rows([Source("mem", iter(rows), fmt)], FRACTIONS)


def hh(*turns):
    return "".join(f"\n\n{role}: {text}" for role, text in turns)


def test_multi_turn_pair_differing_before_last_assistant_turn():
    chosen = hh(
        ("Human", "How do I pick a lock?"),
        ("Assistant", "I can't help with that."),
        ("Human", "Why not?"),
        ("Assistant", "It could be used to break in."),
    )
    rejected = hh(
        ("Human", "How do I pick a lock?"),
        ("Assistant", "Use a tension wrench."),
        ("Human", "Why not?"),
        ("Assistant", "Sure."),
    )
    example = one({"chosen": chosen, "rejected": rejected})
    assert example["prompt"] == [{"role": "user", "content": "How do I pick a lock?"}]
    assert example["chosen"] == [
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "Why not?"},
        {"role": "assistant", "content": "It could be used to break in."},
    ]
    assert example["rejected"][0] == {"role": "assistant", "content": "Use a tension wrench."}
    assert example["chosen"] != example["rejected"]


def test_usual_pair_splits_at_last_assistant_turn():
    shared = [("Human", "Hi"), ("Assistant", "Hello, how can I help?"), ("Human", "Tell me a joke")]
    example = one(
        {
            "chosen": hh(*shared, ("Assistant", "Why did the chicken cross the road?")),
            "rejected": hh(*shared, ("Assistant", "No.")),
        }
    )
    assert [m["content"] for m in example["prompt"]] == ["Hi", "Hello, how can I help?", "Tell me a joke"]
    assert example["chosen"] == [{"role": "assistant", "content": "Why did the chicken cross the road?"}]
    assert example["rejected"] == [{"role": "assistant", "content": "No."}]


def test_two_assistant_turns_in_a_row_stay_one_response():
    chosen = hh(("Human", "Can you help?"), ("Assistant", "Sure."))
    rejected = hh(("Human", "Can you help?"), ("Assistant", "Sure."), ("Assistant", "What do you need?"))
    example = one({"chosen": chosen, "rejected": rejected})
    assert example["prompt"] == [{"role": "user", "content": "Can you help?"}]
    assert example["chosen"] == [{"role": "assistant", "content": "Sure."}]
    assert example["rejected"] == [
        {"role": "assistant", "content": "Sure."},
        {"role": "assistant", "content": "What do you need?"},
    ]


def test_identical_responses_go_to_quarantine_not_training():
    text = hh(("Human", "Hi"), ("Assistant", "Hello  "))
    same_after_parsing = hh(("Human", "Hi"), ("Assistant", "Hello"))
    prepared = prepare([(1, {"chosen": text, "rejected": same_after_parsing})])
    assert sum(len(rows) for rows in prepared.splits.values()) == 0
    assert prepared.quarantine == [
        {
            "source": "mem",
            "line": 1,
            "reason": "chosen and rejected responses are identical",
            "row": {"chosen": text, "rejected": same_after_parsing},
        }
    ]


def test_empty_response_and_bad_rows_are_quarantined_with_reasons():
    rows = [
        (1, {"chosen": hh(("Human", "Hi"), ("Assistant", "")), "rejected": hh(("Human", "Hi"), ("Assistant", "Hey"))}),
        (2, {"chosen": "no markers at all", "rejected": "x"}),
        (3, {"text": "wrong keys"}),
        (4, RowError("invalid JSON: Expecting value")),
    ]
    prepared = prepare(rows)
    assert [q["reason"] for q in prepared.quarantine] == [
        "chosen response is empty",
        "dialogue does not start with '\\n\\nHuman:'",
        "row has keys ['text']; expected chosen/rejected, prompt/chosen/rejected or prompt/responses",
        "invalid JSON: Expecting value",
    ]
    assert prepared.rows_in == 4


def test_prompt_chosen_rejected_strings():
    example = one({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."})
    assert example == {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    }


def test_split_is_a_function_of_the_prompt_only():
    prompt = [{"role": "user", "content": "same prompt"}]
    assert len({assign_split(list(prompt), FRACTIONS) for _ in range(5)}) == 1
    rows = [(i, {"prompt": "same prompt", "chosen": f"answer {i}", "rejected": f"other {i}"}) for i in range(1, 6)]
    prepared = prepare(rows)
    assert sum(1 for rows in prepared.splits.values() if rows) == 1


def test_split_fractions_must_sum_to_one():
    with pytest.raises(ValueError, match="sum to 1"):
        assign_split([{"role": "user", "content": "x"}], {"a": 0.5, "b": 0.6})


def test_read_jsonl_gzip_and_bad_lines(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(json.dumps({"a": 1}).encode() + b"\n\n{broken\n" + b"\xff\xfe\n")
    rows = list(read_jsonl(str(path)))
    assert rows[0] == (1, {"a": 1})
    assert rows[1][0] == 3 and "invalid JSON" in str(rows[1][1])
    assert rows[2][0] == 4 and "invalid UTF-8" in str(rows[2][1])


def test_real_data_parses():
    """The shared HH-RLHF file: 3 rows with an empty response are quarantined, the rest parse."""
    source = "../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz"
    prepared = prepare_rows([Source(source, read_jsonl(source))], FRACTIONS)
    assert prepared.rows_in == 2000
    assert [q["reason"] for q in prepared.quarantine] == ["chosen response is empty"] * 3
    prompts = {}
    for split, rows in prepared.splits.items():
        for row in rows:
            key = json.dumps(row.get("prompt"))
            if "prompt" in row:
                assert prompts.setdefault(key, split) == split


def test_conversational_rows_split_at_shared_prefix():
    user = {"role": "user", "content": "Hi"}
    example = one(
        {
            "chosen": [user, {"role": "assistant", "content": "Hello!"}],
            "rejected": [user, {"role": "assistant", "content": "Go away."}],
        }
    )
    assert example == {
        "prompt": [user],
        "chosen": [{"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    }


def test_conversational_row_with_a_string_is_an_error():
    with pytest.raises(RowError, match="not a list"):
        to_examples({"chosen": [{"role": "user", "content": "Hi"}], "rejected": "text"}, fmt="conversational")


def test_ranking_of_four_gives_six_pairs_and_a_tie_one_fewer():
    responses = ["best", "good", "fair", "poor"]
    pairs = [
        (e["chosen"][0]["content"], e["rejected"][0]["content"])
        for e in to_examples({"prompt": "Q", "responses": responses})
    ]
    assert pairs == [
        ("best", "good"),
        ("best", "fair"),
        ("best", "poor"),
        ("good", "fair"),
        ("good", "poor"),
        ("fair", "poor"),
    ]
    tied = to_examples({"prompt": "Q", "responses": responses, "ranks": [1, 2, 2, 3]})
    assert len(tied) == 5
    assert ("good", "fair") not in [(e["chosen"][0]["content"], e["rejected"][0]["content"]) for e in tied]
    reversed_ranks = to_examples({"prompt": "Q", "responses": ["a", "b"], "ranks": [2, 1]})
    assert reversed_ranks[0]["chosen"][0]["content"] == "b"


def test_mapping_renames_columns_and_sources_are_kept():
    rows_a = [(1, {"question": "Q1", "good": "yes", "bad": "no"})]
    rows_b = [(1, {"prompt": "Q2", "chosen": "fine", "rejected": "bad"})]
    prepared = prepare_rows(
        [
            Source("a.jsonl", iter(rows_a), "pairs", {"question": "prompt", "good": "chosen", "bad": "rejected"}),
            Source("b.jsonl", iter(rows_b)),
        ],
        FRACTIONS,
    )
    sources = sorted(row["source"] for rows in prepared.splits.values() for row in rows)
    assert sources == ["a.jsonl", "b.jsonl"] and prepared.rows_in == 2
