"""The pipeline run's report: one self-contained HTML page (tasks/report.py, rlhf/report/render.py)."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import shutil

import matplotlib
import pytest
import yaml
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from rlhf.report.render import render_report
from rlhf.report.sections import JUDGE_AT_CHANCE, JUDGE_MEANINGLESS
from tasks import report
from tasks.kit.common import cli
from tasks.kit.paths import REPORT_INPUTS

SECTIONS = ("data", "reward-model", "judge", "ppo", "evaluation", "samples")
XSS = "<script>alert(1)</script>"
IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')


def _eval(meaningful: float) -> dict:
    """metrics/eval.json as the spec of issue 11 has it (the proxy's upper bound undefined: null)."""
    values = {"eval/prompts": 24.0, "eval/samples_per_prompt": 2.0, "eval/reward_model_version": 1.0,
              "eval/judge/accuracy": 0.81 if meaningful else 0.53,
              "eval/judge/accuracy_low": 0.74 if meaningful else 0.46,
              "eval/judge/accuracy_high": 0.86 if meaningful else 0.60, "eval/judge/meaningful": meaningful,
              "eval/policy/kl": 1.7}  # fmt: skip
    for scorer, (rate, low, high) in {"proxy": (0.71, 0.58, None), "judge": (0.58, 0.44, 0.70)}.items():
        values.update({f"eval/{scorer}/win_rate": rate, f"eval/{scorer}/win_rate_low": low,
                       f"eval/{scorer}/win_rate_high": high, f"eval/{scorer}/decisive": 44.0,
                       f"eval/{scorer}/ties": 4.0, f"eval/{scorer}/sft_score": -0.21,
                       f"eval/{scorer}/policy_score": 0.35, f"eval/{scorer}/score_diff": 0.56,
                       f"eval/{scorer}/score_diff_low": 0.31, f"eval/{scorer}/score_diff_high": 0.8,
                       f"eval/{scorer}/lc_win_rate": 0.52, f"eval/{scorer}/lc_win_rate_low": 0.4,
                       f"eval/{scorer}/lc_win_rate_high": 0.63, f"eval/{scorer}/lc_length_coef": 1.25})  # fmt: skip
    for model, length in (("sft", 44.1), ("policy", 31.8)):
        values.update({f"eval/{model}/length": length, f"eval/{model}/eos_rate": 0.75, f"eval/{model}/distinct_1": 0.41,
                       f"eval/{model}/distinct_2": 0.77, f"eval/{model}/refusal_rate": 0.04,
                       f"eval/{model}/ptx_perplexity": 12.5})  # fmt: skip
    return values


def _eval_kinds() -> dict:
    """metrics/eval_kinds.json: harmless and helpful prompts, the proxy's helpful win rate undefined (all ties)."""
    values = {}
    for kind, (rate, low, high), refusals in (("harmless", (0.61, 0.45, 0.77), (0.0, 0.0625, 0.125)),
                                              ("helpful", (None, None, None), (0.0, 0.0, 0.0625))):  # fmt: skip
        p = f"eval/kind/{kind}/"
        values |= {p + "prompts": 16.0, p + "refusal_increase": refusals[2] - refusals[1],
                   p + "refusal_increase_low": -0.14, p + "refusal_increase_high": 0.283,
                   p + "judge_balanced_accuracy": 0.6, p + "judge_balanced_accuracy_low": 0.52,
                   p + "judge_balanced_accuracy_high": 0.68,
                   p + "complied_where_declined": refusals[1] / 2}  # fmt: skip
        for model, share in zip(("base", "sft", "policy"), refusals, strict=True):
            values |= {f"{p}{model}_refusal_rate": share, f"{p}{model}_length": 30.0}
        for head in ("", "sft_vs_base/"):
            for scorer in ("proxy", "judge"):
                q = f"{p}{head}{scorer}_"
                found = (rate, low, high) if scorer == "proxy" and head == "" else (0.66, 0.51, 0.8)
                values |= {q + "win_rate": found[0], q + "win_rate_low": found[1], q + "win_rate_high": found[2],
                           q + "decisive": 12.0, q + "ties": 4.0, q + "lc_win_rate": 0.57, q + "lc_win_rate_low": 0.42,
                           q + "lc_win_rate_high": 0.71, q + "score_diff": 0.08, q + "score_diff_low": -0.02,
                           q + "score_diff_high": 0.19}  # fmt: skip
    return values


def _judge(low: float, high: float) -> dict:
    return {"judge/accuracy": (low + high) / 2 + 0.02, "judge/accuracy_low": low + 0.02,
            "judge/accuracy_high": high + 0.02, "judge/balanced_accuracy": (low + high) / 2,
            "judge/balanced_accuracy_low": low, "judge/balanced_accuracy_high": high,
            "judge/pairs": 180.0, "judge/ties": 2.0, "judge/ece": 0.07}  # fmt: skip


def _margins_png() -> bytes:
    figure, axis = plt.subplots(figsize=(4, 3))
    axis.hist([0.1, -0.2, 0.3, 0.05, 0.4], bins=5)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=50)
    plt.close(figure)
    return buffer.getvalue()


