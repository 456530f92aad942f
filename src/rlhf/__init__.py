"""The core of the RLHF pipeline: SFT, a Bradley-Terry reward model and PPO-max, in torch and transformers.

Its groups, lowest first; a group imports only itself and the lower groups its package names
(``tests/test_layers.py`` holds that map, finds every import and fails on one the map refuses or one that goes
round in a circle; :mod:`rlhf.reward`, :mod:`rlhf.ppo` and :mod:`rlhf.evaluation` are siblings, none imports
another):

- foundation, the modules here: :mod:`rlhf.losses` (the equations, one pure function each),
  :mod:`rlhf.stats` (the one binomial interval and tie rule), :mod:`rlhf.ranges` (range checks of settings),
  :mod:`rlhf.files` (files written whole or not at all; no torch);
- :mod:`rlhf.runtime`: device and precision, several processes, FSDP sharding, non-finite checks;
- :mod:`rlhf.data`: reading sources, formats, chat encoding, splits, ptx rows, kinds of data, validation;
- :mod:`rlhf.models`: loading, forward passes, sampling and generation, LoRA, shared trunk and prompts, kind heads;
- :mod:`rlhf.training`: the supervised loop, checkpoints, SFT;
- :mod:`rlhf.reward`: the Bradley-Terry trainer, length bias, short-reply augmentation, its measurements;
- :mod:`rlhf.ppo`: PPO-max: types and config, rollout, monitoring, update, collapse guard, the loop;
- :mod:`rlhf.evaluation`: the policy against SFT and the base model, comparisons, text measures, gate rules,
  the human review's arithmetic;
- :mod:`rlhf.report`: the run's HTML page and the training figures.

The core never imports Prefect, MLflow or DVC, nor the stages around it (``tasks``, ``flows``): a trainer takes a
``log`` callback, and the stages (``tasks/<stage>.py``) do the tracking, the registry and the files.
"""
