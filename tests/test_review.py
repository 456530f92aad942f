"""The blind A/B human review (tasks/cli/review.py): export, a rater's filled file, import, MLflow logging."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from tasks.cli import review

RUNNER = CliRunner()
HEADER = ["row", "prompt", "response_a", "response_b", "preference", "comment"]


def write_samples(folder, n: int = 50, run_id: str = "run-0") -> str:
    """A samples.json of ``n`` prompts with two samples each (only sample 0 is exported by default)."""
    rows = []
    for i in range(n):
        for sample in (0, 1):
            prompt = f"question {i}?" if i != 3 else "- a list item, then a question?"  # formula-like start
            rows.append({
                "id": f"p{i}", "sample": sample, "messages": [{"role": "user", "content": prompt}], "prompt": prompt,
                "sft_response": f"sft {i}.{sample}", "policy_response": f"policy {i}.{sample}" if i else "=1+1",
                "sft_proxy": 0.0, "policy_proxy": 1.0, "sft_judge": 0.0, "policy_judge": 1.0,
            })  # fmt: skip
    path = os.path.join(folder, "samples.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"run_id": run_id, "samples": rows}, handle)
    return path


def export(folder, *extra: str) -> tuple[str, str, dict]:
    """Export into ``folder``; returns (csv path, key path, key)."""
    out, key = os.path.join(folder, "ab.csv"), os.path.join(folder, "ab_key.json")
    args = ["export", "--samples", os.path.join(folder, "samples.json"), "--out", out, "--key", key, *extra]
    result = RUNNER.invoke(review.app, args)
    assert result.exit_code == 0, result.output
    with open(key, encoding="utf-8") as handle:
        return out, key, json.load(handle)


def read_rows(path: str) -> list[list[str]]:
    with open(path, encoding="utf-8-sig", newline="") as handle:
        return list(csv.reader(handle))


def fill(path: str, key: dict, choose, out: str | None = None, delimiter: str = ",") -> str:
    """Fill the preference column with ``choose(row number, the policy's letter)`` as a rater would."""
    rows = read_rows(path)
    for record in rows[1:]:
        record[4] = choose(int(record[0]), key["rows"][record[0]]["policy"])
    out = out or path
    with open(out, "w", encoding="utf-8-sig", newline="") as handle:
        csv.writer(handle, delimiter=delimiter).writerows(rows)
    return out


def other(letter: str) -> str:
    return "B" if letter == "A" else "A"


def import_(filled: str, key: str, *extra: str):
    return RUNNER.invoke(review.app, ["import", filled, "--key", key, "--no-log", *extra])


def test_round_trip_30_of_50(tmp_path):
    write_samples(tmp_path)
    out, key_path, key = export(tmp_path)
    with open(out, "rb") as handle:
        assert handle.read(3) == b"\xef\xbb\xbf"  # BOM: Excel reads the file as UTF-8
    rows = read_rows(out)
    assert rows[0] == HEADER and len(rows) == 51 and all(r[4] == "" for r in rows[1:])
    # blind: the letter in the key shows the policy's response, the other letter SFT's; only sample 0
    for record in rows[1:]:
        i, policy = int(record[0]) - 1, key["rows"][record[0]]["policy"]
        shown = {"A": record[2], "B": record[3]}
        assert shown[other(policy)] == f"sft {i}.0" and key["rows"][record[0]]["id"] == f"p{i}"
        assert shown[policy] == (f"policy {i}.0" if i else "'=1+1")  # a formula-like cell is quoted
    assert rows[4][1] == "'- a list item, then a question?"
    policies = [v["policy"] for v in key["rows"].values()]
    assert set(policies) == {"A", "B"}  # the order is not constant
    assert key["run_id"] == "run-0" and key["seed"] == 0 and len(key["samples_sha256"]) == 64

    fill(out, key, lambda n, policy: policy if n <= 30 else other(policy).lower())  # policy wins 30 of 50
    result = import_(out, key_path)
    assert result.exit_code == 0, result.output
    # Wilson 95% by hand, x = 30, n = 50, z = 1.96, z^2 = 3.8415:
    # (x + z^2/2 -+ z sqrt(x (n - x) / n + z^2 / 4)) / (n + z^2) = (31.9207 -+ 1.96 * sqrt(12.9604)) / 53.8415
    # = (31.9207 -+ 7.0561) / 53.8415 = [0.4618, 0.7239]
    assert (
        "human win rate 0.600 [0.462, 0.724] (Wilson 95%) over 50 decisive rows, 0 ties, 0 not rated, 0 unusable"
        in (result.stdout)
    )
    found, problems, notes = review.read_review(out, key)
    assert (found.wins, found.decisive, problems, notes) == (30, 50, [], [])
    assert found.rate == 0.6 and found.interval == pytest.approx((0.4618, 0.7239), abs=1e-4)


def test_order_reproducible_for_a_seed(tmp_path):
    write_samples(tmp_path)
    first = export(tmp_path)[2]["rows"]
    assert export(tmp_path, "--force")[2]["rows"] == first  # same seed: same order
    assert export(tmp_path, "--force", "--seed", "1")[2]["rows"] != first
    assert review.assign_sides(50, 7) == review.assign_sides(50, 7)
    args = [
        "--samples",
        str(tmp_path / "samples.json"),
        "--out",
        str(tmp_path / "ab.csv"),
        "--key",
        str(tmp_path / "k.json"),
    ]
    result = RUNNER.invoke(review.app, ["export", *args])
    assert result.exit_code == 1 and "ab.csv exists" in result.stderr and "--force" in result.stderr


def test_partly_filled_counts_the_rest(tmp_path):
    write_samples(tmp_path, n=20)
    out, key_path, key = export(tmp_path)
    # rows 1-8: policy; 9-10: SFT; 11-12: tie; 13-20 blank (not rated yet)
    choices = {**dict.fromkeys(range(1, 9), "policy"), 9: "sft", 10: "sft", 11: " Tie ", 12: "TIE"}
    fill(out, key, lambda n, p: {"policy": p, "sft": other(p)}.get(choices.get(n, ""), choices.get(n, "")))
    result = import_(out, key_path)
    assert result.exit_code == 0, result.output
    assert f"{out}: 8 rows not rated yet (rows 13, 14, 15, 16, 17, 18, 19, 20)" in result.stdout
    assert (
        "human win rate 0.800 [0.490, 0.943] (Wilson 95%) over 10 decisive rows, 2 ties, 8 not rated, 0 unusable"
        in (result.stdout)
    )  # wilson_interval(8, 10) = (0.4902, 0.9433)
    # a rater deleted rows 19 and 20: they count as not rated, and the file says so
    rows = read_rows(out)[:-2]
    with open(out, "w", encoding="utf-8", newline="") as handle:  # no BOM this time: read all the same
        csv.writer(handle).writerows(rows)
    result = import_(out, key_path)
    assert "2 rows of the key are not in the file, counted as not rated (rows 19, 20)" in result.stdout
    assert "8 not rated" in result.stdout


def test_no_decisive_row_is_undefined(tmp_path):
    write_samples(tmp_path, n=4)
    out, key_path, key = export(tmp_path)
    fill(out, key, lambda n, p: "tie" if n < 3 else "")
    result = import_(out, key_path)
    assert result.exit_code == 0
    assert "human win rate undefined: no decisive rows (2 ties, 2 not rated, 0 unusable)" in result.stdout
    assert "nan" not in result.stdout.lower()
    metrics = review.read_review(out, key)[0].metrics()
    assert math.isnan(metrics["human/win_rate"]) and metrics["human/ties"] == 2.0


def test_bad_cells_are_reported_and_the_rest_used(tmp_path):
    write_samples(tmp_path, n=10)
    out, key_path, key = export(tmp_path)
    fill(out, key, lambda n, p: {7: "maybe", 8: "A B"}.get(n, p))
    rows = read_rows(out)
    rows[9][1] = "another prompt"  # row 9: not the exported prompt (edited, or another export's file)
    with open(out, "w", encoding="utf-8-sig", newline="") as handle:
        csv.writer(handle).writerows(rows)
    result = import_(out, key_path)
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f'{out} row 7: preference "maybe" is not A, B or tie; row left out',
        f'{out} row 8: preference "A B" is not A, B or tie; row left out',
        f"{out} row 9: the prompt is not what was exported as row 9 (another export, or edited); row left out",
    ]
    assert "human win rate 1.000 [0.646, 1.000] (Wilson 95%) over 7 decisive rows, 0 ties, 0 not rated, 3 unusable" in (
        result.stdout
    )


