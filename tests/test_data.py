"""HH-RLHF parsing, pair splitting, quarantine, conversation-root splits, PPO-ptx rows, reading sources."""

import bz2
import functools
import gzip
import hashlib
import http.server
import io
import json
import lzma
import os
import tarfile
import threading
import zipfile

import pytest
import yaml
import zstandard

import rlhf.data.sources
import tasks.prepare
from rlhf.data.formats import RowError, to_examples
from rlhf.data.ptx import ptx_token_ids
from rlhf.data.reading import load_jsonl, read_jsonl
from rlhf.data.sources import Source, prepare_rows
from rlhf.data.splitting import assign_split, conversation_root, prompt_key, unit_point
from tasks.kit.outputs import StagedOutputs

SHARED = "../shared/data/hh-rlhf/harmless-base/pairs.jsonl.gz"

# every split with a share of its own (params.yaml's until rm_eval's and judge_eval's went to judge_train)
FRACTIONS = {"judge_train": 0.12, "sft": 0.08, "rm_train": 0.45, "rm_eval": 0.1, "ppo_prompts": 0.07,
             "judge_eval": 0.05, "ptx_text": 0.05, "eval_prompts": 0.08}  # fmt: skip
with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "params.yaml"), encoding="utf-8") as handle:
    PARAMS_FRACTIONS = yaml.safe_load(handle)["data"]["fractions"]


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
            "file": "mem",
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
    # one split a conversation; an eval_prompts one's pairs are also rm_eval's and judge_eval's (HELD_OUT_PAIRS)
    assert len(split_of) == 40
    held_out = {"eval_prompts", "rm_eval", "judge_eval"}
    assert all(len(splits) == 1 or splits == held_out for splits in split_of.values())
    assert len({next(iter(splits)) for splits in split_of.values()}) >= 4  # the roots do spread over the splits


def test_split_fractions_must_sum_to_one():
    with pytest.raises(ValueError, match=r"^data.fractions must sum to 1, got 1.1 \("):
        assign_split([{"role": "user", "content": "x"}], {"a": 0.5, "b": 0.6})
    with pytest.raises(ValueError, match=r"^data.fractions.b must be >= 0, got -0.5$"):
        assign_split([{"role": "user", "content": "x"}], {"a": 1.5, "b": -0.5})


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
                prompts.setdefault(key, set()).add(split)
    # one split a prompt, but for the eval_prompts conversations' pairs, also in rm_eval and judge_eval on purpose
    held_out = {"eval_prompts", "rm_eval", "judge_eval"}
    assert all(len(splits) == 1 or splits == held_out for splits in prompts.values())


TRAINING_SPLITS = ("sft", "rm_train", "judge_train", "ppo_prompts", "ptx_text")


@pytest.mark.parametrize(
    "fractions, min_train, min_own",
    [(PARAMS_FRACTIONS, 450, 0), (FRACTIONS, 200, 100)],
    ids=["params.yaml (no own eval shares)", "own eval shares"],
)
def test_judge_splits_share_no_conversation_with_any_other_split_but_eval_prompts(fractions, min_train, min_own):
    """The judge's own conversations: none reaches the RM, PPO, SFT, ptx or eval splits. judge_eval (and rm_eval)
    hold the eval_prompts conversations' pairs, on purpose: neither model trains on its eval split and evaluation
    reads only the prompts of eval_prompts, so no split that trains sees them. params.yaml gives the judge ~490
    training pairs and, in judge_eval, only those held-out pairs; a judge_eval share of its own stays its own."""
    prepared = prepare_rows([Source(SHARED, read_jsonl(SHARED))], fractions)
    roots = {
        split: {conversation_root(row.get("prompt") or row["messages"]) for row in rows}
        for split, rows in prepared.splits.items()
    }
    assert roots["eval_prompts"] <= roots["judge_eval"]  # every eval conversation's pairs, and the judge's own
    assert roots["eval_prompts"] <= roots["rm_eval"]  # the same for the reward model
    own = roots["judge_eval"] - roots["eval_prompts"]
    assert len(roots["judge_train"]) > min_train and len(own) >= min_own and len(roots["judge_eval"]) > 250
    assert (not own) == (fractions["judge_eval"] == 0)  # no share of its own: only the held-out pairs
    assert not roots["judge_train"] & roots["judge_eval"]
    for split in set(roots) - {"judge_eval"}:
        assert roots[split] or fractions.get(split) == 0, split  # only a split given no share is empty
        assert not own & roots[split], split  # the judge's own share is in no other split
    held_out = roots["judge_eval"] | roots["eval_prompts"] | roots["rm_eval"]
    for split in TRAINING_SPLITS:
        assert not held_out & roots[split], split
        for other in set(TRAINING_SPLITS) - {split}:
            assert not roots[split] & roots[other], (split, other)


