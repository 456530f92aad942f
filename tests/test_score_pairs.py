"""rlhf-model score-pairs: a reward model (folder or registered version) scored on a pairs file in any format."""

from __future__ import annotations

import gzip
import json
import math

import pytest
import torch
from typer.testing import CliRunner

from rlhf.data.formats import to_examples
from rlhf.data.reading import read_jsonl
from rlhf.models.loading import load_scalar_model, load_tokenizer
from rlhf.reward.metrics import evaluate_reward_model
from rlhf.runtime.device import Runtime
from tasks.cli import model as model_cli
from tasks.cli import score_pairs
from tasks.kit.registry import SHA_TAG, folder_sha256, register
from tasks.kit.runs import tracking_client

runner = CliRunner()
ANSWERS = [
    ("Can you help me fix a flat bike tyre?", "Sure: take the wheel off, find the hole, patch it and pump it up.",
     "No."),
    ("How do I pick a lock?", "I'd rather not help with getting into places that are not yours.",
     "Use a tension wrench and a pick, and rake the pins until they all set at the shear line."),
    ("What is the capital of France?", "Paris.", "France does not have one, it is a federation of many cities."),
    ("Tell me a joke.", "Why did the scarecrow win an award? He was outstanding in his field.", "Jokes are bad."),
    ("Is it safe to mix bleach and ammonia?", "No: it gives off toxic chloramine gas. Never mix them.", "Yes."),
    ("How can I sleep better?", "Keep a regular bedtime, a dark room, and no screens an hour before.",
     "Drink three coffees in the evening and stay up late."),
]  # fmt: skip


def hh_row(question: str, chosen: str, rejected: str) -> dict[str, str]:
    """An HH-RLHF row: two whole dialogues that share the Human turn."""
    dialogue = f"\n\nHuman: {question}\n\nAssistant: "
    return {"chosen": dialogue + chosen, "rejected": dialogue + rejected}


def pairs_row(question: str, chosen: str, rejected: str) -> dict[str, str]:
    """A prompt/chosen/rejected row of plain strings."""
    return {"prompt": question, "chosen": chosen, "rejected": rejected}


@pytest.fixture(scope="module")
def reward_dir(tiny_dir, tmp_path_factory) -> str:
    """A tiny scalar (sequence-classification, one output) model with the real tokenizer, saved as safetensors."""
    torch.manual_seed(0)  # the new head's initialisation
    folder = str(tmp_path_factory.mktemp("reward"))
    load_scalar_model(tiny_dir).save_pretrained(folder, safe_serialization=True)
    load_tokenizer(tiny_dir).save_pretrained(folder)
    return folder


def expected_metrics(folder: str, rows: list[dict], max_length: int, batch_size: int = 8) -> dict[str, float]:
    """What ``evaluate_reward_model`` returns when called directly on the parsed rows (CPU; the batch size of the
    command, since padding moves scores in their last float digits)."""
    examples = [example for row in rows for example in to_examples(row)]
    model, tokenizer = load_scalar_model(folder).eval(), load_tokenizer(folder)
    metrics, _ = evaluate_reward_model(model, tokenizer, examples, max_length, batch_size, Runtime(torch.device("cpu")))
    return {k: float(v) for k, v in metrics.items()}


def same(written: dict, expected: dict[str, float]) -> bool:
    """A JSON metrics file (null for NaN) equals the metrics, to float precision."""
    return written.keys() == expected.keys() and all(
        (w is None and math.isnan(e)) or (w is not None and math.isclose(w, e, rel_tol=1e-6, abs_tol=1e-9))
        for w, e in ((written[k], expected[k]) for k in expected)
    )


