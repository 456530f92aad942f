"""HH-RLHF parsing, pair splitting, quarantine, conversation-root splits and PPO-ptx rows."""

import gzip
import hashlib
import json

import pytest

from rlhf.data import (
    RowError,
    Source,
    assign_split,
    conversation_root,
    prepare_rows,
    prompt_key,
    ptx_token_ids,
    read_jsonl,
    to_examples,
)

SHARED = "../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz"

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


def test_split_point_is_the_hash_of_the_first_user_turn():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  How do I\npick a lock? "},
        {"role": "assistant", "content": "Why?"},
        {"role": "user", "content": "I am locked out."},
    ]
    assert conversation_root(prompt) == "How do I pick a lock?"
    point = int(hashlib.sha256(b"How do I pick a lock?").hexdigest()[:15], 16) / 16**15
    assert assign_split(prompt, {"a": point, "b": 1 - point}) == "b"  # point < edge is needed for "a"
    assert assign_split(prompt, {"a": point + 1e-9, "b": 1 - point - 1e-9}) == "a"
    with pytest.raises(RowError, match="no user turn"):
        conversation_root([{"role": "assistant", "content": "Hi"}])


def test_one_conversation_cut_at_different_turns_lands_in_one_split():
    def cut(i, turns):
        chosen = [("Human", f"Root question {i}"), ("Assistant", "A1"), ("Human", "Follow-up"), ("Assistant", "A2")]
        chosen = chosen[: 2 * turns]
        rejected = [*chosen[:-1], ("Assistant", "Something else")]
        return {"chosen": hh(*chosen), "rejected": hh(*rejected)}

    rows = [(line, row) for line, row in enumerate((cut(i, t) for i in range(40) for t in (1, 2)), start=1)]
    prepared = prepare(rows)
    split_of = {}
    for split, split_rows in prepared.splits.items():
        for row in split_rows:
            root = (row.get("prompt") or row.get("messages"))[0]["content"]
            split_of.setdefault(root, set()).add(split)
    assert len(split_of) == 40 and all(len(splits) == 1 for splits in split_of.values())
    assert len({next(iter(splits)) for splits in split_of.values()}) >= 4  # the roots do spread over the splits


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
    prepared = prepare_rows([Source(SHARED, read_jsonl(SHARED))], FRACTIONS)
    assert prepared.rows_in == 2000
    assert [q["reason"] for q in prepared.quarantine] == ["chosen response is empty"] * 3
    prompts = {}
    for split, rows in prepared.splits.items():
        for row in rows:
            key = json.dumps(row.get("prompt"))
            if "prompt" in row:
                assert prompts.setdefault(key, split) == split


def test_real_data_no_conversation_in_two_splits():
    """No prompt (or ptx conversation) of one split is a message-list prefix of, or equal to, one of another."""
    prepared = prepare_rows([Source(SHARED, read_jsonl(SHARED))], FRACTIONS)
    by_first: dict[str, list[tuple[str, list]]] = {}  # a prefix shares the first message: compare within groups
    for split, rows in prepared.splits.items():
        for row in rows:
            messages = row.get("prompt") or row["messages"]
            by_first.setdefault(json.dumps(messages[0], sort_keys=True), []).append((split, messages))
    relations = [
        (split_a, split_b)
        for group in by_first.values()
        for split_a, a in group
        for split_b, b in group
        if split_a != split_b and b[: len(a)] == a
    ]
    assert relations == []
    ids = [row["id"] for rows in prepared.splits.values() for row in rows]
    assert len(ids) == len(set(ids)) == 2000 - 3  # every parsed row once (no prompt repeats within a prompt split)
    assert {split: len(rows) for split, rows in prepared.splits.items()} == {
        "sft": 398,
        "rm_train": 855,
        "rm_eval": 214,
        "ppo_prompts": 245,
        "ptx_text": 105,
        "ptx_heldout": 12,
        "eval_prompts": 168,
    }


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


def test_ptx_rows_from_the_preference_data_are_chat_messages():
    row = {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}
    prompt = [{"role": "user", "content": "Hi"}]
    prepared = prepare_rows([Source("mem", iter([(7, row)]))], {"ptx_text": 1.0}, ptx_heldout_fraction=0.5)
    point = int(hashlib.sha256(b"ptx_heldout\x1fHi").hexdigest()[:15], 16) / 16**15
    split = "ptx_heldout" if point < 0.5 else "ptx_text"
    assert prepared.splits[split] == [
        {
            "id": f"{prompt_key(prompt)[:16]}-7",
            "source": "mem",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        }
    ]