def _curve_row(i: int) -> dict:
    return {"iteration": i, "ppo/reward/mean": 0.1 * i, "ppo/validation/reward": None if i % 2 else 0.05 * i,
            "ppo/kl": 0.2 * i, "ppo/perplexity": 3.5 - 0.1 * i, "ppo/response_length": 43.0 - i,
            "ppo/policy/clipfrac": None if i == 1 else 0.01, "ppo/value/clipfrac": 0.19 / i,
            "ppo/entropy": 1.2}  # fmt: skip


GATE_CHECK = {"bound": 0.5, "criterion": "rm_eval accuracy lower 95% bound (Wilson)",
              "detail": "accuracy 0.589 over 209 pairs", "passed": True, "value": 0.5208}  # fmt: skip
INPUTS = {
    "metrics/prepare.json": {"quarantined": 3, "rows_in": 2000, "split/rm_eval": 214, "split/sft": 398},
    "metrics/validate.json": {"validate/quarantined": 5, "validate/rows_in": 612, "validate/valid": 607},
    "reports/validation.json": {
        "control_tokens": "quarantine", "max_quarantine_fraction": 0.05, "role_markers": "quarantine", "success": True,
        "splits": {"rm_eval": {"quarantined": 2, "rows_in": 214, "valid": 212,
                               "rules": {"duplicate": 0, "role_marker_in_response": 2}},
                   "sft": {"quarantined": 3, "rows_in": 398, "valid": 395, "rules": {"duplicate": 3, "utf8": 0}}},
    },
    "metrics/sft.json": {"sft/examples": 395.0, "sft/loss_first": 2.67, "sft/loss_last": 2.51, "sft/steps": 32.0},
    "metrics/reward.json": {"rm/accuracy": 0.5885, "rm/accuracy_low": 0.5208, "rm/accuracy_high": 0.6530,
                            "rm/pairs": 209.0, "rm/ties": 3.0, "rm/ece": 0.092, "rm/accuracy_chosen_longer": 0.388,
                            "rm/accuracy_chosen_shorter": 0.766, "rm/pairs_chosen_longer": 98.0,
                            "rm/pairs_chosen_shorter": 107.0, "rm/margin": 0.0796, "rm/balanced_accuracy": 0.577,
                            "rm/balanced_accuracy_low": 0.511, "rm/balanced_accuracy_high": 0.64},
    "reports/reward_gate.json": {"candidate": {"name": "rlhf-reward-model", "version": "1"}, "checks": [GATE_CHECK],
                                 "decided": "now", "decided_at": "2026-11-30T15:17:41+00:00", "decision": "pass"},
    "metrics/reward_kinds.json": {  # helpful below chance: its row, and a warning of its own
        "rm/kind/harmless/balanced_accuracy": 0.612, "rm/kind/harmless/balanced_accuracy_low": 0.55,
        "rm/kind/harmless/balanced_accuracy_high": 0.67, "rm/kind/harmless/pairs": 230.0,
        "rm/kind/harmless/empty_beats_chosen": 0.25, "rm/kind/helpful/balanced_accuracy": 0.44,
        "rm/kind/helpful/balanced_accuracy_low": 0.38, "rm/kind/helpful/balanced_accuracy_high": 0.49,
        "rm/kind/helpful/pairs": 250.0, "rm/kind/helpful/empty_beats_chosen": 0.03},
    "metrics/judge.json": _judge(0.74, 0.86),
    "metrics/judge_kinds.json": {"judge/kind/helpful/balanced_accuracy": 0.57,
                                 "judge/kind/helpful/balanced_accuracy_low": 0.51,
                                 "judge/kind/helpful/balanced_accuracy_high": 0.63},
    "metrics/ppo.json": {"ppo/iterations": 4.0, "ppo/shipped_iteration": 4.0, "ppo/validation/reward": 0.2,
                         "ppo/validation/kl": 0.7, "stopped_by": None},
    "metrics/ppo_curves.json": [_curve_row(i) for i in range(1, 5)],
    "metrics/overoptimisation.json": [{"iteration": i, "kl": i * 0.5, "sqrt_kl": math.sqrt(i * 0.5),
                                       "proxy": 0.1 * i, "judge": 0.05 * i - 0.02 * i * i} for i in range(4)],
    "metrics/eval.json": _eval(1.0),
    "metrics/eval_kinds.json": _eval_kinds(),
    "reports/eval/samples.json": {"run_id": "abc123", "samples": [
        {"id": f"p{i}", "sample": 0, "messages": [{"role": "user", "content": f"question {i}"}],
         "prompt": f"question {i}", "sft_response": f"plain answer {i}",
         "policy_response": XSS if i == 0 else f"better answer {i}",
         "sft_proxy": 0.1, "policy_proxy": 0.2, "sft_judge": None, "policy_judge": 0.4} for i in range(3)]},
    "reports/policy_gate.json": {"candidate": {"name": "rlhf-policy", "version": "2"}, "decision": "fail",
                                 "checks": [{**GATE_CHECK, "passed": False, "value": float("nan")}]},
}  # fmt: skip


