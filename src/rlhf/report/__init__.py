"""The run's report and figures: what the page is built from (:mod:`~rlhf.report.inputs`), its tables
(:mod:`~rlhf.report.tables`, :mod:`~rlhf.report.kind_tables`), one section per stage
(:mod:`~rlhf.report.sections`), the page (:mod:`~rlhf.report.render`, a Jinja template in ``templates/``) and
the training figures (:mod:`~rlhf.report.plots`, matplotlib).

Imports the foundation, :mod:`rlhf.runtime`, :mod:`rlhf.data`, :mod:`rlhf.models`, :mod:`rlhf.training`,
:mod:`rlhf.reward`, :mod:`rlhf.ppo` and :mod:`rlhf.evaluation`; nothing in the core imports it.
"""
