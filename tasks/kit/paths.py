"""Every artefact of the pipeline, relative to the project root: the one table the stages, the commands and the
report read their paths from, and that ``dvc.yaml``'s deps and outs agree with (``tests/test_paths.py``)."""

from __future__ import annotations

import os

SOURCES = "data/sources.json"  # source: what each input was when read (its size, time, hash)
PROCESSED = "data/processed"  # prepare: every split, parsed and assigned
VALIDATED = "data/validated"  # validate: the splits that passed the rules; quarantine.jsonl holds the others


def project_root() -> str:
    """The project's root: ``DVC_ROOT`` (DVC sets it for every stage; inside an experiment's temporary copy,
    ``<project>/.dvc/tmp/exps/<tmp>/`` for ``dvc exp run --queue`` or ``--temp``, it names the project) or the
    current folder."""
    return os.path.abspath(os.environ.get("DVC_ROOT") or os.getcwd())


def data_url(url: str) -> tuple[str, list[str]]:
    """Where a data source is read from, and every place looked: a relative local path from the current folder,
    then, where that holds no file, from :func:`project_root` (a DVC experiment's copy of the project does not
    hold a path outside it, such as the shared data beside the project). A URL with a protocol and an absolute
    path are read as written.

    Returns:
        ``(path to read, [absolute paths looked at, in order])``: the path as written when the current folder
        holds it or no place does.
    """
    if "://" in url or os.path.isabs(url):
        return url, [url]
    folders = dict.fromkeys([os.getcwd(), project_root()])
    looked = [os.path.normpath(os.path.join(folder, url)) for folder in folders]
    found = next((path for path in looked if os.path.exists(path)), looked[0])
    return (url if found == looked[0] else found), looked


def split(name: str) -> str:
    """The validated file of split ``name`` (``rlhf.data.splitting.SPLITS``): ``data/validated/<name>.jsonl``."""
    return f"{VALIDATED}/{name}.jsonl"


def metrics(stage: str) -> str:
    """The metrics file a stage writes: ``metrics/<stage>.json``."""
    return f"metrics/{stage}.json"


def kind_metrics(stage: str) -> str:
    """The file of a stage's figures per kind of data and per source (``.../kind/<kind>/...``,
    ``.../source/<name>/...``, :mod:`rlhf.data.kinds`): ``metrics/<stage>_kinds.json``, apart from the headline file
    so that ``dvc metrics show`` stays readable."""
    return f"metrics/{stage}_kinds.json"


def headline(stage: str) -> str:
    """A stage's row of the table ``dvc metrics show`` prints (:data:`tasks.kit.outputs.HEADLINE`):
    ``metrics/headline/<stage>.json``."""
    return f"metrics/headline/{stage}.json"


def is_headline(path: str) -> bool:
    """Whether ``path`` is a stage's headline row (:func:`headline`)."""
    return path.startswith(headline("*").rsplit("/", 1)[0] + "/")


BASE = "models/base"  # base_model: model.source as safetensors
SFT = "models/sft"
REWARD = "models/reward"  # the reward stage's candidate
CHAMPION = "models/reward_champion"  # the gate: the registry's champion, what ppo trains against
JUDGE = "models/judge"
POLICY = "models/policy"
POLICY_KEPT = "models/policy_kept"  # every ppo.keep_every-th policy (the over-optimisation curve)

VALIDATION_REPORT, GX_REPORT = "reports/validation.json", "reports/validation_gx.json"
REWARD_MARGINS, JUDGE_MARGINS = "reports/reward_margins.png", "reports/judge_margins.png"
REWARD_GATE, POLICY_GATE = "reports/reward_gate.json", "reports/policy_gate.json"
PPO_REPORTS, PPO_CURVES = "reports/ppo", "metrics/ppo_curves.json"
EVAL_REPORTS, OVEROPTIMISATION = "reports/eval", "metrics/overoptimisation.json"
EVAL_KINDS = kind_metrics("eval")  # evaluate's figures per kind of prompt (eval/kind/<kind>/...)
SAMPLES = f"{EVAL_REPORTS}/samples.json"
REPORT = "reports/index.html"

REPORT_INPUTS = {  # the report's input names (rlhf.report.render.render_report) -> their files
    "prepare": metrics("prepare"),
    "validate": metrics("validate"),
    "validation": VALIDATION_REPORT,
    "sft": metrics("sft"),
    "reward": metrics("reward"),
    "reward_kinds": kind_metrics("reward"),
    "margins": REWARD_MARGINS,
    "reward_gate": REWARD_GATE,
    "judge": metrics("judge"),
    "judge_kinds": kind_metrics("judge"),
    "judge_margins": JUDGE_MARGINS,
    "ppo": metrics("ppo"),
    "curves": PPO_CURVES,
    "overoptimisation": OVEROPTIMISATION,
    "eval": metrics("eval"),
    "eval_kinds": EVAL_KINDS,
    "samples": SAMPLES,
    "policy_gate": POLICY_GATE,
}