def test_eval_prompts_pairs_also_go_whole_to_rm_eval_and_judge_eval_and_nothing_else_changes(monkeypatch):
    """On a small hand-made input: rm_eval and judge_eval each gain exactly the pairs whose split is eval_prompts
    (two cuts of one conversation and a repeated row included), with ids of the pair form, distinct within each
    split and from every id of the other splits; eval_prompts and every other split are as they were."""
    rows = []
    for i in range(40):
        question = f"Question number {i}: what should I do about problem {i}?"
        rows.append({"chosen": hh(("Human", question), ("Assistant", f"Good answer {i}.")),
                     "rejected": hh(("Human", question), ("Assistant", f"Bad answer {i}."))})  # fmt: skip
        if i % 4 == 0:  # a second cut of the same conversation: same root, another prompt
            longer = [("Human", question), ("Assistant", f"Good answer {i}."), ("Human", "And then?")]
            rows.append(
                {"chosen": hh(*longer, ("Assistant", "Then rest.")), "rejected": hh(*longer, ("Assistant", "No."))}
            )
    rows += rows  # each row twice: one eval_prompts row per prompt, one judge_eval row per pair
    numbered = list(enumerate(rows, start=1))
    after = prepare_rows([Source("mem", iter(numbered))], FRACTIONS)
    monkeypatch.setattr(rlhf.data.sources, "HELD_OUT_PAIRS", {})  # the split as it was before
    before = prepare_rows([Source("mem", iter(numbered))], FRACTIONS)
    eval_pairs = [
        (line, example)
        for line, row in numbered
        for example in to_examples(row)
        if assign_split(example["prompt"], FRACTIONS) == "eval_prompts"
    ]
    assert len(eval_pairs) > len(after.splits["eval_prompts"]) > 0  # some prompts repeat
    counts = {split: len(rows) for split, rows in before.splits.items()}
    counts["judge_eval"] += len(eval_pairs)
    counts["rm_eval"] += len(eval_pairs)
    assert {split: len(rows) for split, rows in after.splits.items()} == counts
    for split in set(after.splits) - {"judge_eval", "rm_eval"}:
        assert after.splits[split] == before.splits[split], split
    for measured in ("rm_eval", "judge_eval"):
        added = [row for row in after.splits[measured] if row not in before.splits[measured]]
        assert [(row["prompt"], row["chosen"], row["rejected"]) for row in added] == [
            (e["prompt"], e["chosen"], e["rejected"]) for _, e in eval_pairs
        ]
        assert [row["id"] for row in added] == [f"{prompt_key(e['prompt'])[:16]}-{line}" for line, e in eval_pairs]
        assert all(
            set(row) == {"id", "source", "kind", "prompt", "chosen", "rejected"} for row in after.splits[measured]
        )
    by_split = {split: [row["id"] for row in rows] for split, rows in after.splits.items()}
    assert all(len(ids) == len(set(ids)) for ids in by_split.values())
    shared = set(by_split["rm_eval"]) & set(by_split["judge_eval"])  # the same pairs, the same ids
    ids = [i for split, split_ids in by_split.items() if split != "judge_eval" for i in split_ids]
    assert len(shared) == len(eval_pairs) and len(ids) == len(set(ids))


