"""Stage reward: train the reward model on rm_train (initialised from SFT), centre it, measure it on rm_eval.

Writes ``models/reward/``, ``metrics/reward.json`` and ``reports/reward_margins.png``
(the histogram of chosen - rejected scores, paper figure 2) together, after everything that can
fail (:class:`tasks.kit.outputs.StagedOutputs`): a failed or stopped run leaves the previous ones as they were.
"""

from __future__ import annotations

from typing import Any

from rlhf.data.chat import check_reads_whole
from rlhf.reward.trainer import RewardConfig
from tasks.kit import paths
from tasks.kit.common import cli
from tasks.kit.configs import config_from_params, longest_response
from tasks.kit.outputs import StagedOutputs
from tasks.kit.params import stage_params
from tasks.kit.registry import register, version_tags
from tasks.kit.runs import tracking_client
from tasks.kit.scalar import check_depth, run, summary_lines, write_outputs
from tasks.kit.stage import training_stage

TRAIN, EVAL, SFT = paths.split("rm_train"), paths.split("rm_eval"), paths.SFT
OUT_DIR, FIGURE = paths.REWARD, paths.REWARD_MARGINS


def register_version(folder: str, metrics: dict[str, float], params: dict[str, Any], run_id: str) -> str:
    """Register the trained model (``folder``) as a new version of ``registry.reward_model``, the gate's candidate.

    The last thing the stage does before its outputs are put in place: a registry that cannot be reached
    fails the stage and leaves its previous outputs as they were. Returns the line to print.
    """
    name = stage_params("registry")["reward_model"]
    client, _ = tracking_client()
    tags = version_tags(folder, params, [TRAIN, EVAL])
    found = register(client, name, folder, run_id, tags, params, metrics)
    return f"[reward] registered {name} version {found.version} (the gate stage decides on it)"


def main() -> None:
    """DVC stage command."""
    params, device = stage_params("reward"), stage_params("device")
    prompt_tokens, longest = stage_params("ppo")["max_prompt_length"], longest_response(stage_params)

    def check() -> None:  # the params, one line each, before any process starts
        config = config_from_params(RewardConfig, params, "reward")
        check_reads_whole("reward.max_length", config.max_length, ("ppo.max_prompt_length", prompt_tokens), longest)
        check_depth("reward", config.num_hidden_layers, SFT)

    def finish(stage, outputs: StagedOutputs, trained) -> list[str]:
        metrics, figure = trained
        write_outputs(stage, outputs, metrics, "rm/steps", figure, FIGURE, "reward")
        return [
            *summary_lines(metrics),
            register_version(outputs.staged(OUT_DIR), metrics, params, stage.run.info.run_id),
        ]

    training_stage(
        "reward",
        {**params, "device": device},
        device,
        check,
        lambda log, outputs: run(
            params, log, outputs, device, splits=(TRAIN, EVAL), init=SFT, out=OUT_DIR, stage="reward"
        ),
        finish,
    )


if __name__ == "__main__":
    cli(main)