def test_semicolon_file_from_a_spreadsheet(tmp_path):
    write_samples(tmp_path, n=10)
    out, key_path, key = export(tmp_path)
    filled = fill(out, key, lambda n, p: p if n <= 6 else other(p), out=str(tmp_path / "filled.csv"), delimiter=";")
    assert read_rows(filled)[0] == [";".join(HEADER)]  # one column to the csv module's default reader
    result = import_(filled, key_path)
    assert result.exit_code == 0, result.output
    assert "human win rate 0.600 " in result.stdout and "over 10 decisive rows" in result.stdout


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda rows: [[c for i, c in enumerate(r) if i != 4] for r in rows],
         ': no column "preference" (header: row, prompt, response_a, response_b, comment); '
         "keep the columns row, preference as exported"),
        (lambda rows: rows + [["51", "x", "", "", "A", ""]], ' line 12: row number "51" is not in the key (rows 1-10)'),
        (lambda rows: rows + [list(rows[3])], " row 3: appears 2 times (lines 4, 12); each row must appear once"),
        (lambda rows: rows[:1], ": no rows under the header"),
        (lambda rows: [], ": empty file"),
    ],
    ids=["missing column", "unknown row", "duplicate row", "header only", "empty"],
)  # fmt: skip
def test_files_that_cannot_be_used(tmp_path, edit, message):
    write_samples(tmp_path, n=10)
    out, key_path, key = export(tmp_path)
    fill(out, key, lambda n, p: p)
    rows = edit(read_rows(out))
    with open(out, "w", encoding="utf-8-sig", newline="") as handle:
        csv.writer(handle).writerows(rows)
    result = import_(out, key_path)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"{out}{message}"]
    assert "human win rate" not in result.stdout