@pytest.fixture
def project(tmp_path, empty_db, monkeypatch):
    """A project folder (the current folder) holding every input of the report and an empty MLflow store."""
    for path, content in INPUTS.items():
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        (tmp_path / path).write_text(json.dumps(content))  # NaN stays NaN, as a gate report of old wrote it
    (tmp_path / "reports" / "reward_margins.png").write_bytes(_margins_png())
    (tmp_path / "reports" / "judge_margins.png").write_bytes(_margins_png())
    params = {"profile": "demo", "mlflow": {"tracking_uri": "sqlite:///mlflow.db", "experiment": "rlhf"},
              "report": {"samples": 2}}  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    shutil.copy(empty_db, tmp_path / "mlflow.db")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("RLHF_PIPELINE_RUN_ID", "report-test")
    return tmp_path


def _images(html: str) -> list[Image.Image]:
    images = []
    for encoded in IMG.findall(html):
        image = Image.open(io.BytesIO(base64.b64decode(encoded, validate=True)))
        image.load()  # decodes every pixel: a truncated PNG fails here
        images.append(image)
    return images


def test_the_page_holds_every_section_its_figures_as_pngs_and_no_external_address(project):
    html = report.build({"samples": 2}, report.load_inputs())
    for section in (*SECTIONS, "sft"):
        assert f'<h2 id="{section}">' in html
    images = _images(html)
    assert html.count("<img ") == len(images) == 2 + 5 + 1  # 2 margins, the five PPO figures, over-optimisation
    assert all(image.format == "PNG" and image.width > 100 for image in images)
    assert not re.search(r"https?://", html) and not re.search(r"<script", html, re.IGNORECASE)
    assert not re.search(r"""(src|href)\s*=\s*(?!"(data:image/png;base64,|#))""", html)  # data: images, anchors
    assert "0.589 [0.521, 0.653]" in html  # the reward model's Wilson interval
    assert "0.710 [0.580, n/a]" in html  # a null bound shows as n/a
    assert "the first 2 of 3 samples" in html and "plain answer 1" in html and "plain answer 2" not in html
    assert "proxy 0.100, judge n/a" in html  # a sample's missing judge score
    assert "policy gate: fail" in html and "not produced by this run" not in html  # its section
    assert JUDGE_AT_CHANCE not in html  # the judge's interval lies above 0.5
    verdict = "policy gate failed 1 of 1 checks: rm_eval accuracy lower 95% bound (Wilson)"  # first, and why
    assert html.index(f"<th>verdict</th><td>{verdict}</td>") < html.index("reward-model accuracy [95%]")
    # each gate's row: its failed checks' figures, not the verdict's sentence again
    assert "<th>reward gate</th><td>passed all 1 checks</td>" in html
    policy_row = "<th>policy gate</th><td>failed 1 of 1: rm_eval accuracy lower 95% bound (Wilson) n/a (bound 0.500)"
    assert policy_row in html and html.count(verdict) == 1
    evaluation = html[html.index('<h2 id="evaluation">') : html.index('<h2 id="samples">')]
    assert "length-controlled win rate [95%]" in evaluation and "score difference, policy - SFT [95%]" in evaluation
    assert "0.560 [0.310, 0.800]" in evaluation and "0.520 [0.400, 0.630]" in evaluation and "1.250" in evaluation