def test_ptx_source_rows_text_and_messages_leaks_and_bad_rows():
    pairs = [(1, {"prompt": "Secret eval question", "chosen": "A", "rejected": "B"})]
    ptx_rows = [
        (1, {"text": "Plain pretraining text."}),
        (2, {"messages": [{"role": "user", "content": "Other question"}, {"role": "assistant", "content": "Yes."}]}),
        (
            3,
            {"messages": [{"role": "user", "content": "Secret  eval question"}, {"role": "assistant", "content": "A"}]},
        ),
        (4, {"text": "x", "messages": []}),
        (5, {"messages": [{"role": "bot", "content": "x"}]}),
        (6, RowError("invalid JSON: Expecting value")),
    ]
    prepared = prepare_rows(
        [Source("pairs.jsonl", iter(pairs))],
        {"eval_prompts": 1.0},
        [Source("ptx.jsonl", iter(ptx_rows))],
        ptx_heldout_fraction=0.5,
    )
    ptx = sorted(prepared.splits["ptx_text"] + prepared.splits["ptx_heldout"], key=lambda r: r["id"][-1])
    assert [(r["source"], {k: v for k, v in r.items() if k not in ("id", "source")}) for r in ptx] == [
        ("ptx.jsonl", {"text": "Plain pretraining text."}),
        ("ptx.jsonl", dict(ptx_rows[1][1])),
    ]
    assert ptx[0]["id"] == f"{prompt_key({'text': 'Plain pretraining text.'})[:16]}-1"
    assert [(q["line"], q["reason"]) for q in prepared.quarantine] == [
        (3, "ptx conversation's first user turn is also in split 'eval_prompts' (it would leak)"),
        (4, "ptx row has keys ['messages', 'text']; expected exactly one of 'messages' or 'text'"),
        (5, "field 'messages' is not a list of {role, content} messages with string content"),
        (6, "invalid JSON: Expecting value"),
    ]
    assert prepared.rows_in == 7
    with pytest.raises(ValueError, match="ptx_heldout_fraction must be in"):
        prepare_rows([], {"sft": 1.0}, ptx_heldout_fraction=0.0)


def test_ptx_heldout_share_is_by_conversation_root():
    def prompt(line):  # two cuts of each conversation: its first turn, and its second user turn
        first = [{"role": "user", "content": f"Topic {line // 2}"}]
        return (
            first
            if line % 2 == 0
            else [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
        )

    rows = [(line, {"prompt": prompt(line), "chosen": f"c{line}", "rejected": f"r{line}"}) for line in range(200)]
    prepared = prepare_rows([Source("mem", iter(rows))], {"ptx_text": 1.0}, ptx_heldout_fraction=0.2)
    held = {r["messages"][0]["content"] for r in prepared.splits["ptx_heldout"]}
    kept = {r["messages"][0]["content"] for r in prepared.splits["ptx_text"]}
    assert not held & kept and len(held | kept) == 100
    assert len(prepared.splits["ptx_heldout"]) == 2 * len(held)  # both cuts of a held-out conversation
    expected = {
        f"Topic {t}"
        for t in range(100)
        if int(hashlib.sha256(f"ptx_heldout\x1fTopic {t}".encode()).hexdigest()[:15], 16) / 16**15 < 0.2
    }
    assert held == expected and 10 <= len(held) <= 30


def test_ptx_token_ids_messages_text_truncation_and_errors(tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    # "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n" in SmolLM2 ids
    # (<|im_start|> = 1, <|im_end|> = 2 = EOS, "\n" = 198, "user" = 4093, "Hi" = 26843, "assistant" = 520 9531)
    template_ids = [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198, 19556, 2, 198]
    assert ptx_token_ids(tokenizer, {"id": "m", "messages": messages}, 100) == template_ids
    assert ptx_token_ids(tokenizer, {"id": "m", "messages": messages}, 4) == [1, 4093, 198, 26843]
    assert ptx_token_ids(tokenizer, {"id": "t", "text": "Hello world"}, 100) == [19556, 905, 2]  # text + EOS
    with pytest.raises(ValueError, match="ptx row r9: ptx row has keys"):
        ptx_token_ids(tokenizer, {"id": "r9", "prompt": "x"}, 10)
    with pytest.raises(ValueError, match="max_length must be >= 1"):
        ptx_token_ids(tokenizer, {"text": "x"}, 0)
