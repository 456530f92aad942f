"""Where and how the work runs: the device and precision of a stage (:mod:`~rlhf.runtime.device`), several
processes (:mod:`~rlhf.runtime.distributed`), FSDP sharding (:mod:`~rlhf.runtime.sharding`) and the stop at the
first non-finite loss or weight (:mod:`~rlhf.runtime.finite`).

Imports the foundation only (``rlhf.losses``, ``rlhf.stats``, ``rlhf.ranges``).
"""
