"""Stage 3, PPO-max: its types (:mod:`~rlhf.ppo.types`) and settings (:mod:`~rlhf.ppo.config`) at the bottom, the
experience of a rollout (:mod:`~rlhf.ppo.rollout`) and its monitoring signals (:mod:`~rlhf.ppo.monitoring`), the
update (:mod:`~rlhf.ppo.update`), the pattern-collapse guard (:mod:`~rlhf.ppo.guard`) and the loop on top
(:mod:`~rlhf.ppo.loop`).

Imports the foundation, :mod:`rlhf.runtime`, :mod:`rlhf.data`, :mod:`rlhf.models` and :mod:`rlhf.training`.
Never its siblings, the reward trainer and evaluation: PPO reads the reward model as a model.
"""
