"""Mutation run: plant one-line bugs in the product and check that the unit suite catches each.

Each mutant is one replacement of an exact substring of one product line (a
flipped KL sign, logits read one position late, the ptx term dropped, ...).
For each, the repository's files (``git ls-files -co --exclude-standard``, the
tracked and unignored files, no ``.venv``) are copied to a temporary folder,
the one replacement is applied there, and the unit suite (``pytest -m "not
integration" -x``) runs in the copy with the copy's ``src/`` first on the
import path (checked: ``import rlhf`` must resolve to the copy, not to the
editable install). A mutant is *caught* when the suite fails, *survived*
when it passes. The unmutated copy runs first: a failing baseline would make
every mutant look caught, so the run stops there (or, with
``--tolerate-baseline-failures``, deselects the failing tests in every mutant
run and records them: for a tree other people are editing).

Not part of ``make test`` or CI (one suite run per mutant, minutes each). Run with
``make mutants``; writes ``reports/mutants.json`` and prints a table and the kill ratio.

Usage:
    python -m bench.mutants                   # every mutant
    python -m bench.mutants --only logits-one-late --only ptx-dropped
    python -m bench.mutants --list            # names, files, and whether each still applies
    python -m bench.mutants --tests tests/test_positions.py   # what one test file catches on its own
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import typer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join("reports", "mutants.json")
PYTEST_ARGS = ["-m", "pytest", "-q", "-m", "not integration", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``path``, the one occurrence of ``original`` becomes ``replacement``."""

    name: str
    path: str
    original: str
    replacement: str
    what: str


LOSSES, LIKELIHOOD, FORWARD, SAMPLING, GENERATION, ROLLOUT, UPDATE = (
    "src/rlhf/losses.py",
    "src/rlhf/likelihood.py",
    "src/rlhf/models/forward.py",
    "src/rlhf/models/sampling.py",
    "src/rlhf/models/generation.py",
    "src/rlhf/ppo/rollout.py",
    "src/rlhf/ppo/update.py",
)

