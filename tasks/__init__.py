"""The pipeline's stages, one module each, each a DVC stage command (``python -m tasks.<stage>``); what they are
built from is in :mod:`tasks.kit`, the console commands in :mod:`tasks.cli`. No stage imports another.

The machines this runs on have no internet: telemetry of MLflow, Prefect and
DVC is off unless the environment says otherwise.
"""

import os

for _name, _value in (
    ("MLFLOW_DISABLE_TELEMETRY", "true"),
    ("DO_NOT_TRACK", "1"),
    ("DVC_NO_ANALYTICS", "1"),
    ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
    ("HF_HUB_DISABLE_TELEMETRY", "1"),
    ("TOKENIZERS_PARALLELISM", "false"),
):
    os.environ.setdefault(_name, _value)
