"""Models: loading them (:mod:`~rlhf.models.loading`), their forward passes (:mod:`~rlhf.models.forward`),
sampling (:mod:`~rlhf.models.sampling`) and generation scored by a reward model (:mod:`~rlhf.models.generation`),
LoRA (:mod:`~rlhf.models.lora`), frozen blocks computed once (:mod:`~rlhf.models.trunk`), one prompt shared by
several responses (:mod:`~rlhf.models.shared_prompt`) and the per-kind score heads (:mod:`~rlhf.models.kind_heads`).

Imports the foundation, :mod:`rlhf.runtime` and :mod:`rlhf.data`.
"""