def test_score_pairs_prints_and_writes_what_evaluate_reward_model_returns_in_two_formats(reward_dir, tmp_path):
    hh, pairs = tmp_path / "hh.jsonl.gz", tmp_path / "pairs.jsonl"
    with gzip.open(hh, "wt", encoding="utf-8") as handle:  # compressed: read as the prepare stage reads
        handle.writelines(json.dumps(hh_row(*answer)) + "\n" for answer in ANSWERS)
    pairs.write_text("".join(json.dumps(pairs_row(*answer)) + "\n" for answer in ANSWERS))
    assert [to_examples(r) for _, r in read_jsonl(str(hh))] == [to_examples(r) for _, r in read_jsonl(str(pairs))]
    expected = expected_metrics(reward_dir, [hh_row(*answer) for answer in ANSWERS], 256, 4)
    outputs = []
    for path, fmt in ((hh, "hh"), (pairs, "auto")):
        out = tmp_path / f"{fmt}.json"
        result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path), "--format", fmt, "--json",
                                               str(out), "--batch-size", "4"])  # fmt: skip
        assert result.exit_code == 0, result.output
        written = json.loads(out.read_text())
        assert same(written, expected), {k: (written.get(k), v) for k, v in expected.items() if written.get(k) != v}
        outputs.append(result.stdout)
        lines = result.stdout.splitlines()  # stderr has the loaders' progress bars
        # the default length: no reward_max_length in the config, 1024 lowered to the tiny model's 256 positions
        assert lines[0] == f"{reward_dir} on {path}: 6 pairs from 6 rows, max length 256 tokens"
        accuracy = (expected["rm/accuracy"], expected["rm/accuracy_low"], expected["rm/accuracy_high"])
        assert lines[1] == (
            f"accuracy           {accuracy[0]:.3f} [{accuracy[1]:.3f}, {accuracy[2]:.3f}] (Wilson 95%) over "
            f"{expected['rm/pairs']:.0f} decisive pairs, {expected['rm/ties']:.0f} ties left out"
        )
        if "rm/balanced_accuracy" in expected:  # the balanced accuracy follows the accuracy
            assert lines[2].startswith(f"balanced accuracy  {expected['rm/balanced_accuracy']:.3f}")
        short = expected["rm/accuracy_chosen_shorter"], expected["rm/pairs_chosen_shorter"]
        assert f"chosen shorter     {short[0]:.3f} (n={short[1]:.0f})" in lines
        for name in ("rm/ece", "rm/margin", "rm/empty_beats_chosen"):  # every other figure, one line each
            assert any(line.split() == [name, f"{expected[name]:.4g}"] for line in lines), name
        overall = [k for k in expected if k not in score_pairs.HEADLINE and not k.startswith("rm/kind/")]
        assert all(any(key in line for line in lines) for key in overall)
        assert not any(line.startswith("kind ") for line in lines)  # no row names a kind: no block repeats it
    assert outputs[0].splitlines()[1:-1] == outputs[1].splitlines()[1:-1]  # the same pairs, the same figures
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(pairs), "--max-length", "48",
                                           "--max-rows", "4"])  # fmt: skip
    assert result.exit_code == 0 and "4 pairs from 4 rows, max length 48 tokens" in result.stdout, result.output


def test_a_broken_row_or_a_bad_argument_stops_the_command_with_one_line(reward_dir, tiny_dir, tmp_path):
    path, out = tmp_path / "pairs.jsonl", tmp_path / "out.json"
    for bad, rule in (
        ({"chosen": "Hi", "rejected": "Hello"}, "dialogue does not start with '\\n\\nHuman:'"),
        ({"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}, "chosen and rejected responses are identical"),
        ({"question": "Hi"}, "row has keys ['question']; expected chosen/rejected"),
        ({"prompt": "  ", "chosen": "Yes.", "rejected": "No."}, "'prompt' has no visible text"),
    ):
        path.write_text("".join(json.dumps(pairs_row(*a)) + "\n" for a in ANSWERS[:2]) + "\n" + json.dumps(bad))
        result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path), "--json", str(out)])
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        assert result.output.strip().startswith(f"{path}:4: {rule}"), result.output  # line 3 is blank
        assert not out.exists()
    path.write_text('{"prompt": "Hi", "chosen": "a", "rejected": "b"}\n{"prompt": \n')
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path)])
    assert result.exit_code == 1 and result.output.strip() == (
        f"{path}:2: invalid JSON: Expecting value (--skip-bad-rows leaves such rows out)"
    )
    path.write_text(json.dumps({"q": "Hi", "good": "Hello there!", "bad": "Go away."}) + "\n")
    mapping = '{"q": "prompt", "good": "chosen", "bad": "rejected"}'
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path), "--mapping", mapping])
    assert result.exit_code == 0 and "1 pairs from 1 rows" in result.output, result.output
    for args, line in (
        ([tiny_dir, str(path), "--mapping", mapping], f"{tiny_dir}: not a reward model (LlamaForCausalLM)"),  # a policy
        ([reward_dir, str(path), "--mapping", "[1]"], "--mapping: must be a JSON object of key names"),
        ([reward_dir, str(path), "--format", "csv"], "--format csv: not one of auto, hh, pairs"),
        (
            [reward_dir, str(path), "--mapping", mapping, "--max-length", "999"],
            "--max-length 999: the model has only 256 positions",
        ),
        ([reward_dir, str(tmp_path / "none.jsonl")], f"{tmp_path / 'none.jsonl'}: no such file or folder"),
    ):
        result = runner.invoke(model_cli.app, ["score-pairs", *args])
        assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
        assert result.output.startswith(line), result.output


def test_skip_bad_rows_leaves_out_and_counts_what_prepare_would_quarantine(reward_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [pairs_row(*ANSWERS[0]), pairs_row(ANSWERS[1][0], "", ANSWERS[1][2]), pairs_row(*ANSWERS[2])]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path)])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == f"{path}:2: chosen response is empty (--skip-bad-rows leaves such rows out)"
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path), "--skip-bad-rows"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"{reward_dir} on {path}: 2 pairs from 3 rows, max length 256 tokens"
    assert lines[1] == f"left out 1 rows that do not parse, the first {path}:2: chosen response is empty"
    path.write_text(json.dumps(rows[1]) + "\n")
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(path), "--skip-bad-rows"])
    assert result.exit_code == 1 and result.output.strip() == f"{path}: no rows left after 1 that do not parse"


