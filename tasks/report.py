"""Stage report: one self-contained HTML page of the pipeline run, ``reports/index.html``.

Reads what the stages wrote (:data:`tasks.kit.paths.REPORT_INPUTS`; a missing one makes its part of the page say
so, and the stage fails with one line only when none exists), draws the PPO curves and the over-optimisation
figure (matplotlib, Agg), builds the page (:func:`rlhf.report.render.render_report`) and writes it after everything that
can fail (:class:`tasks.kit.outputs.StagedOutputs`). The page is an MLflow artifact of the stage run and of the parent
pipeline run, which also gets the headline figures (:func:`headline`), so pipeline runs compare side by side
in the MLflow UI.
"""

from __future__ import annotations

import io
import json
import math
import os
from datetime import UTC, datetime
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf.report.inputs import OVEROPTIMISATION, PPO_FIGURES, check_inputs, headline
from rlhf.report.render import render_report
from tasks.kit.common import cli
from tasks.kit.outputs import StagedOutputs
from tasks.kit.params import read_params, stage_params
from tasks.kit.paths import REPORT, REPORT_INPUTS
from tasks.kit.runs import StageRun, git_commit, pipeline_run_id


def load_inputs(root: str = ".") -> dict[str, Any]:
    """Read every input of :data:`tasks.kit.paths.REPORT_INPUTS` under ``root``: JSON files parsed, the PNG as bytes.

    Returns:
        input name -> content, None for a file that does not exist.

    Raises:
        FileNotFoundError: none of the inputs exists (the message names where it looked).
        ValueError: a file that is not valid JSON, or not of the shape it should be (names the file).
    """
    loaded: dict[str, Any] = {}
    for name, path in REPORT_INPUTS.items():
        full = os.path.join(root, path)
        if not os.path.isfile(full):
            loaded[name] = None
        elif path.endswith(".png"):
            with open(full, "rb") as handle:
                loaded[name] = handle.read()
        else:
            try:
                with open(full, encoding="utf-8") as handle:
                    loaded[name] = json.load(handle)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"{path}: not valid JSON ({err})") from None
    if all(value is None for value in loaded.values()):
        raise FileNotFoundError(
            f"none of the report's inputs exists under {os.path.abspath(root)} ({', '.join(REPORT_INPUTS.values())}): "
            "run the pipeline's stages first"
        )
    check_inputs(loaded, REPORT_INPUTS)
    return loaded


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    plt.close(figure)
    return buffer.getvalue()


def _lines(rows: list[dict[str, Any]], x: str, series, title: str, xlabel: str) -> bytes | None:
    """One line per ``(key, label)`` of ``series`` against ``x``; None when no row has a finite value of any."""
    figure, axis = plt.subplots(figsize=(7.5, 3.2))
    drawn = False
    for key, label in series:
        points = sorted((row[x], row[key]) for row in rows if _finite(row.get(x)) and _finite(row.get(key)))
        if points:
            axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
            drawn = True
    if not drawn:
        plt.close(figure)
        return None
    axis.set(xlabel=xlabel, title=title)
    axis.grid(alpha=0.3)
    axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)  # beside the lines
    figure.tight_layout()
    return _png(figure)


def best_of_n_rows(evaluation: dict[str, Any]) -> list[dict[str, float]]:
    """The best-of-N points of evaluate's metrics (``eval/best_of_n/N/...``) as curve rows: ``sqrt_kl``,
    ``best_of_n_proxy``, ``best_of_n_judge``, one per N, in N's order."""
    sizes = sorted({int(k.split("/")[2]) for k in evaluation if k.startswith("eval/best_of_n/") and k.count("/") == 3})
    return [
        {
            "sqrt_kl": evaluation.get(f"eval/best_of_n/{n}/sqrt_kl"),
            "best_of_n_proxy": evaluation.get(f"eval/best_of_n/{n}/proxy"),
            "best_of_n_judge": evaluation.get(f"eval/best_of_n/{n}/judge"),
        }
        for n in sizes
    ]


def draw_figures(loaded: dict[str, Any]) -> dict[str, bytes | None]:
    """The PNG figures of :data:`rlhf.report.inputs.PPO_FIGURES` (from metrics/ppo_curves.json, x = PPO iteration)
    and of
    :data:`rlhf.report.inputs.OVEROPTIMISATION` (proxy and judge mean scores against sqrt(KL), one point per kept
    policy).

    Returns:
        figure name -> PNG bytes; None for a figure with no value to draw; absent when its file is missing.
    """
    figures: dict[str, bytes | None] = {}
    if loaded.get("curves") is not None:
        for name, title, series in PPO_FIGURES:
            figures[name] = _lines(loaded["curves"], "iteration", series, title, "PPO iteration")
    if loaded.get("overoptimisation") is not None:
        series = (
            ("proxy", "PPO policies: proxy (the reward model PPO optimised)"),
            ("judge", "PPO policies: judge (independent)"),
            ("best_of_n_proxy", "best-of-N of SFT: proxy"),
            ("best_of_n_judge", "best-of-N of SFT: judge"),
        )
        rows = loaded["overoptimisation"] + best_of_n_rows(loaded.get("eval") or {})
        title = "mean score against sqrt(KL to SFT)"
        figures[OVEROPTIMISATION] = _lines(rows, "sqrt_kl", series, title, "sqrt(KL), nats^0.5")
    return figures


def build(params: dict[str, Any], loaded: dict[str, Any]) -> str:
    """The report page of ``loaded`` (:func:`load_inputs`) for the pipeline run of the current folder.

    Args:
        params: the params.yaml ``report`` section: ``samples``, how many sample rows to show (an int >= 0).

    Raises:
        ValueError: ``samples`` is not a whole number >= 0.
    """
    samples = params.get("samples", 8)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise ValueError(f"params.yaml: report.samples must be a whole number >= 0, got {samples!r}")
    return render_report(
        loaded,
        draw_figures(loaded),
        REPORT_INPUTS,
        pipeline_run=pipeline_run_id(),
        git_commit=git_commit(),
        profile=str(read_params().get("profile", "demo")),
        created=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        samples=samples,
    )


def main() -> None:
    """DVC stage command."""
    import mlflow  # noqa: PLC0415 (MLflow: seconds to import)

    params = stage_params("report")
    loaded = load_inputs()  # before the run starts: no input at all is one line, and no MLflow run
    with StageRun("report", params) as stage, StagedOutputs() as outputs:
        page = outputs.file(REPORT)
        with open(page, "w", encoding="utf-8") as handle:
            handle.write(build(params, loaded))
        figures = headline(loaded)
        stage.log(figures, 0)
        mlflow.log_artifact(page)
        client = mlflow.MlflowClient()
        client.log_artifact(stage.parent_id, page)
        for key, value in figures.items():
            client.log_metric(stage.parent_id, key, value, step=0)
    missing = [path for name, path in REPORT_INPUTS.items() if loaded[name] is None]
    print(f"[report] wrote {REPORT}" + (f"; not produced by this run: {', '.join(missing)}" if missing else ""))
    print("[report] " + ", ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    cli(main)
