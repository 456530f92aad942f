"""PPO's reward statistics per prompt kind (rlhf.ppo.moments, monitoring), checked against values by hand."""

from __future__ import annotations

import pytest
import torch

from rlhf.ppo.config import PPOConfig
from rlhf.ppo.moments import POOLED, RewardMoments, RunningMoments
from rlhf.ppo.monitoring import kind_reward_means

KINDS = ["harmless", "helpful", "harmless", "helpful"]


def test_each_kind_is_normalised_by_its_own_running_mean_and_std():
    moments = RewardMoments(per_kind=True)
    moments.update(torch.tensor([0.0, 1.0, 2.0, 3.0]), KINDS)
    # harmless [0, 2]: mean 1, std 1; helpful [1, 3]: mean 2, std 1
    moments.update(torch.tensor([4.0]), ["helpful"])
    # helpful [1, 3, 4]: mean 8/3, population var (25/9 + 1/9 + 16/9) / 3 = 14/9, std 1.24722
    out = moments.normalize(torch.tensor([3.0, 3.0]), ["harmless", "helpful"], clip=None)
    assert out.tolist() == pytest.approx([2.0, (3 - 8 / 3) / 14**0.5 * 3], abs=1e-6)
    assert moments.stats() == pytest.approx(
        {
            "ppo/reward/running/harmless/mean": 1.0,
            "ppo/reward/running/harmless/std": 1.0,
            "ppo/reward/running/helpful/mean": 8 / 3,
            "ppo/reward/running/helpful/std": 14**0.5 / 3,
        }
    )


def test_pooled_and_kindless_rows_share_one_stream():
    pooled = RewardMoments(per_kind=False)
    pooled.update(torch.tensor([0.0, 1.0, 2.0, 3.0]), KINDS)
    # all four: mean 1.5, population std sqrt(1.25) = 1.11803; 3 -> 1.34164, clipped at 1.2
    assert pooled.normalize(torch.tensor([3.0, 1.5]), ["harmless", "helpful"], clip=1.2).tolist() == pytest.approx(
        [1.2, 0.0]
    )
    assert list(pooled.streams) == [POOLED]
    kindless = RewardMoments(per_kind=True)
    kindless.update(torch.tensor([0.0, 1.0, 2.0, 3.0]), None)
    assert list(kindless.streams) == [POOLED]
    assert kindless.normalize(torch.tensor([3.0]), None, clip=None).tolist() == pytest.approx([1.5 / 1.25**0.5])


def test_a_kind_without_statistics_and_kinds_of_the_wrong_count_are_refused():
    moments = RewardMoments()
    moments.update(torch.tensor([1.0, 2.0]), ["harmless", "harmless"])
    with pytest.raises(RuntimeError, match="no reward statistics"):
        moments.normalize(torch.tensor([1.0]), ["helpful"], clip=None)
    with pytest.raises(ValueError, match="1 kinds for 2 reward scores"):
        moments.update(torch.tensor([1.0, 2.0]), ["harmless"])


def test_checkpoints_restore_every_stream_and_a_single_stream_checkpoint_starts_each_kind():
    moments = RewardMoments()
    moments.update(torch.tensor([0.0, 1.0, 2.0, 3.0]), KINDS)
    restored = RewardMoments()
    restored.load_state_dict(moments.state_dict())
    assert restored.stats() == moments.stats()
    # a checkpoint from before the streams: one RunningMoments over [0, 1, 2, 3] (mean 1.5, m2 5)
    single = RunningMoments()
    single.update(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    old = RewardMoments(kinds=["helpful", "harmless", "helpful"])
    old.load_state_dict(single.state_dict())
    old.update(torch.tensor([5.5]), ["helpful"])
    # helpful starts from [0, 1, 2, 3] and adds 5.5: mean 2.3, population var (5 + 4 * 4^2 / 5) / 5 = 3.56
    assert old.stats() == pytest.approx(
        {
            "ppo/reward/running/harmless/mean": 1.5,
            "ppo/reward/running/harmless/std": 1.25**0.5,
            "ppo/reward/running/helpful/mean": 2.3,
            "ppo/reward/running/helpful/std": 3.56**0.5,
        }
    )
    # saved before a harmless score came: the next resume still starts harmless from the old statistics
    again = RewardMoments(kinds=["harmless", "helpful"])
    again.load_state_dict(old.state_dict())
    again.update(torch.tensor([1.5]), ["harmless"])  # [0, 1, 2, 3, 1.5]: mean 1.5, count 5
    assert again.streams["harmless"].mean == pytest.approx(1.5)
    assert again.streams["harmless"].count == 5
    pooled = RewardMoments(per_kind=False, kinds=["harmless"])
    pooled.load_state_dict(single.state_dict())
    assert pooled.state_dict() == {POOLED: single.state_dict()}


@pytest.mark.parametrize("value", ["kinds", True])
def test_an_unknown_normalisation_is_refused(value):
    with pytest.raises(ValueError, match="reward_normalize must be per_kind, pooled or null"):
        PPOConfig(reward_normalize=value)


def test_each_kinds_mean_raw_score_is_reported_apart():
    raw = torch.tensor([0.5, -1.0, 1.5, 2.0], dtype=torch.float64)
    # harmless rows 0 and 2: (0.5 + 1.5) / 2 = 1.0; helpful rows 1 and 3: (-1 + 2) / 2 = 0.5
    assert kind_reward_means(raw, KINDS) == {"ppo/reward/kind/harmless/mean": 1.0, "ppo/reward/kind/helpful/mean": 0.5}
    assert kind_reward_means(raw, None) == {}
