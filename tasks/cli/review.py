"""Blind A/B human review of the policy against the SFT model (``rlhf-review export`` / ``rlhf-review import``).

``export`` writes the eval prompts with both responses as a CSV to fill in a spreadsheet (A/B order random per
row, seeded) and the key (which letter is the policy) in a separate file that must not reach the raters.
``import`` reads the filled CSV back and computes the human win rate of the policy over SFT by the product's tie
rule (:mod:`rlhf.stats`: wins / decisive, ties apart, Wilson 95%), and logs it to the MLflow run named in the key.
Blank preferences are "not rated yet"; a row that cannot be used gets one line (file, row, rule) and the rest
count; a file that cannot be matched to its key is refused in one line per problem.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import time
from typing import Any

import typer

from rlhf.evaluation.review_tally import (
    METRICS,
    Tally,
    assign_sides,
    outcome,
    parse_preference,
    prompt_digest,
    prompt_text,
    spreadsheet_safe,
    tally,
)
from rlhf.files import atomic_write_text, write_json
from tasks.cli import run_command
from tasks.kit import paths
from tasks.kit.common import one_line

COLUMNS = ("row", "prompt", "response_a", "response_b", "preference", "comment")
CHECKED = ("prompt", "response_a", "response_b")  # cells the key holds a hash of: a row from another export is refused
REQUIRED = ("row", "preference")  # what import needs; the prompt column, when kept, is checked against the key
DELIMITERS = (",", ";", "\t")  # spreadsheets in some locales save CSV with ';'


class ReviewError(ValueError):
    """The review files cannot be used: one line per problem, each naming the file (and row) and the rule."""


def _numbers(rows: list[int], most: int = 10) -> str:
    shown = ", ".join(str(r) for r in rows[:most])
    return shown + (f", ... ({len(rows)} in all)" if len(rows) > most else "")


# ------------------------------------------------------------------------------------------------------ export


def build_review(samples: dict[str, Any], sample: int, seed: int, source: str) -> tuple[list[list[str]], dict]:
    """The CSV rows (without header) and the key of a blind review of ``samples`` (samples.json's content).

    Args:
        samples: ``{"run_id", "samples": [{"id", "sample", "prompt", "messages", "sft_response",
            "policy_response", ...}]}``.
        sample: which sample of each prompt to show (one comparison per prompt).
        seed: seed of :func:`assign_sides`.
        source: the samples file's name, for messages.

    Raises:
        ReviewError: a row lacks a field, a prompt appears twice for ``sample``, or no row has ``sample``.
    """
    rows = samples.get("samples") if isinstance(samples, dict) else None
    if not isinstance(rows, list):
        raise ReviewError(f'{source}: no "samples" list')
    chosen, seen = [], set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ReviewError(f"{source}: samples[{i}] is not an object")
        missing = [f for f in ("id", "sample", "prompt", "sft_response", "policy_response") if f not in row]
        if missing:
            raise ReviewError(f'{source}: samples[{i}] has no "{missing[0]}"')
        if row["sample"] != sample:
            continue
        if str(row["id"]) in seen:
            raise ReviewError(f"{source}: samples[{i}]: prompt id {row['id']} appears twice with sample {sample}")
        seen.add(str(row["id"]))
        chosen.append(row)
    if not chosen:
        found = sorted({str(r["sample"]) for r in rows})
        raise ReviewError(f"{source}: no rows with sample {sample} (samples found: {', '.join(found) or 'none'})")
    table, key_rows = [], {}
    for number, (row, policy) in enumerate(zip(chosen, assign_sides(len(chosen), seed), strict=True), start=1):
        first, second = (row["policy_response"], row["sft_response"])[:: 1 if policy == "A" else -1]
        prompt = spreadsheet_safe(prompt_text(row))
        table.append([str(number), prompt, spreadsheet_safe(str(first)), spreadsheet_safe(str(second)), "", ""])
        cells = dict(zip(CHECKED, (prompt, first, second), strict=True))
        key_rows[str(number)] = {
            "id": str(row["id"]),
            "policy": policy,
            "sha256": {c: prompt_digest(t) for c, t in cells.items()},
        }
    key = {"run_id": samples.get("run_id", ""), "seed": seed, "sample": sample, "rows": key_rows}
    return table, key


def csv_text(rows: list[list[str]]) -> str:
    """A CSV (header :data:`COLUMNS`, then ``rows``) starting with a UTF-8 BOM so Excel reads it as UTF-8."""
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    writer.writerows(rows)
    return "\ufeff" + buffer.getvalue()


# ------------------------------------------------------------------------------------------------------ import


def read_key(path: str) -> dict[str, Any]:
    """The key written by ``export``. Raises ReviewError (one line) when it is missing or not a key."""
    try:
        with open(path, encoding="utf-8") as handle:
            key = json.load(handle)
    except FileNotFoundError:
        raise ReviewError(f"{path}: no such key file (rlhf-review export writes it beside the CSV)") from None
    except (OSError, ValueError) as err:
        raise ReviewError(f"{path}: not a review key ({type(err).__name__}: {err})") from None
    rows = key.get("rows") if isinstance(key, dict) else None
    if (
        not isinstance(rows, dict)
        or not rows
        or not all(n.isdigit() and isinstance(v, dict) and v.get("policy") in ("A", "B") for n, v in rows.items())
    ):
        raise ReviewError(f'{path}: not a review key (needs "rows": {{"1": {{"id", "policy": "A" or "B"}}, ...}})')
    return key


def read_table(path: str) -> tuple[list[str], list[list[str]]]:
    """The header (names stripped, lower case) and the records of a CSV saved by a spreadsheet.

    Reads UTF-8 with or without a BOM; the delimiter (``,``, ``;`` or tab) is the one that makes the header hold
    the :data:`REQUIRED` columns. Raises ReviewError (one line) for an unreadable or empty file or a missing column.
    """
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise ReviewError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ReviewError(f"{path}: not UTF-8 text; save it from the spreadsheet as 'CSV UTF-8'") from None
    if not text.strip():
        raise ReviewError(f"{path}: empty file")
    parsed = {}
    for delimiter in DELIMITERS:
        records = list(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter))
        header = [name.strip().lower() for name in records[0]] if records else []
        if all(name in header for name in REQUIRED):
            return header, records[1:]
        parsed[delimiter] = header
    header = max(parsed.values(), key=len)
    missing = next(name for name in REQUIRED if name not in header)
    raise ReviewError(
        f'{path}: no column "{missing}" (header: {", ".join(header) or "none"}); keep the columns '
        f"{', '.join(REQUIRED)} as exported"
    )


def _row_number(cell: str) -> int | None:
    """The row number of a ``row`` cell (``"7"``, ``" 7 "``, ``"7.0"`` from a spreadsheet), None when it is none."""
    try:
        value = float(cell.strip())
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def read_review(path: str, key: dict[str, Any]) -> tuple[Tally, list[str], list[str]]:
    """Match a filled CSV to its key: ``(tally, problems, notes)``.

    ``problems`` has one line per row left out (a bad preference, a prompt that is not the exported one);
    ``notes`` says which rows are not rated yet (blank, or deleted from the file). Empty records are skipped.

    Raises:
        ReviewError: one line per problem when the file cannot be matched to the key: a required column
            missing, a row number not in the key, a row twice, no rows, or no prompt matching the key.
    """
    header, records = read_table(path)
    column = {name: header.index(name) for name in (*REQUIRED, *CHECKED) if name in header}
    rows = key["rows"]
    fatal, lines_of = [], {}
    for line, record in enumerate(records, start=2):  # the spreadsheet's line; the header is line 1
        if not any(cell.strip() for cell in record):
            continue
        cell = record[column["row"]] if column["row"] < len(record) else ""
        number = _row_number(cell)
        if number is None or str(number) not in rows:
            fatal.append(f'{path} line {line}: row number "{cell.strip()}" is not in the key (rows 1-{len(rows)})')
            continue
        lines_of.setdefault(number, []).append((line, record))
    for number, found in sorted(lines_of.items()):
        if len(found) > 1:
            where = ", ".join(str(line) for line, _ in found)
            fatal.append(f"{path} row {number}: appears {len(found)} times (lines {where}); each row must appear once")
    if not fatal and not lines_of:
        fatal.append(f"{path}: no rows under the header")
    if fatal:
        raise ReviewError("\n".join(fatal))
    outcomes, problems, blank, mismatched = [], [], [], 0
    for number, [(_, record)] in sorted(lines_of.items()):
        cells = {name: (record[i] if i < len(record) else "") for name, i in column.items()}
        expected = rows[str(number)].get("sha256") or {}
        changed = [c for c in CHECKED if c in cells and c in expected and prompt_digest(cells[c]) != expected[c]]
        if changed:
            mismatched += 1
            problems.append(
                f"{path} row {number}: the {' and '.join(changed)} is not what was exported as row {number} (another "
                "export, or edited); row left out"
            )
            continue
        try:
            preference = parse_preference(cells["preference"])
        except ValueError as err:
            problems.append(f"{path} row {number}: {err}; row left out")
            continue
        if preference is None:
            blank.append(number)
        outcomes.append(None if preference is None else outcome(preference, rows[str(number)]["policy"]))
    if mismatched and mismatched == len(lines_of):
        raise ReviewError(f"{path}: no row matches the key: the file and the key come from different exports")
    absent = sorted(int(n) for n in rows if int(n) not in lines_of)
    notes = []
    if blank:
        notes.append(f"{path}: {len(blank)} rows not rated yet (rows {_numbers(blank)})")
    if absent:
        notes.append(
            f"{path}: {len(absent)} rows of the key are not in the file, counted as not rated (rows {_numbers(absent)})"
        )
    return tally(outcomes + [None] * len(absent), unusable=len(problems)), problems, notes


def log_review(run_id: str, result: Tally, filled: str) -> str:
    """Log :meth:`Tally.metrics` and the filled CSV (artifact ``review/``) to MLflow run ``run_id``.

    Uses the tracking store of the project found from the current folder (as ``rlhf-registry`` does); returns a
    line naming the project and the run.

    Raises:
        ReviewError: no project, no run id, the store cannot be reached or the run does not exist (one line).
    """
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    from tasks.kit.registry import RegistryError, _project
    from tasks.kit.runs import tracking_client

    if not run_id:
        raise ReviewError("review: the key names no MLflow run (run_id); import with --no-log")
    here = os.getcwd()
    try:
        folder = _project(None)
        os.chdir(folder)
        # a person is waiting: a server that is down fails in seconds, not after MLflow's minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        client, _ = tracking_client()
        client.get_run(run_id)
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in result.metrics().items()])
        client.log_artifact(run_id, filled, "review")
    except RegistryError as err:
        raise ReviewError(f"review: {str(err).removeprefix('registry: ')}") from None
    except MlflowException as err:
        first = one_line(str(err.message)) or type(err).__name__
        raise ReviewError(f"review: MLflow run {run_id}: {first}") from None
    except (OSError, ValueError) as err:  # requests' ConnectionError is an OSError; a bad params.yaml a ValueError
        raise ReviewError(f"review: MLflow run {run_id}: not logged ({type(err).__name__}: {err})") from None
    finally:
        os.chdir(here)
    return f"logged to MLflow run {run_id} (project {folder}): {', '.join(METRICS)} as human/..., {filled} as review/"


# ------------------------------------------------------------------------------------------------- the command

app = typer.Typer(
    rich_markup_mode="markdown",  # the docstrings' `code` shown as code, not as backticks
    help="Blind A/B human review of the policy against the SFT model: export a CSV for raters, import it filled.",
    no_args_is_help=True,
)


def _fail(err: ReviewError) -> typer.Exit:
    """Print the error's lines to stderr; the exit (status 1) for the caller to raise."""
    typer.echo(str(err), err=True)
    return typer.Exit(1)


@app.command()
def export(
    samples: str = typer.Option(paths.SAMPLES, help="the evaluate stage's samples"),
    out: str = typer.Option("review/ab.csv", help="the CSV for the raters"),
    key: str = typer.Option("review/ab_key.json", help="the key (which letter is the policy): NEVER give it to raters"),
    seed: int = typer.Option(0, help="seed of the random A/B order"),
    sample: int = typer.Option(0, help="which sample of each prompt to compare (one row per prompt)"),
    force: bool = typer.Option(False, help="replace an existing CSV and key (a rater's work in it is lost)"),
) -> None:
    """Write the eval prompts with both responses in a random A/B order per row, and the key apart.

    Raters fill the preference column with A, B or tie (and may comment).
    The key file says which letter is the policy: never give it to the raters.
    """
    try:
        if os.path.abspath(out) == os.path.abspath(key):
            raise ReviewError(f"{key}: the key must be a file apart from the CSV")
        for path in (out, key):
            if os.path.exists(path) and not force:
                raise ReviewError(f"{path} exists (a review may be under way); pass --force to replace it")
        try:
            with open(samples, "rb") as handle:
                raw = handle.read()
            content = json.loads(raw)
        except (OSError, ValueError) as err:
            raise ReviewError(f"{samples}: cannot read the samples ({type(err).__name__}: {err})") from None
        table, key_content = build_review(content, sample, seed, samples)
    except ReviewError as err:
        raise _fail(err) from None
    key_content["samples_sha256"] = hashlib.sha256(raw).hexdigest()
    atomic_write_text(out, csv_text(table))
    write_json(key, key_content)
    policy_a = sum(v["policy"] == "A" for v in key_content["rows"].values())
    typer.echo(f"wrote {out}: {len(table)} rows to rate (A, B or tie in the preference column)")
    typer.echo(f"wrote {key}: the key ({policy_a} rows show the policy as A): keep it from the raters")


@app.command("import")
def import_(
    filled: str = typer.Argument(..., help="the CSV filled by a rater"),
    key: str = typer.Option("review/ab_key.json", help="the key written by export"),
    log: bool = typer.Option(True, help="log the result and the file to the MLflow run named in the key"),
) -> None:
    """Compute the human win rate of the policy over SFT (ties apart, Wilson 95%) from a filled CSV.

    Rows left blank count as not rated yet; a row that cannot be used is reported and left out.
    """
    try:
        if not os.path.isfile(filled):  # the file named first is the one to name first
            raise ReviewError(f"{filled}: no such CSV file (the file a rater filled, from rlhf-review export)")
        key_content = read_key(key)
        result, problems, notes = read_review(filled, key_content)
    except ReviewError as err:
        raise _fail(err) from None
    for line in problems:
        typer.echo(line, err=True)
    for line in notes:
        typer.echo(line)
    typer.echo(result.line())
    if log:
        try:
            typer.echo(log_review(key_content.get("run_id", ""), result, os.path.abspath(filled)))
        except ReviewError as err:
            raise _fail(err) from None


def console() -> None:
    """The console command (pyproject's scripts): :data:`app` through :func:`tasks.cli.run_command`."""
    run_command(app)


if __name__ == "__main__":
    console()