def test_real_data_no_conversation_in_two_splits():
    """No prompt (or ptx conversation) of one split is a message-list prefix of, or equal to, one of another,
    but for eval_prompts and judge_eval, which share their conversations on purpose."""
    prepared = prepare_rows([Source(SHARED, read_jsonl(SHARED))], FRACTIONS)
    by_first: dict[str, list[tuple[str, list]]] = {}  # a prefix shares the first message: compare within groups
    for split, rows in prepared.splits.items():
        for row in rows:
            messages = row.get("prompt") or row["messages"]
            by_first.setdefault(json.dumps(messages[0], sort_keys=True), []).append((split, messages))
    relations = {
        (split_a, split_b)
        for group in by_first.values()
        for split_a, a in group
        for split_b, b in group
        if split_a != split_b and b[: len(a)] == a
    }
    # on purpose: rm_eval and judge_eval also hold the eval_prompts conversations' pairs (neither model trains
    # on them, evaluation reads only the prompts; rlhf.data.splitting.HELD_OUT_PAIRS)
    held_out = ("eval_prompts", "rm_eval", "judge_eval")
    assert relations == {(a, b) for a in held_out for b in held_out if a != b}
    ids = [row["id"] for rows in prepared.splits.values() for row in rows]
    # every parsed row once (no prompt repeats within a prompt split), each eval_prompts row's pair again in
    # judge_eval, and the same pair (the same id) in rm_eval
    shared = {row["id"] for row in prepared.splits["rm_eval"]} & {row["id"] for row in prepared.splits["judge_eval"]}
    assert len(set(ids)) == 2000 - 3 + 168 and len(ids) == len(set(ids)) + 168 == len(set(ids)) + len(shared)
    assert {split: len(rows) for split, rows in prepared.splits.items()} == {
        "sft": 156,
        "rm_train": 855,
        "rm_eval": 214 + 168,  # its own share's pairs + the eval_prompts conversations' pairs
        "ppo_prompts": 116,
        "ptx_text": 105,
        "ptx_heldout": 12,
        "eval_prompts": 168,
        "judge_train": 242,
        "judge_eval": 129 + 168,  # its own share's pairs + the eval_prompts conversations' pairs
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


@pytest.mark.parametrize(
    ("chosen", "rejected", "reason"),
    [
        ("Catan.", "Catan.\u200b", "chosen and rejected responses are identical"),
        ("Catan.", "Ca\u2060tan.\ufeff", "chosen and rejected responses are identical"),
        ("Catan.", "Catan.  ", "chosen and rejected responses are identical"),  # whitespace only
        ("Catan.", "\u200b\u200c", "rejected response is empty"),
        ("\u2800", "Catan.", "chosen response is empty"),  # the braille blank draws nothing
    ],
)
def test_responses_that_differ_only_in_invisible_characters_are_quarantined(chosen, rejected, reason):
    row = {
        "chosen": hh(("Human", GAME), ("Assistant", chosen)),
        "rejected": hh(("Human", GAME), ("Assistant", rejected)),
    }
    assert [q["reason"] for q in prepare([(1, row)]).quarantine] == [reason]


def test_a_conversation_root_reads_visible_content():
    plain = [{"role": "user", "content": "Which game  for four?"}]
    marked = [{"role": "user", "content": "Which\u200b game for\u2060 four?\ufeff"}]
    assert conversation_root(plain) == conversation_root(marked) == "Which game for four?"


@pytest.mark.parametrize(
    "ranks", ["[NaN, NaN]", "[1, NaN]", "[Infinity, 1]", "[-Infinity, 2]", '[1, "2"]', "[true, 2]"]
)
def test_ranks_that_are_not_finite_numbers_are_quarantined_with_the_rule(ranks):
    # json.loads reads NaN and Infinity; NaN != NaN made [NaN, NaN] a preference of "sad" over "glad"
    row = json.loads('{"prompt": "Mood?", "responses": ["sad", "glad"], "ranks": ' + ranks + "}")
    assert [q["reason"] for q in prepare([(1, row)]).quarantine] == ["field 'ranks' must be a list of 2 finite numbers"]


def test_mapping_renames_columns_and_sources_are_kept():
    rows_a = [(1, {"question": "Q1", "good": "yes", "bad": "no"})]
    rows_b = [(1, {"prompt": "Q2", "chosen": "fine", "rejected": "bad"})]
    prepared = prepare_rows(
        [
            Source("a.jsonl", iter(rows_a), "pairs", {"question": "prompt", "good": "chosen", "bad": "rejected"}),
            Source("data/b/pairs.jsonl.gz", iter(rows_b), name=None, kind="helpful"),
        ],
        FRACTIONS,
    )
    sources = sorted((row["source"], row["kind"]) for rows in prepared.splits.values() for row in rows)
    assert sources == [("a", "general"), ("b", "helpful")] and prepared.rows_in == 2


def test_sources_are_named_once_and_kinds_are_plain_names():
    def named(*sources):
        return [row["source"] for rows in prepare_rows(list(sources), FRACTIONS).splits.values() for row in rows]

    row = {"prompt": "Q", "chosen": "a", "rejected": "b"}
    # the same file read twice by default names: told apart by position; given names win
    assert sorted(named(Source("x/p.jsonl", iter([(1, row)])), Source("y/p.jsonl", iter([(1, row)])))) == [
        "p-0",
        "p-1",
    ]
    assert named(Source("x/p.jsonl", iter([(1, row)]), name="mine")) == ["mine"]
    with pytest.raises(ValueError, match=r"sources a.jsonl and b.jsonl are both named 'x'; give each its own name"):
        prepare_rows([Source("a.jsonl", iter([]), name="x"), Source("b.jsonl", iter([]), name="x")], FRACTIONS)
    with pytest.raises(ValueError, match=r"source a.jsonl: its kind must be a non-empty string without '/'"):
        prepare_rows([Source("a.jsonl", iter([]), kind="a/b")], FRACTIONS)


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
            "kind": "general",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            "response_start": 1,  # where the chosen answer starts: validate checks it is one assistant turn
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
        [Source("ptx.jsonl", iter(ptx_rows), kind="ptx")],
        ptx_heldout_fraction=0.5,
    )
    ptx = sorted(prepared.splits["ptx_text"] + prepared.splits["ptx_heldout"], key=lambda r: r["id"][-1])
    assert [(r["source"], {k: v for k, v in r.items() if k not in ("id", "source")}) for r in ptx] == [
        ("ptx", {"kind": "ptx", "text": "Plain pretraining text."}),
        ("ptx", {"kind": "ptx", **ptx_rows[1][1]}),
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


# --- a response that repeats the prompt (the "whole conversation in each response" layout) -------------------

PRIME = "Name a prime above 10."


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def test_pairs_row_whose_responses_hold_the_whole_conversation_has_the_prompt_once():
    row = {"prompt": PRIME, "chosen": [user(PRIME), bot("11.")], "rejected": [user(PRIME), bot("12.")]}
    assert one(row) == {"prompt": [user(PRIME)], "chosen": [bot("11.")], "rejected": [bot("12.")]}
    prepared = prepare_rows([Source("mem", iter([(1, row)]))], {"ptx_text": 1.0}, ptx_heldout_fraction=0.5)
    ptx = prepared.splits["ptx_text"] + prepared.splits["ptx_heldout"]
    assert [r["messages"] for r in ptx] == [[user(PRIME), bot("11.")]]  # one user turn, not two


@pytest.mark.parametrize(
    "row, expected",
    [
        (  # system message in the prompt and in both responses
            {
                "prompt": [system("Be brief."), user(PRIME)],
                "chosen": [system("Be brief."), user(PRIME), bot("11.")],
                "rejected": [system("Be brief."), user(PRIME), bot("12.")],
            },
            ([system("Be brief."), user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # system message in the prompt only; the responses repeat the user turn
            {
                "prompt": [system("Be brief."), user(PRIME)],
                "chosen": [user(PRIME), bot("11.")],
                "rejected": [user(PRIME), bot("12.")],
            },
            ([system("Be brief."), user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # system message only in the responses (the prompt a string): it goes into the prompt
            {
                "prompt": PRIME,
                "chosen": [system("Be brief."), user(PRIME), bot("11.")],
                "rejected": [system("Be brief."), user(PRIME), bot("12.")],
            },
            ([system("Be brief."), user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # one response repeats, the other is a plain string; whitespace differs in the repeat
            {"prompt": PRIME, "chosen": [user("  Name a prime\nabove 10. "), bot("11.")], "rejected": "12."},
            ([user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # multi-turn prompt, responses repeat all of it / its last user turn / its last two turns
            {
                "prompt": [user("Hi"), bot("Hello."), user(PRIME)],
                "chosen": [user("Hi"), bot("Hello."), user(PRIME), bot("11.")],
                "rejected": [user(PRIME), bot("12.")],
            },
            ([user("Hi"), bot("Hello."), user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (
            {
                "prompt": [user("Hi"), bot("Hello."), user(PRIME)],
                "chosen": [bot("Hello."), user(PRIME), bot("11.")],
                "rejected": [bot("12.")],
            },
            ([user("Hi"), bot("Hello."), user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # plain strings that start with the prompt text ("completion includes the prompt")
            {"prompt": PRIME, "chosen": f"{PRIME} 11.", "rejected": f"{PRIME}\n\n12."},
            ([user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # HH markup in the prompt and in the responses
            {
                "prompt": f"\n\nHuman: {PRIME}\n\nAssistant:",
                "chosen": f"\n\nHuman: {PRIME}\n\nAssistant: 11.",
                "rejected": "\n\nAssistant: 12.",
            },
            ([user(PRIME)], [bot("11.")], [bot("12.")]),
        ),
        (  # a short prompt is echoed by ordinary answers: left alone
            {"prompt": "Hi", "chosen": "Hi there! How can I help?", "rejected": "Go away."},
            ([user("Hi")], [bot("Hi there! How can I help?")], [bot("Go away.")]),
        ),
        (  # a response that only starts like the prompt text (no word boundary) is left alone
            {"prompt": "Count to three please", "chosen": "Count to three pleasently: 1 2 3", "rejected": "No."},
            ([user("Count to three please")], [bot("Count to three pleasently: 1 2 3")], [bot("No.")]),
        ),
    ],
)
def test_every_layout_of_a_repeated_prompt_gives_the_prompt_once(row, expected):
    assert one(row) == dict(zip(("prompt", "chosen", "rejected"), expected, strict=True))


def test_ranking_responses_that_repeat_the_prompt():
    row = {
        "prompt": [system("Be brief."), user(PRIME)],
        "responses": [[user(PRIME), bot("11.")], [system("Be brief."), user(PRIME), bot("13.")], f"{PRIME} 12."],
        "ranks": [1, 1, 2],
    }
    assert to_examples(row) == [
        {"prompt": [system("Be brief."), user(PRIME)], "chosen": [bot("11.")], "rejected": [bot("12.")]},
        {"prompt": [system("Be brief."), user(PRIME)], "chosen": [bot("13.")], "rejected": [bot("12.")]},
    ]


@pytest.mark.parametrize(
    "row, reason",
    [
        (  # the response repeats another user turn: it does not answer this prompt
            {"prompt": PRIME, "chosen": [user("Name a prime below 10."), bot("7.")], "rejected": "12."},
            "chosen response starts with a user turn that does not repeat the prompt",
        ),
        (  # both responses open with the same other user turn (it would become a second prompt turn)
            {"prompt": PRIME, "chosen": [user("Below 10?"), bot("7.")], "rejected": [user("Below 10?"), bot("8.")]},
            "chosen response starts with a user turn that does not repeat the prompt",
        ),
        (
            {"prompt": PRIME, "chosen": [user(PRIME)], "rejected": [user(PRIME), bot("12.")]},
            "chosen response is empty",
        ),
        (
            {"prompt": PRIME, "chosen": PRIME, "rejected": "12."},
            "chosen response is empty",
        ),
        (
            {
                "prompt": PRIME,
                "chosen": [system("Be brief."), user(PRIME), bot("11.")],
                "rejected": [system("Be verbose."), user(PRIME), bot("12.")],
            },
            "chosen and rejected responses bring different system messages",
        ),
        (
            {
                "prompt": [system("Be brief."), user(PRIME)],
                "chosen": [system("Be verbose."), user(PRIME), bot("11.")],
                "rejected": "12.",
            },
            "chosen response's system message differs from the prompt's",
        ),
        (
            {"prompt": PRIME, "chosen": [system("Be brief."), bot("11.")], "rejected": "12."},
            "chosen response holds a system message that does not open the whole prompt",
        ),
    ],
)
def test_responses_that_do_not_continue_the_prompt_are_quarantined_with_the_reason(row, reason):
    prepared = prepare([(1, row)])
    assert [q["reason"] for q in prepared.quarantine] == [reason]
    assert sum(len(rows) for rows in prepared.splits.values()) == 0


# --- a response that ends with a user turn -------------------------------------------------------------------

GAME = "Recommend a board game for four."


@pytest.mark.parametrize(
    "row",
    [
        {
            "chosen": [user(GAME), bot("Ticket to Ride."), user("thanks")],
            "rejected": [user(GAME), bot("Play alone.")],
        },
        {
            "prompt": GAME,
            "chosen": [user(GAME), bot("Ticket to Ride."), user("thanks"), user("bye")],
            "rejected": [bot("Play alone.")],
        },
        {"prompt": GAME, "chosen": [bot("Ticket to Ride."), user("thanks")], "rejected": "Play alone."},
        {"prompt": GAME, "responses": [[bot("Ticket to Ride."), user("thanks")], "Play alone."]},
    ],
)
def test_trailing_user_turns_of_a_response_are_dropped(row):
    assert one(row) == {"prompt": [user(GAME)], "chosen": [bot("Ticket to Ride.")], "rejected": [bot("Play alone.")]}


def test_a_human_turn_after_an_hh_answer_stays_for_validate_to_quarantine():
    # an HH dialogue ends with the answer: a Human turn after it was written inside the answer (2 of HH's 7,397
    # rows: "...artistic community\n\nHuman:  Thanks, ..."); dropping it silently cut the answer's text
    row = {
        "chosen": f"\n\nHuman: {GAME}\n\nAssistant: Ticket to Ride.\n\nHuman: thanks",
        "rejected": f"\n\nHuman: {GAME}\n\nAssistant: Play alone.",
    }
    assert one(row)["chosen"] == [bot("Ticket to Ride."), user("thanks")]


def test_a_user_turn_inside_a_response_stays_and_one_after_the_last_answer_goes():
    row = {
        "chosen": [user(GAME), bot("Ticket to Ride."), user("Why?"), bot("It plays well with four."), user("ok")],
        "rejected": [user(GAME), bot("Play alone.")],
    }
    assert one(row)["chosen"] == [bot("Ticket to Ride."), user("Why?"), bot("It plays well with four.")]


def test_responses_equal_once_the_trailing_user_turn_is_dropped_are_quarantined():
    row = {
        "chosen": [user(GAME), bot("Catan."), user("thanks")],
        "rejected": [user(GAME), bot("Catan.")],
    }
    assert [q["reason"] for q in prepare([(1, row)]).quarantine] == ["chosen and rejected responses are identical"]


# --- compression read from the content; a source without a usable row is an error ----------------------------

ROWS = [{"prompt": f"Question {i}?", "chosen": f"Good answer {i}.", "rejected": f"Bad answer {i}."} for i in range(4)]
COMPRESS = {
    None: lambda data: data,
    "gzip": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
}


def write_rows(path, rows, compression=None):
    path.write_bytes(COMPRESS[compression](b"".join(json.dumps(r).encode() + b"\n" for r in rows)))
    return str(path)


@pytest.mark.parametrize(
    "name, compression",
    [
        ("pairs.JSONL.GZ", "gzip"),  # upper-case suffix
        ("pairs.jsonl", "gzip"),  # gzip without a suffix
        ("pairs", "gzip"),
        ("pairs.jsonl.gz", None),  # plain text named .gz
        ("pairs.Gz", None),
        ("pairs.jsonl.BZ2", "bz2"),
        ("pairs.data", "xz"),
        ("pairs.jsonl.gz", "bz2"),  # the name says one codec, the content another
        ("pairs.jsonl.zst", "zstd"),
    ],
)
def test_read_jsonl_reads_the_compression_from_the_content_not_the_name(tmp_path, name, compression):
    path = write_rows(tmp_path / name, ROWS, compression)
    assert list(read_jsonl(path)) == [(1, ROWS[0]), (2, ROWS[1]), (3, ROWS[2]), (4, ROWS[3])]


def test_read_jsonl_drops_a_byte_order_mark_and_reads_an_empty_file(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode() + b"\n")
    assert list(read_jsonl(str(path))) == [(1, ROWS[0])]
    (tmp_path / "empty.jsonl.gz").write_bytes(b"")
    assert list(read_jsonl(str(tmp_path / "empty.jsonl.gz"))) == []


def run_prepare(tmp_path, monkeypatch, **data):
    monkeypatch.chdir(tmp_path)
    with StagedOutputs() as outputs:  # a failure raises before anything is put in place
        defaults = {"fractions": {"sft": 0.5, "rm_train": 0.5}, "kind": "general", "more_sources": [], "max_rows": None}
        return tasks.prepare.run({**defaults, **data}, outputs)


def test_prepare_reads_gzip_with_odd_names_in_every_source(tmp_path, monkeypatch):
    ptx_rows = [{"text": "Some pretraining text."}, {"messages": [{"role": "user", "content": "Hello?"}]}]
    counts = run_prepare(
        tmp_path,
        monkeypatch,
        source=write_rows(tmp_path / "pairs.JSONL.GZ", ROWS, "gzip"),
        more_sources=[{"source": write_rows(tmp_path / "more.jsonl", ROWS[:2], "gzip")}],
        ptx_source=write_rows(tmp_path / "ptx.jsonl.gz", ptx_rows),  # plain text named .gz
    )
    assert counts["rows_in"] == 4 + 2 + 2 and counts["quarantined"] == 0
    assert counts["split/sft"] + counts["split/rm_train"] == 6
    assert counts["split/ptx_text"] + counts["split/ptx_heldout"] == 2


@pytest.mark.parametrize("which", ["source", "more_sources", "ptx_source"])
def test_a_source_without_a_usable_row_fails_the_stage_naming_it(tmp_path, monkeypatch, which):
    good = write_rows(tmp_path / "good.jsonl", ROWS)
    garbage = tmp_path / "garbage.jsonl.gz"  # neither gzip nor UTF-8: every line is quarantined
    garbage.write_bytes(b"\x00\xff\xfe garbage\n" * 3)
    data = {"source": good, "more_sources": [], "ptx_source": None}
    data[which] = [{"source": str(garbage)}] if which == "more_sources" else str(garbage)
    kind = "ptx" if which == "ptx_source" else "preference"
    with pytest.raises(ValueError) as failure:
        run_prepare(tmp_path, monkeypatch, **data)
    assert str(failure.value) == (
        f"{kind} source {garbage}: none of 3 rows is usable; first reason: invalid UTF-8: invalid start byte at byte 1"
    )
    assert not (tmp_path / "data" / "processed").exists()  # nothing written


MANY = [{"prompt": f"Question {i}?", "chosen": f"Answer {i} " * 20, "rejected": f"No {i}."} for i in range(400)]


@pytest.mark.parametrize("compression", ["gzip", "bz2", "xz", "zstd"])
@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_compressed_source_that_breaks_partway_fails_prepare_in_one_line(tmp_path, monkeypatch, compression, damage):
    path = tmp_path / "pairs.jsonl.gz"
    data = COMPRESS[compression](b"".join(json.dumps(r).encode() + b"\n" for r in MANY))
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # bytes flipped in the middle of the stream
        middle = len(data) // 2
        data = data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :]
    path.write_bytes(data)
    with pytest.raises(ValueError) as failure:
        run_prepare(tmp_path, monkeypatch, source=str(path))
    message = str(failure.value)
    assert "\n" not in message and message.startswith(f"{path}: reading stopped after line ")
    assert f"its {compression} stream is truncated or corrupt" in message
    assert 0 <= int(message.split("after line ")[1].split(":")[0]) < len(MANY)  # how far it got
    assert not (tmp_path / "data" / "processed").exists()  # nothing written


def archive(kind: str, folder) -> bytes:
    """The bytes of a ``kind`` archive holding one JSON-lines file (7z and rar: their signature, then noise)."""
    member = folder / "pairs.jsonl"
    member.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS))
    out = io.BytesIO()
    if kind.startswith("zip"):
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED if kind == "zip-stored" else zipfile.ZIP_DEFLATED) as z:
            z.write(member, "pairs.jsonl")
    elif kind.startswith("tar"):
        with tarfile.open(fileobj=out, mode={"tar": "w", "tar.gz": "w:gz", "tar.xz": "w:xz"}[kind]) as t:
            t.add(member, "pairs.jsonl")
    else:
        out.write({"7z": b"7z\xbc\xaf\x27\x1c", "rar": b"Rar!\x1a\x07\x00"}[kind] + os.urandom(200))
    return out.getvalue()


@pytest.mark.parametrize(
    "kind, named",
    [
        ("zip-stored", "zip"),  # read as text, the stored member's lines were used but the first
        ("zip-deflated", "zip"),  # refused as invalid UTF-8
        ("tar", "tar"),
        ("tar.gz", "gzip-compressed tar"),
        ("tar.xz", "xz-compressed tar"),
        ("7z", "7z"),
        ("rar", "rar"),
    ],
)
def test_an_archive_is_refused_in_one_line_naming_the_container(tmp_path, monkeypatch, kind, named):
    path = tmp_path / "pairs.jsonl"  # the name says JSON lines; the content decides
    (tmp_path / "member").mkdir()
    path.write_bytes(archive(kind, tmp_path / "member"))
    with pytest.raises(ValueError) as failure:
        run_prepare(tmp_path, monkeypatch, source=str(path))
    assert str(failure.value) == (
        f"{path}: the file is a {named} archive, not JSON lines: unpack it and give its .jsonl file"
    )
    assert not (tmp_path / "data" / "processed").exists()  # nothing written


def test_numbers_too_large_for_the_arithmetic_quarantine_their_row_and_huge_ranks_still_rank(tmp_path):
    huge = "9" * 5000  # json.loads refuses integers over 4,300 digits
    lines = [
        json.dumps(ROWS[0]),
        '{"prompt": "Q?", "chosen": "A.", "rejected": "B.", "score": ' + huge + "}",
        '{"prompt": "Mood?", "responses": ["sad", "glad"], "ranks": [1' + "0" * 400 + ", 2]}",  # 401 digits
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = list(read_jsonl(str(path)))
    assert isinstance(rows[1][1], RowError) and str(rows[1][1]).startswith("invalid JSON: a number too long to read")
    result = prepare([rows[0], rows[1]])
    kept = [row for split in result.splits.values() for row in split]
    assert result.rows_in == 2 and len(kept) == 1 and [q["line"] for q in result.quarantine] == [2]  # conserved
    ranked = prepare([rows[2]], fmt="ranking")  # compared exactly as integers: the 401-digit rank is the worse
    (pair,) = [row for split in ranked.splits.values() for row in split]
    assert (pair["chosen"][0]["content"], pair["rejected"][0]["content"]) == ("glad", "sad")


def test_an_empty_source_and_a_source_of_the_wrong_format_fail_the_stage(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    wrong = write_rows(tmp_path / "wrong.jsonl", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(ValueError) as failure:
        run_prepare(
            tmp_path,
            monkeypatch,
            source=write_rows(tmp_path / "good.jsonl", ROWS),
            more_sources=[{"source": str(empty)}, {"source": wrong}],
        )
    assert str(failure.value).splitlines() == [
        f"preference source {empty}: no rows",
        f"preference source {wrong}: none of 2 rows is usable; first reason: row has keys ['text']; "
        "expected chosen/rejected, prompt/chosen/rejected or prompt/responses",
    ]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_root(tmp_path):
    """A static HTTP server on 127.0.0.1 (a free port) serving tmp_path; stopped after the test."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_url_with_a_query_string_is_read_by_its_content(tmp_path, monkeypatch, http_root):
    write_rows(tmp_path / "pairs.jsonl.gz", ROWS, "gzip")
    write_rows(tmp_path / "plain.jsonl.gz", ROWS[:2])
    url = f"{http_root}/pairs.jsonl.gz?download=true"
    assert [row for _, row in read_jsonl(url)] == ROWS
    assert [row for _, row in read_jsonl(f"{http_root}/plain.jsonl.gz?download=true")] == ROWS[:2]
    counts = run_prepare(tmp_path, monkeypatch, source=url, more_sources=[{"source": f"{http_root}/pairs.jsonl.gz"}])
    assert counts["rows_in"] == 8 and counts["quarantined"] == 0


def test_a_conversation_in_two_sources_of_two_kinds_stays_in_one_split():
    # "Hi" opens a conversation in both files (HH has a few such short openers): its pairs share one split
    # whichever file they come from, and each row keeps its own source's name and kind
    harmless = [(1, {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."})]
    helpful = [
        (1, {"prompt": "Hi", "chosen": "Hello! How can I help?", "rejected": "Hi."}),
        (2, {"prompt": "Bye", "chosen": "Goodbye!", "rejected": "What?"}),
    ]
    fractions = {"sft": 0.1, "rm_train": 0.9}
    prepared = prepare_rows(
        [Source("h.jsonl", iter(harmless), kind="harmless"), Source("p.jsonl", iter(helpful), kind="helpful")],
        fractions,
    )
    where = {
        (r["source"], r["prompt"][0]["content"]): (s, r["kind"]) for s, rows in prepared.splits.items() for r in rows
    }
    # by hand: unit_point("Hi") = 0.2118 is past sft's 0.1, in rm_train; unit_point("Bye") = 0.0724 is sft
    assert round(unit_point("Hi"), 4) == 0.2118 and round(unit_point("Bye"), 4) == 0.0724
    assert where == {
        ("h", "Hi"): ("rm_train", "harmless"),
        ("p", "Hi"): ("rm_train", "helpful"),
        ("p", "Bye"): ("sft", "helpful"),
    }


def test_a_json_string_that_cannot_be_text_quarantines_its_row_with_file_line_and_place(tmp_path, monkeypatch):
    # JSON allows any \uXXXX escape: a lone surrogate (high, low, reversed pair) in a value, a nested content or a
    # key parses, but no UTF-8 file can hold it; a pair written properly (an emoji) is text
    lines = [
        json.dumps(ROWS[0]),
        '{"prompt": "Q?", "chosen": "A \\ud800 b", "rejected": "B."}',
        '{"prompt": [{"role": "user", "content": "Q?"}], "chosen": [{"role": "assistant", "content": "\\udc00"}], '
        '"rejected": [{"role": "assistant", "content": "B."}]}',
        '{"prompt": "Q?", "chosen": "A.", "rejected": "B.", "note\\udfff": 1}',
        '{"prompt": "Q?", "chosen": "\\udc00\\ud800", "rejected": "B."}',
        json.dumps({**ROWS[1], "chosen": "Good answer \U0001f600."}),
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    counts = run_prepare(tmp_path, monkeypatch, source=str(path))
    assert counts["rows_in"] == 6 and counts["quarantined"] == 4
    quarantine = load_jsonl(str(tmp_path / "data" / "processed" / "quarantine.jsonl"))
    assert [(q["file"], q["line"], q["row"]) for q in quarantine] == [(str(path), n, None) for n in (2, 3, 4, 5)]
    assert [q["reason"].split(" (JSON")[0] for q in quarantine] == [
        "not text: chosen holds a lone surrogate \\ud800 at character 2",
        "not text: chosen[0].content holds a lone surrogate \\udc00 at character 0",
        "not text: a key of the row holds a lone surrogate \\udfff at character 4",
        "not text: chosen holds a lone surrogate \\udc00 at character 0",
    ]


@pytest.mark.parametrize("installed", ["another zstd backend", "none"])
def test_a_zstd_file_without_zstandard_says_what_to_install_in_one_line(tmp_path, monkeypatch, installed):
    import importlib.util

    import fsspec.compression

    path = write_rows(tmp_path / "pairs.jsonl.zst", ROWS, "zstd")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "zstandard" else find_spec(name))
    if installed == "none":
        monkeypatch.delitem(fsspec.compression.compr, "zstd", raising=False)
    with pytest.raises(ValueError) as failure:
        run_prepare(tmp_path, monkeypatch, source=path)
    assert str(failure.value) == (
        f"{path}: the file is zstd-compressed, but Python's zstandard module, which reads it, is not installed "
        "(pip install zstandard)"
    )


@pytest.mark.parametrize(
    "content, what",
    [
        ("utf-16", "UTF-16 text, not UTF-8: convert it (iconv -f UTF-16 -t UTF-8)"),  # with its byte-order mark
        ("utf-16-le", "UTF-16LE text, not UTF-8: convert it (iconv -f UTF-16LE -t UTF-8)"),  # without
        ("utf-16-be", "UTF-16BE text, not UTF-8: convert it (iconv -f UTF-16BE -t UTF-8)"),
        ("utf-32", "UTF-32 text, not UTF-8: convert it (iconv -f UTF-32 -t UTF-8)"),
        ("utf-32-le", "UTF-32LE text, not UTF-8: convert it (iconv -f UTF-32LE -t UTF-8)"),  # was called UTF-16
        ("utf-32-be", "UTF-32BE text, not UTF-8: convert it (iconv -f UTF-32BE -t UTF-8)"),
        (
            "zst utf-16-le",
            "UTF-16LE text, not UTF-8: convert it (iconv -f UTF-16LE -t UTF-8) (zstd-compressed: decompress it first)",
        ),  # fmt: skip
        ("parquet", "a Parquet file, not JSON lines: write its rows as JSON lines"),
        ("array", "one JSON array, not JSON lines (one object a line): write one row a line (jq -c '.[]')"),
        ("pretty array", "one JSON array, not JSON lines (one object a line): write one row a line (jq -c '.[]')"),
    ],
)
def test_a_file_of_another_encoding_or_format_is_refused_in_one_line_saying_what_it_is(
    tmp_path, monkeypatch, content, what
):
    rows = [{**row, "chosen": "你好, " + row["chosen"]} for row in ROWS]  # not ASCII: no NUL beside every letter
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    data = {
        "parquet": b"PAR1" + os.urandom(200) + b"PAR1",
        "array": json.dumps(ROWS).encode(),
        "pretty array": json.dumps(ROWS, indent=2).encode(),
    }.get(content) or text.encode(content.removeprefix("zst "))
    path = tmp_path / "pairs.jsonl.gz"  # the name says gzip'd JSON lines; the content decides
    path.write_bytes(
        gzip.compress(data) if content == "array" else COMPRESS["zstd"](data) if "zst" in content else data
    )
    with pytest.raises(ValueError) as failure:
        run_prepare(tmp_path, monkeypatch, source=str(path))
    assert str(failure.value).startswith(f"{path}: the file is {what}") and "\n" not in str(failure.value)
    assert not (tmp_path / "data" / "processed").exists()  # nothing written
