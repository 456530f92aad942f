"""Stage 4 and the gates: the policy against SFT and the base model on held-out prompts
(:mod:`~rlhf.evaluation.evaluator`), per kind (:mod:`~rlhf.evaluation.by_kind`), paired comparisons, the
length-controlled win rate and best-of-N's arithmetic (:mod:`~rlhf.evaluation.comparison`), the
over-optimisation curve and best-of-N of the SFT model (:mod:`~rlhf.evaluation.overoptimisation`), what the
responses say (:mod:`~rlhf.evaluation.text_measures`), whether the judge's verdicts mean anything
(:mod:`~rlhf.evaluation.judge_trust`), the reward and policy gates' rules (:mod:`~rlhf.evaluation.gate_rules`) and
the arithmetic of a blind human review (:mod:`~rlhf.evaluation.review_tally`).

Imports the foundation, :mod:`rlhf.runtime`, :mod:`rlhf.data`, :mod:`rlhf.models` and :mod:`rlhf.training`.
Never its siblings, PPO and the reward trainer: it samples and scores through :mod:`rlhf.models`.
"""
