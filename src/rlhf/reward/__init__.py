"""Stage 2, the Bradley-Terry reward model (and the judge, trained alike): its trainer
(:mod:`~rlhf.reward.trainer`), length bias and its correction (:mod:`~rlhf.reward.length_bias`), short replies as
extra rejected responses (:mod:`~rlhf.reward.augment`) and its measurements on held-out pairs
(:mod:`~rlhf.reward.metrics`).

Imports the foundation, :mod:`rlhf.runtime`, :mod:`rlhf.data`, :mod:`rlhf.models` and :mod:`rlhf.training`.
"""