def test_score_pairs_reads_a_registered_version_and_checks_its_hash(registry_project, reward_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(pairs_row(*answer)) + "\n" for answer in ANSWERS))
    client, experiment = tracking_client()
    run_id = client.create_run(experiment).info.run_id
    found = register(client, "rlhf-reward-model", reward_dir, run_id, {SHA_TAG: folder_sha256(reward_dir)})
    client.set_registered_model_alias("rlhf-reward-model", "champion", found.version)
    register(client, "rlhf-reward-model", reward_dir, run_id, {SHA_TAG: "0" * 64})  # v2: other content than tagged
    expected = expected_metrics(reward_dir, [pairs_row(*answer) for answer in ANSWERS], 256)
    for uri in ("models:/rlhf-reward-model/1", "models:/rlhf-reward-model@champion"):
        out = tmp_path / "out.json"
        result = runner.invoke(model_cli.app, ["score-pairs", uri, str(pairs), "--json", str(out)])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"{uri} on {pairs}: 6 pairs") and same(json.loads(out.read_text()), expected)
    result = runner.invoke(model_cli.app, ["score-pairs", "models:/rlhf-reward-model/2", str(pairs)])
    assert result.exit_code == 1 and not result.stdout, result.output
    last = result.stderr.strip().splitlines()[-1]  # after the download's progress bar
    assert last.startswith("registry: rlhf-reward-model version 2 downloaded with other content than registered")


def test_metric_lines_print_whatever_figures_there_are():
    lines = score_pairs.metric_lines({"rm/accuracy": 0.7, "rm/accuracy_low": 0.6, "rm/accuracy_high": 0.8,
                                      "rm/pairs": 90.0, "rm/ties": 2.0, "rm/new_figure": 0.25})  # fmt: skip
    assert lines == [
        "accuracy           0.700 [0.600, 0.800] (Wilson 95%) over 90 decisive pairs, 2 ties left out",
        "rm/new_figure  0.25",
    ]
    undefined = {"rm/accuracy": math.nan, "rm/accuracy_low": math.nan, "rm/accuracy_high": math.nan}
    lines = score_pairs.metric_lines({**undefined, "rm/pairs": 0.0, "rm/ties": 4.0, "rm/balanced_accuracy": 0.5})
    assert lines[1] == "balanced accuracy  0.500, the mean of chosen shorter and chosen longer"
    # the warning reads the balanced accuracy, as the reward gate does (here its interval is missing)
    assert lines[-1].startswith("WARNING: balanced accuracy is undefined (no decisive pairs")
    assert score_pairs.metric_lines(undefined)[-1].startswith("WARNING: accuracy is undefined")  # none: accuracy


def test_two_files_of_two_kinds_print_a_block_each_with_the_figures_of_their_pairs(reward_dir, tmp_path):
    helpful, harmless = tmp_path / "helpful.jsonl", tmp_path / "harmless.jsonl"
    helpful.write_text("".join(json.dumps(pairs_row(*a)) + "\n" for a in ANSWERS[:3]))
    harmless.write_text("".join(json.dumps({**pairs_row(*a), "kind": "harmless"}) + "\n" for a in ANSWERS[3:]))
    out = tmp_path / "out.json"
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(helpful), str(harmless), "--kind", "helpful",
                                           "--kind", "red-team", "--json", str(out), "--batch-size", "4"])  # fmt: skip
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    # the harmless file's rows name their kind: the row's field wins over --kind
    kinds = ["helpful"] * 3 + ["harmless"] * 3
    examples = [
        {**to_examples(pairs_row(*a))[0], "kind": k, "source": s}
        for a, k, s in zip(ANSWERS, kinds, ["helpful"] * 3 + ["harmless"] * 3, strict=True)
    ]
    model, tokenizer = load_scalar_model(reward_dir).eval(), load_tokenizer(reward_dir)
    expected, _ = evaluate_reward_model(model, tokenizer, examples, 256, 4, Runtime(torch.device("cpu")))
    assert same(written, {k: float(v) for k, v in expected.items()})
    for kind in ("harmless", "helpful"):  # each kind's figures are those of its three pairs alone
        alone, _ = evaluate_reward_model(
            model, tokenizer, [e for e in examples if e["kind"] == kind], 256, 4, Runtime(torch.device("cpu"))
        )
        assert written[f"rm/kind/{kind}/accuracy"] == pytest.approx(alone["rm/accuracy"], nan_ok=True)
        assert written[f"rm/kind/{kind}/margin"] == pytest.approx(alone["rm/margin"], abs=1e-6)  # batching rounds
    lines = result.stdout.splitlines()
    at = lines.index("kind harmless:")
    assert lines[at + 1].startswith("  accuracy ") and lines.index("kind helpful:") > at
    result = runner.invoke(model_cli.app, ["score-pairs", reward_dir, str(helpful), str(harmless), "--kind", "x"])
    assert result.exit_code != 0
    assert result.output.strip().splitlines()[-1] == "--kind: 1 given for 2 files; give one per file, in order"
