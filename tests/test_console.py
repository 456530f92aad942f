"""What a person sees of a pipeline run: a stage's output relayed to its log, its loud lines and bar; the end line's
figures; the verdict; and a stage's warnings on one line."""

from __future__ import annotations

import io
import logging
import warnings

from flows.console import CLEAR, FitToConsoleWidth, relay
from flows.summary import figure, headline, verdict, verdict_lines
from tasks.kit.console import QUIET_ENV, fit, quiet_libraries


class Chunks:
    """A process's output read in the given pieces (``read1``), as a pipe hands it over."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    def read1(self, size: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


OUTPUT = (
    "Running stage 'reward':\n",
    "[reward] started (MLflow run 1)\n",
    "\rrm:  50%| 1/2\rrm: 100%| 2/2\n",  # a tqdm bar: each state after a carriage return, a newline at its close
    "[reward] WARNING: rm_eval balanced accuracy 0.49 [0.40, 0.58] includes chance\n",
    "[reward] caf\u00e9 done",  # no final newline
)


def stream() -> Chunks:
    data = "".join(OUTPUT).encode()
    split = data.index("\u00e9".encode()) + 1  # a read that ends inside a two-byte character
    return Chunks(data[:20], data[20:split], data[split:])


def test_relay_logs_every_line_shows_the_loud_ones_and_keeps_a_bar_off_the_log_but_its_last_state():
    log, shown = io.StringIO(), []
    lines = relay(stream(), log, shown.append)
    assert lines == [
        "Running stage 'reward':",
        "[reward] started (MLflow run 1)",
        "rm: 100%| 2/2",
        "[reward] WARNING: rm_eval balanced accuracy 0.49 [0.40, 0.58] includes chance",
        "[reward] caf\u00e9 done",
    ]
    assert log.getvalue() == "\n".join(lines) + "\n"
    assert shown == ["[reward] WARNING: rm_eval balanced accuracy 0.49 [0.40, 0.58] includes chance"]


def test_relay_draws_the_bar_on_a_terminal_only():
    terminal = io.StringIO()
    relay(stream(), io.StringIO(), lambda line: None, terminal)
    assert terminal.getvalue() == f"{CLEAR}rm: 100%| 2/2\n"  # the whole output came in three reads
    terminal = io.StringIO()
    relay(Chunks(b"\rrm:  50%| 1/2", b"\rrm: 100%| 2/2", b"\n"), io.StringIO(), lambda line: None, terminal)
    assert terminal.getvalue() == f"{CLEAR}rm:  50%| 1/2{CLEAR}rm: 100%| 2/2{CLEAR}rm: 100%| 2/2\n"


def test_figures_print_whole_numbers_as_integers_and_rates_with_their_interval():
    values = {"validate/valid": 2339.0, "rm/margin": 0.02, "rm/pairs": 281.0, "rm/ba": 0.5534, "rm/ba_low": 0.5}
    values["rm/ba_high"] = 0.61
    assert figure(values, "validate/valid") == "validate/valid=2339"
    assert figure(values, "rm/margin") == "rm/margin=0.020"
    assert figure(values, "rm/ba") == "rm/ba=0.553 [0.500, 0.610]"
    assert figure({"eval/judge/win_rate": None}, "eval/judge/win_rate") == "eval/judge/win_rate=n/a"
    assert figure(values, "absent") is None


def test_the_end_line_names_each_kinds_figure():
    values = {
        "rm/balanced_accuracy": 0.6,
        "rm/kind/helpful/balanced_accuracy": 0.7,
        "rm/kind/harmless/balanced_accuracy": 0.5,
        "rm/kind/harmless/balanced_accuracy_low": 0.4,
        "rm/kind/harmless/balanced_accuracy_high": 0.6,
        "rm/margin": 0.1,  # not a headline figure
    }
    assert headline("reward", values) == (
        "rm/balanced_accuracy=0.600, rm/kind/harmless/balanced_accuracy=0.500 [0.400, 0.600], "
        "rm/kind/helpful/balanced_accuracy=0.700"
    )
    assert headline("prepare", values) == "" and headline("ppo", {}) == ""


def check(criterion: str, passed: bool) -> dict:
    return {"criterion": criterion, "passed": passed, "value": 0.0, "bound": 0.5, "detail": ""}


def test_the_verdict_is_the_policy_gates_when_evaluate_ran_else_the_reward_gates():
    failed = {"decision": "fail", "checks": [check("EOS rate", False), check("KL", True), check("win rate", False)]}
    passed = {"decision": "pass", "checks": [check("EOS rate", True)]}
    assert verdict({"gate": passed, "evaluate": failed}) == (
        "Gate failed",
        "policy gate failed 2 of 3 checks: EOS rate; win rate (reports/policy_gate.json)",
    )
    assert verdict({"gate": passed, "evaluate": passed}) == ("Completed", "policy gate passed all 1 checks")
    assert verdict({"gate": failed, "ppo": {}}) == (
        "Gate failed",
        "reward gate failed 2 of 3 checks: EOS rate; win rate (reports/reward_gate.json)",
    )
    assert verdict({"sft": {}}) == ("Completed", "no gate ran")


def test_the_verdicts_lines_are_its_head_then_one_item_per_failed_check():
    failed = {"decision": "fail", "checks": [check("EOS rate", False), check("KL", True), check("win rate", False)]}
    passed = {"decision": "pass", "checks": [check("EOS rate", True)]}
    assert verdict_lines({"gate": passed, "evaluate": failed}) == [
        "[flow] policy gate failed 2 of 3 checks (reports/policy_gate.json):",
        "  - EOS rate",
        "  - win rate",
    ]
    assert verdict_lines({"gate": passed}) == ["[flow] reward gate passed all 1 checks"]
    assert verdict_lines({"sft": {}}) == ["[flow] no gate ran"]


def test_a_long_console_line_wraps_at_120_columns_under_its_text_and_keeps_its_words_whole():
    assert fit("[ppo] done in 3 s") == "[ppo] done in 3 s"  # fits: as it is
    figures = ", ".join(f"rm/kind/harmless/figure_{i}=0.{i:03d}" for i in range(12))
    wrapped = fit(f"[reward] done in 235 s: {figures}").splitlines()
    assert len(wrapped) == 5 and all(len(line) <= 120 for line in wrapped)
    assert all(line.startswith(" " * 9) and line[9] != " " for line in wrapped[1:])  # under the text after [reward]
    assert " ".join(line.strip() for line in wrapped) == f"[reward] done in 235 s: {figures}"  # nothing lost
    item = fit("  - " + "the judge cannot tell " * 8).splitlines()
    assert item[0].startswith("  - the judge") and all(line[:4] == "    " != line[:5] for line in item[1:])
    path = "reports/" + "x" * 130 + ".json"
    assert fit(f"[gate] see {path}").splitlines() == ["[gate] see", f"       {path}"]  # a path stays whole


def test_prefects_own_long_console_line_is_cut_to_one_line_of_120_columns():
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)-7s | Flow run %(flow_run_name)r - %(message)s"))
    message = "Finished in state Gate failed('policy gate failed 6 of 8 checks: " + "the judge cannot tell; " * 30
    record = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "%s", (message,), None)
    record.flow_run_name = "cocky-puffin"
    assert FitToConsoleWidth(handler).filter(record) is True  # kept, cut
    line = handler.format(record)
    assert len(line) <= 120 and line.endswith(" [...]"), line
    assert record.getMessage().startswith("Finished in state Gate failed('policy gate failed 6 ")
    short = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "Beginning flow run %s", ("x",), None)
    short.flow_run_name = "cocky-puffin"
    assert FitToConsoleWidth(handler).filter(short) and short.getMessage() == "Beginning flow run x"


def test_a_stages_warnings_print_once_on_one_line(capsys, monkeypatch):
    for name, value in QUIET_ENV.items():  # as the stage sets them; undone after the test
        monkeypatch.setenv(name, value)
    before = warnings.showwarning
    try:
        quiet_libraries("evaluate")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(2):
                warnings.warn("12 of 32 comparisons\n  tied", UserWarning, stacklevel=1)
    finally:
        warnings.showwarning = before
    assert capsys.readouterr().err == "[evaluate] warning: UserWarning: 12 of 32 comparisons tied\n"


def test_a_failed_stage_reaches_the_console_as_prefect_s_line_without_the_engine_s_traceback():
    import io
    import logging

    from flows.pipeline import without_traceback

    logger, out = logging.getLogger("test.flow_runs"), io.StringIO()  # not under "prefect": no API handler
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.addFilter(without_traceback)
    logger.propagate = False
    try:
        raise RuntimeError("[ppo] error: ValueError: models/reward_champion: no reward model holds the champion")
    except RuntimeError:
        logger.error("Encountered exception during execution: %s", "StageRefused(...)", exc_info=True)
    finally:
        logger.removeHandler(handler)
    assert out.getvalue() == "Encountered exception during execution: StageRefused(...)\n"