def test_model_output_is_escaped_never_markup(project):
    html = report.build({"samples": 8}, report.load_inputs())
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and XSS not in html


def test_a_run_without_sft_says_so_where_sft_is_reported(project):
    loaded = report.load_inputs()
    note = "no fine-tuning (sft.steps 0): SFT is the base model"
    assert note not in page(loaded)
    loaded["sft"] = {"sft/examples": 395.0, "sft/steps": 0.0, "sft/epochs": 0.0}
    sft = page(loaded).split('<h2 id="sft">')[1].split("<h2 ")[0]
    assert note in sft


def test_a_sample_shows_its_whole_conversation_and_a_response_that_is_sfts_is_marked(project):
    loaded = report.load_inputs()
    turns = [{"role": "user", "content": "my bike has a flat"}, {"role": "assistant", "content": "Front or back?"},
             {"role": "user", "content": "the back one"}]  # fmt: skip
    row = {**loaded["samples"]["samples"][1], "messages": turns, "policy_response": "plain answer 1"}
    loaded["samples"] = {"run_id": "abc123", "samples": [row]}
    samples = page(loaded).split('<h2 id="samples">')[1]
    assert "user: my bike has a flat\n\nassistant: Front or back?\n\nuser: the back one" in samples
    assert samples.count("the same text as SFT&#39;s (a tie)") == 1  # the policy's side only
    assert "declined" not in samples
    loaded["samples"]["samples"] = [{**row, "complied_where_declined": True}]
    assert "the policy answered what SFT or the base model declined" in page(loaded).split('<h2 id="samples">')[1]
    loaded["samples"]["samples"] = [{**row, "sft_ended": False, "policy_ended": True}]  # SFT's cut at the limit
    samples = page(loaded).split('<h2 id="samples">')[1]
    assert samples.count("cut off at max_new_tokens before it ended (no EOS)") == 1


def page(loaded: dict) -> str:
    """The report page of ``loaded``, its figures drawn, with one sample row."""
    figures = report.draw_figures(loaded)
    return render_report(loaded, figures, REPORT_INPUTS, pipeline_run="r", git_commit="c", profile="p", created="now")


def test_a_judge_at_chance_is_flagged_and_its_win_rates_marked(project):
    loaded = report.load_inputs()
    loaded["judge"], loaded["eval"] = _judge(0.46, 0.60), _eval(0.0)
    html = page(loaded)
    judge = html[html.index('<h2 id="judge">') : html.index('<h2 id="ppo">')]
    assert f"{JUDGE_AT_CHANCE} (judge balanced accuracy 0.53 [0.46, 0.60] includes chance (0.5))" in judge
    evaluation = html[html.index('<h2 id="evaluation">') : html.index('<h2 id="samples">')]
    assert JUDGE_MEANINGLESS in evaluation and re.search(
        r'<tr class="muted">\s*<td>judge</td>.*not meaningful', evaluation
    )
    assert "(not meaningful: see the evaluation)" in html  # beside the judge win rate in the headline
    assert report.headline(loaded)["eval/judge/meaningful"] == 0.0