def test_parse_preference_and_tally():
    assert [review.parse_preference(c) for c in ("a", " B ", "Tie", "t i e", "", None)] == ["A", "B", "tie", "tie",
                                                                                             None, None]  # fmt: skip
    with pytest.raises(ValueError, match='"=" is not A, B or tie'):
        review.parse_preference("=")
    assert [review.outcome(p, "B") for p in ("A", "B", "tie")] == ["loss", "win", "tie"]
    found = review.tally(["win", "win", "loss", "tie", None], unusable=1)
    assert (found.wins, found.decisive, found.ties, found.unrated, found.unusable) == (2, 3, 1, 1, 1)
    assert review.spreadsheet_safe("@x") == "'@x" and review.spreadsheet_safe("plain") == "plain"
    assert review.prompt_digest("'=a  b\r\nc") == review.prompt_digest("=a b\nc")


@pytest.fixture
def tracked_project(tmp_path, empty_db, monkeypatch):
    """A project folder (cwd) with its own sqlite MLflow store and one run: the evaluate stage's stand-in."""
    from tasks.kit.runs import tracking_client

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"mlflow": {"tracking_uri": "sqlite:///mlflow.db",
                                                                     "experiment": "rlhf"}}))  # fmt: skip
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    client, experiment_id = tracking_client()
    run = client.create_run(experiment_id, run_name="evaluate")
    client.set_terminated(run.info.run_id, "FINISHED")
    return client, run.info.run_id


def test_import_logs_to_the_run_in_the_key(tracked_project, tmp_path):
    client, run_id = tracked_project
    os.makedirs(tmp_path / "review")
    write_samples(tmp_path / "review", n=10, run_id=run_id)
    out, key_path, key = export(tmp_path / "review")
    fill(out, key, lambda n, p: p if n <= 6 else (other(p) if n <= 8 else "tie"))
    os.chdir(tmp_path / "review")  # a folder below the project root: the project is found from here
    result = RUNNER.invoke(review.app, ["import", "ab.csv", "--key", "ab_key.json"])
    assert result.exit_code == 0, result.output
    assert f"logged to MLflow run {run_id}" in result.stdout
    metrics = client.get_run(run_id).data.metrics
    assert metrics["human/win_rate"] == 0.75 and (metrics["human/decisive"], metrics["human/ties"]) == (8.0, 2.0)
    assert (metrics["human/unrated"], metrics["human/unusable"]) == (0.0, 0.0)
    assert (metrics["human/win_rate_low"], metrics["human/win_rate_high"]) == pytest.approx((0.4093, 0.9285), abs=1e-4)
    assert [f.path for f in client.list_artifacts(run_id, "review")] == ["review/ab.csv"]

    key["run_id"] = "0" * 32  # a run the store does not hold: one line, exit 1, after the figures
    with open("ab_key.json", "w", encoding="utf-8") as handle:
        json.dump(key, handle)
    result = RUNNER.invoke(review.app, ["import", "ab.csv", "--key", "ab_key.json"])
    assert result.exit_code == 1 and "human win rate 0.750" in result.stdout
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"review: MLflow run {'0' * 32}: ")


def test_a_file_from_another_export_never_counts_a_row_against_the_wrong_key(tmp_path):
    write_samples(tmp_path)
    os.makedirs(tmp_path / "other")
    shutil.copy(tmp_path / "samples.json", tmp_path / "other" / "samples.json")
    out, _, key = export(tmp_path)  # seed 0: the rater fills this file, preferring the policy in every row
    _, other_key_path, other_key = export(tmp_path / "other", "--seed", "1")
    fill(out, key, lambda n, policy: policy)
    found, problems, _ = review.read_review(out, other_key)
    flipped = [n for n in key["rows"] if key["rows"][n]["policy"] != other_key["rows"][n]["policy"]]
    assert flipped and len(problems) == len(flipped) and found.unusable == len(flipped)
    assert all("is not what was exported" in line and "response_a and response_b" in line for line in problems)
    assert (found.wins, found.losses) == (50 - len(flipped), 0)  # the rows left are read right: all wins
