"""Supervised training: the loop every trainer shares (:mod:`~rlhf.training.supervised`), atomic files and
resumable checkpoints (:mod:`~rlhf.training.checkpoint`) and stage 1, SFT (:mod:`~rlhf.training.sft`).

Imports the foundation, :mod:`rlhf.runtime`, :mod:`rlhf.data` and :mod:`rlhf.models`.
"""