MUTANTS: list[Mutant] = [
    Mutant(
        "kl-sign",
        LOSSES,
        "torch.where(mask, -beta * logratio,",
        "torch.where(mask, beta * logratio,",
        "KL penalty with its sign flipped (a KL bonus)",
    ),
    Mutant(
        "gae-no-lambda",
        LOSSES,
        "gamma * lam * running",
        "gamma * running",
        "GAE without lambda",
    ),
    Mutant(
        "gae-from-last-column",
        LOSSES,
        "values = torch.where(mask, values, torch.zeros_like(values))",
        "values = values",
        "GAE recursion starts at the last column: bootstraps from the value of a pad",
    ),
    Mutant(
        "clip-never-taken",
        LOSSES,
        "taken = ((advantages > 0) & (log_ratio > bounds[1])) | ((advantages < 0) & (log_ratio < bounds[0]))",
        "taken = torch.zeros_like(mask)",
        "PPO-clip silently off: the unclipped ratio everywhere, however far the policy moved",
    ),
    Mutant(
        "ratio-inverted",
        LOSSES,
        "torch.where(mask, logprobs - old_logprobs,",
        "torch.where(mask, old_logprobs - logprobs,",
        "PPO ratio old / new instead of new / old",
    ),
    Mutant(
        "value-clip-dropped",
        LOSSES,
        "values_clipped = old_values + torch.clamp(values - old_values, -clip, clip)",
        "values_clipped = values",
        "value clipping silently off",
    ),
    Mutant(
        "bt-margin-sign",
        LOSSES,
        "-F.logsigmoid(chosen_scores - rejected_scores - margin)",
        "-F.logsigmoid(chosen_scores - rejected_scores + margin)",
        "Bradley-Terry margin with the wrong sign",
    ),
    Mutant(
        "unmasked-whitening",
        LOSSES,
        "mean = total(torch.where(mask, values, zeros).sum()) / count",
        "mean = values.mean()",
        "advantage whitening takes its mean over pads too",
    ),
    Mutant(
        "next-token-unshifted",
        LIKELIHOOD,
        "return logprobs_from_logits(logits[:, :-1], input_ids[:, 1:]), token_mask[:, 1:].bool()",
        "return logprobs_from_logits(logits[:, 1:], input_ids[:, 1:]), token_mask[:, 1:].bool()",
        "LM loss scores each token with its own position's logits (no shift)",
    ),
    Mutant(
        "last-index-by-count",
        LOSSES,
        "return (positions * mask).max(dim=-1).values",
        "return mask.sum(dim=-1) - 1",
        "last real token found by counting (wrong under left padding)",
    ),
    Mutant(
        "logits-one-late",
        FORWARD,
        "logits = output.logits[:, :-1]",
        "logits = output.logits[:, 1:]",
        "response logprobs read the logits one position late",
    ),
    Mutant(
        "eos-mask-off-by-one",
        SAMPLING,
        "eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()",
        "eos_before = torch.cumsum(is_eos.long(), dim=-1)",
        "response mask stops before the EOS instead of through it",
    ),
    Mutant(
        "score-one-early",
        FORWARD,
        "device=hidden.device), last_token_index(attention_mask)]",
        "device=hidden.device), last_token_index(attention_mask) - 1]",
        "reward score read one token before the last real token",
    ),
    Mutant(
        "reward-offset-ignored",
        FORWARD,
        "head_kinds(model), kinds) - offset",
        "head_kinds(model), kinds)",
        "reward model's centring offset not subtracted",
    ),
    Mutant(
        "values-one-late",
        ROLLOUT,
        "entry)[:, response_start - 1 : -1]",
        "entry)[:, response_start:]",
        "V(s_t) read one position late (at token t instead of the state before it)",
    ),
    Mutant(
        "value-calibration-ignored",
        ROLLOUT,
        "return head * scale + bias",
        "return head",
        "value head's shift and scale not applied",
    ),
    Mutant(
        "batch-statistics",
        ROLLOUT,
        "return losses.normalize_and_clip(values, self.mean, self.std, clip)",
        "return losses.normalize_and_clip(values, float(values.mean()), float(values.std(unbiased=False)), clip)",
        "reward normalised by the batch's statistics instead of the running ones",
    ),
    Mutant(
        "k3-reward",
        ROLLOUT,
        "rewards = losses.token_rewards(logratio, scores, mask, kl_coef)",
        "rewards = losses.token_rewards(losses.kl_k3(logratio), scores, mask, kl_coef)",
        "token reward penalised with k3 instead of k1",
    ),
    Mutant(
        "no-eos-constant-ignored",
        GENERATION,
        "return torch.where(unfinished, torch.full_like(scores, settings.no_eos_value), scores)",
        "return scores",
        "treat_unfinished 'constant' leaves unfinished responses their score",
    ),
    Mutant(
        "ptx-dropped",
        UPDATE,
        "loss = losses.ppo_ptx_loss(torch.zeros_like(ptx_loss), ptx_loss, config.ptx_coef)",
        "loss = losses.ppo_ptx_loss(torch.zeros_like(ptx_loss), ptx_loss, 0.0)",
        "PPO-ptx term computed and logged but not added to the policy loss",
    ),
]


class StaleMutant(RuntimeError):
    """A mutant's original text is no longer found exactly once in its file: update it in bench/mutants.py."""


def mutate(text: str, mutant: Mutant) -> str:
    """Apply ``mutant`` to the text of its file.

    Raises:
        StaleMutant: ``mutant.original`` occurs zero or several times (names the mutant and the count).
    """
    count = text.count(mutant.original)
    if count != 1:
        raise StaleMutant(
            f"mutant {mutant.name!r} is stale: {mutant.original!r} occurs {count} times in {mutant.path} "
            "(expected exactly once); update it in bench/mutants.py"
        )
    return text.replace(mutant.original, mutant.replacement)


def check_mutants(root: str, mutants: list[Mutant]) -> dict[str, str]:
    """Stale mutants against the files under ``root``: ``{name: message}`` (empty: all apply)."""
    problems = {}
    for mutant in mutants:
        path = os.path.join(root, mutant.path)
        if not os.path.isfile(path):
            problems[mutant.name] = f"mutant {mutant.name!r} is stale: {mutant.path} does not exist"
            continue
        with open(path, encoding="utf-8") as handle:
            try:
                mutate(handle.read(), mutant)
            except StaleMutant as error:
                problems[mutant.name] = str(error)
    return problems


