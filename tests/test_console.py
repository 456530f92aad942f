"""What a person sees of a pipeline run: a stage's output relayed to its log, its loud lines and bar; the end line's
figures; the verdict; and a stage's warnings on one line."""

from __future__ import annotations

import io
import warnings

from flows.console import CLEAR, relay
from flows.summary import figure, headline, verdict
from tasks.kit.console import QUIET_ENV, quiet_libraries


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