def test_a_missing_input_says_so_and_no_input_at_all_is_one_line(project, tmp_path_factory, monkeypatch, capsys):
    os.remove("metrics/judge.json")
    os.remove("metrics/overoptimisation.json")
    with open("reports/judge_margins.png", "wb") as handle:  # not a PNG: one line naming the file
        handle.write(b"GIF89a")
    with pytest.raises(ValueError, match=r"^reports/judge_margins.png: expected a PNG image, found other bytes$"):
        report.load_inputs()
    os.remove("reports/judge_margins.png")
    html = report.build({"samples": 2}, report.load_inputs())
    assert "not produced by this run (metrics/judge.json missing)" in html
    assert "not produced by this run (metrics/overoptimisation.json missing)" in html
    assert "not produced by this run (reports/judge_margins.png missing)" in html
    assert len(_images(html)) == 6 and '<h2 id="judge">' in html  # the reward margins and the five PPO figures
    with open("metrics/ppo_curves.json", "w") as handle:  # a curve file of the wrong shape: one line naming it
        json.dump({"iteration": 1}, handle)
    with pytest.raises(ValueError, match=r"^metrics/ppo_curves.json: expected a list of objects, found dict$"):
        report.load_inputs()
    empty = tmp_path_factory.mktemp("empty")
    (empty / "params.yaml").write_text(yaml.safe_dump({"report": {"samples": 8}}))
    monkeypatch.chdir(empty)
    with pytest.raises(SystemExit) as stop:
        cli(report.main)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1
    assert err.startswith("[report] error: FileNotFoundError: none of the report's inputs exists under ")
    assert not (empty / "mlflow.db").exists()  # failed before any MLflow run


def test_the_stage_writes_the_page_and_gives_the_parent_run_the_headline_and_the_page(project):
    import mlflow

    from tasks.kit.runs import tracking_client

    report.main()
    with open("reports/index.html", encoding="utf-8") as handle:
        page = handle.read()
    assert '<h2 id="samples">' in page and len(_images(page)) == 8
    client, experiment = tracking_client()
    (parent,) = client.search_runs([experiment], "tags.`rlhf.kind` = 'pipeline'")
    (stage,) = client.search_runs([experiment], "tags.`rlhf.stage` = 'report'")
    expected = {
        "rm/accuracy": 0.5885,
        "rm/accuracy_low": 0.5208,
        "rm/balanced_accuracy": 0.577,
        "judge/accuracy": 0.82,
        "judge/balanced_accuracy": 0.8,
        "eval/judge/win_rate": 0.58,
        "eval/judge/win_rate_low": 0.44,
        "eval/judge/win_rate_high": 0.70,
        "eval/proxy/win_rate": 0.71,
        "eval/proxy/win_rate_low": 0.58,
        "eval/policy/kl": 1.7,
        "eval/judge/meaningful": 1.0,
        "eval/proxy/win_rate_high": math.nan,  # null in the file: undefined, shown as NaN, not left out
    }  # fmt: skip
    assert parent.data.metrics == pytest.approx(expected, nan_ok=True)
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id and stage.info.status == "FINISHED"
    for run in (parent, stage):
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["index.html"]
        with open(mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="index.html")) as handle:
            assert handle.read() == page