def repository_files(repo: str) -> list[str]:
    """Tracked and untracked-but-unignored files of ``repo`` that exist on disk, ``.venv`` excluded."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    return sorted(
        {path for path in listed if path and not path.startswith(".venv/") and os.path.isfile(os.path.join(repo, path))}
    )


def copy_tree(source: str, dest: str, files: list[str]) -> None:
    """Copy ``files`` (paths relative to ``source``) to ``dest``, keeping metadata."""
    for path in files:
        target = os.path.join(dest, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(source, path), target)


def suite_env(copy: str) -> dict[str, str]:
    """Environment for a run in ``copy``: its ``src/`` and root first on the path, no bytecode written."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(copy, "src"), copy])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a same-size edit within a second must never reuse a stale .pyc
    return env


def check_imports_copy(python: str, copy: str) -> None:
    """Fail unless ``import rlhf`` in ``copy`` resolves to the copy's ``src/rlhf`` (not the editable install).

    Raises:
        RuntimeError: names the file that was imported instead.
    """
    found = subprocess.run(
        [python, "-c", "import rlhf; print(rlhf.__file__)"],
        cwd=copy,
        env=suite_env(copy),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    expected = os.path.realpath(os.path.join(copy, "src", "rlhf"))
    if os.path.dirname(os.path.realpath(found)) != expected:
        raise RuntimeError(f"import rlhf in {copy} resolved to {found}, not to the copy's {expected}")


def failed_tests(output: str) -> list[str]:
    """Test ids of the ``FAILED``/``ERROR`` lines of pytest's short summary."""
    return [
        line.split(" ", 1)[1].split(" - ", 1)[0]
        for line in output.splitlines()
        if line.startswith(("FAILED ", "ERROR "))
    ]


def run_suite(python: str, copy: str, timeout: float, extra: list[str] | None = None, stop_first: bool = True) -> dict:
    """Run the unit suite in ``copy`` (``-x`` unless ``stop_first`` is False), with ``extra`` pytest arguments.

    Returns:
        ``{"status", "returncode", "failed", "seconds", "tail"}``; status is ``passed``,
        ``failed`` (exit 1: a test failed), ``error`` (another non-zero exit, e.g. a
        collection error) or ``timeout``.
    """
    check_imports_copy(python, copy)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [python, *PYTEST_ARGS, *(["-x"] if stop_first else []), *(extra or [])],
            cwd=copy,
            env=suite_env(copy),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout or ""
        return {"status": "timeout", "returncode": None, "failed": [], "seconds": timeout, "tail": out[-2000:]}
    output = done.stdout + done.stderr
    status = {0: "passed", 1: "failed"}.get(done.returncode, "error")
    return {
        "status": status,
        "returncode": done.returncode,
        "failed": failed_tests(output),
        "seconds": round(time.monotonic() - started, 1),
        "tail": output[-2000:],
    }


def select(only: list[str]) -> list[Mutant]:
    """The mutants named in ``only`` (all when empty), in list order.

    Raises:
        typer.BadParameter: an unknown name.
    """
    names = {m.name for m in MUTANTS}
    unknown = [name for name in only if name not in names]
    if unknown:
        raise typer.BadParameter(f"unknown mutant(s) {unknown}; --list shows the names")
    return [m for m in MUTANTS if not only or m.name in only]


def print_table(records: list[dict]) -> None:
    """One line per mutant: name, file, outcome, the test that caught it, seconds."""
    width = max(len(r["name"]) for r in records)
    print(f"{'mutant':<{width}}  {'file':<20}  {'outcome':<8}  {'seconds':>7}  caught by")
    for r in records:
        print(
            f"{r['name']:<{width}}  {r['path']:<20}  {r['outcome']:<8}  {r['seconds']:>7}  "
            f"{', '.join(r['failed'][:1]) or '-'}"
        )


def write_report(path: str, payload: dict) -> None:
    """Write ``payload`` as JSON atomically (temporary file beside it, then rename)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


def main(
    only: list[str] = typer.Option([], "--only", help="run only this mutant (repeatable)"),
    list_: bool = typer.Option(False, "--list", help="list the mutants and whether each still applies, then exit"),
    baseline: bool = typer.Option(True, help="run the unmutated suite first and stop if it fails"),
    tolerate: bool = typer.Option(
        False,
        "--tolerate-baseline-failures",
        help="when the unmutated suite fails, deselect its failing tests in every mutant run instead of stopping",
    ),
    timeout: float = typer.Option(1800.0, help="seconds per suite run; a run past it counts as caught"),
    tests: list[str] = typer.Option([], "--tests", help="run only these test paths (repeatable; default: all)"),
    keep: bool = typer.Option(False, help="keep the temporary copies (their path is printed)"),
    report: str = typer.Option(REPORT, help="where to write the JSON report (relative to the repository)"),
) -> None:
    """Run the selected mutants (all by default) and report which the unit suite caught."""
    mutants = select(only)
    if list_:
        stale = check_mutants(REPO, mutants)
        for m in mutants:
            print(f"{m.name:<28} {m.path:<20} {'STALE' if m.name in stale else 'ok':<6} {m.what}")
        if stale:
            print("\n".join(stale.values()), file=sys.stderr)
            raise typer.Exit(2)
        return
    python = os.path.join(REPO, ".venv", "bin", "python")
    python = python if os.path.exists(python) else sys.executable
    files = repository_files(REPO)
    root = tempfile.mkdtemp(prefix="mutants-")
    shared = os.path.join(os.path.dirname(REPO), "shared")
    if os.path.isdir(shared):  # tests read ../shared relative to the repository
        os.symlink(shared, os.path.join(root, "shared"))
    pristine = os.path.join(root, "pristine")
    copy_tree(REPO, pristine, files)  # one snapshot: every mutant sees the same tree, however the checkout moves
    try:
        problems = check_mutants(pristine, mutants)
        if problems:
            print("\n".join(problems.values()), file=sys.stderr)
            raise typer.Exit(2)
        base, deselect = None, []
        if baseline:
            print(f"baseline: unit suite on the unmutated copy ({len(files)} files) ...", flush=True)
            base = run_suite(python, pristine, timeout, tests, stop_first=False)
            print(f"baseline: {base['status']} in {base['seconds']} s {' '.join(base['failed'])}", flush=True)
            if base["status"] != "passed":
                if not tolerate or not base["failed"]:
                    print(base["tail"], file=sys.stderr)
                    print(
                        "the unmutated suite does not pass: every mutant would look caught; stopping "
                        "(--tolerate-baseline-failures deselects the failing tests instead)",
                        file=sys.stderr,
                    )
                    raise typer.Exit(1)
                deselect = [f"--deselect={t}" if "::" in t else f"--ignore={t}" for t in base["failed"]]
                print(f"baseline failures deselected in every mutant run: {', '.join(base['failed'])}", flush=True)
        records = []
        for i, mutant in enumerate(mutants, 1):
            copy = os.path.join(root, mutant.name)
            shutil.copytree(pristine, copy)
            target = os.path.join(copy, mutant.path)
            with open(target, encoding="utf-8") as handle:
                text = mutate(handle.read(), mutant)
            with open(target, "w", encoding="utf-8") as handle:
                handle.write(text)
            result = run_suite(python, copy, timeout, [*tests, *deselect])
            outcome = "survived" if result["status"] == "passed" else "caught"
            records.append({**asdict(mutant), "outcome": outcome, **result})
            print(
                f"[{i}/{len(mutants)}] {mutant.name}: {outcome} ({result['status']}, {result['seconds']} s) "
                f"{', '.join(result['failed'][:1])}",
                flush=True,
            )
            if not keep:
                shutil.rmtree(copy, ignore_errors=True)
        killed = sum(r["outcome"] == "caught" for r in records)
        ratio = killed / len(records) if records else float("nan")
        print()
        print_table(records)
        print(f"\nkilled {killed} of {len(records)} mutants: kill ratio {ratio:.2f}")
        survivors = [r["name"] for r in records if r["outcome"] == "survived"]
        if survivors:
            print(f"survived: {', '.join(survivors)}")
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        write_report(
            os.path.join(REPO, report),
            {
                "commit": head,
                "pytest": " ".join([*PYTEST_ARGS[1:], "-x", *tests]),
                "baseline": None if base is None else {k: base[k] for k in ("status", "seconds", "failed")},
                "deselected": base["failed"] if deselect else [],
                "killed": killed,
                "total": len(records),
                "kill_ratio": ratio,
                "survived": survivors,
                "mutants": records,
            },
        )
        print(f"wrote {report}")
    finally:
        if keep:
            print(f"copies kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    typer.run(main)