def test_best_of_n_is_a_table_a_verdict_and_points_on_the_over_optimisation_figure(project):
    from tasks.report import best_of_n_rows

    loaded = report.load_inputs()
    best = {"eval/best_of_n/1/kl": 0.0, "eval/best_of_n/1/sqrt_kl": 0.0, "eval/best_of_n/1/proxy": -0.2,
            "eval/best_of_n/1/judge": -0.3, "eval/best_of_n/4/kl": 0.636294, "eval/best_of_n/4/sqrt_kl": 0.797680,
            "eval/best_of_n/4/proxy": 0.4, "eval/best_of_n/4/judge": -0.25, "eval/best_of_n/largest": 4.0,
            "eval/best_of_n/judge_gain": 0.05, "eval/best_of_n/judge_gain_low": -0.1,
            "eval/best_of_n/judge_gain_high": 0.2}  # fmt: skip
    loaded["eval"] = {**_eval(1.0), **best}
    assert best_of_n_rows(loaded["eval"]) == [
        {"sqrt_kl": 0.0, "best_of_n_proxy": -0.2, "best_of_n_judge": -0.3},
        {"sqrt_kl": 0.797680, "best_of_n_proxy": 0.4, "best_of_n_judge": -0.25},
    ]
    html = page(loaded)
    evaluation = html[html.index('<h2 id="evaluation">') : html.index('<h2 id="samples">')]
    assert "Best-of-N of the SFT model on the curve prompts" in evaluation and "0.636" in evaluation
    # the gain's interval includes 0: the report says best-of-4 does not beat SFT
    assert "best-of-4 does NOT beat SFT by the judge: judge score gain over one SFT sample 0.050 [-0.100, 0.200]" in (
        evaluation
    )
    loaded["eval"]["eval/best_of_n/judge_gain_low"] = 0.01
    html = page(loaded)
    assert "best-of-4 beats SFT by the judge" in html


def test_the_evaluation_has_rows_per_kind_sft_against_the_base_model_and_refusals(project):
    html = report.build({"samples": 2}, report.load_inputs())
    evaluation = html[html.index('<h2 id="evaluation">') : html.index('<h2 id="samples">')]
    assert "Per kind of prompt: the policy against SFT" in evaluation
    assert "Per kind of prompt: SFT against the base model" in evaluation
    assert re.search(
        r"<td>harmless</td>\s*<td>proxy</td>\s*<td>0.610 \[0.450, 0.770\]</td>\s*<td>12 / 4</td>", evaluation
    )
    assert re.search(r"<td>helpful</td>\s*<td>proxy</td>\s*<td>n/a</td>", evaluation)  # all ties: undefined
    assert "judge balanced accuracy here 0.600 [0.520, 0.680]" in evaluation
    # refusals of the three models and the policy's increase over SFT with its interval
    assert re.search(
        r"<td>harmless</td>\s*<td>16</td>\s*<td>0.000</td>\s*<td>0.062</td>\s*<td>0.125</td>\s*"
        r"<td>0.062 \[-0.140, 0.283\]</td>\s*<td>0.031</td>\s*<td>30.0 / 30.0 / 30.0</td>",
        evaluation,
    )
    assert "<th>base model</th>" in evaluation  # the responses table has the base model's column
    # the judge's verdicts meaningless: its per-kind rows are struck through too
    loaded = report.load_inputs()
    loaded["eval"] = _eval(0.0)
    evaluation = page(loaded)
    assert len(re.findall(r'<tr class="muted">\s*<td>(?:harmless|helpful)</td>\s*<td>judge</td>', evaluation)) == 4
    # no per-kind file: the section says so
    os.remove("metrics/eval_kinds.json")
    html = report.build({"samples": 2}, report.load_inputs())
    assert "not produced by this run (metrics/eval_kinds.json missing)" in html and "Per kind of prompt" not in html


def test_the_reward_model_and_the_judge_have_a_row_per_kind_and_a_warning_for_a_kind_at_chance(project):
    html = report.build({"samples": 2}, report.load_inputs())
    reward = html[html.index('<h2 id="reward-model">') : html.index('<h2 id="judge">')]
    assert "Reward model on rm_eval, per kind" in reward
    assert re.search(r"<td>harmless</td>\s*<td>0.612 \[0.550, 0.670\]</td>", reward)
    assert re.search(r"<td>helpful</td>\s*<td>0.440 \[0.380, 0.490\]</td>\s*<td>n/a</td>\s*<td>250</td>", reward)
    assert "helpful balanced accuracy" in reward and "harmless balanced accuracy" not in reward  # the warning
    judge = html[html.index('<h2 id="judge">') : html.index('<h2 id="ppo">')]
    assert re.search(r"<td>helpful</td>\s*<td>0.570 \[0.510, 0.630\]</td>", judge)
