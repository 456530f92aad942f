"""One of several processes that open a new SQLite tracking store at the same moment (tests/test_gate.py).

Imports first, then waits for the test's go file, so every process reaches the store's creation together:
``python store_worker.py <index>`` in the project folder; prints the version it registered.
"""

import os
import sys
import time

from tasks.kit.registry import register
from tasks.kit.runs import StageRun, tracking_client

index = sys.argv[1]
open(f"ready-{index}", "w").close()
while not os.path.exists("go"):
    time.sleep(0.01)
client, experiment = tracking_client()
with StageRun("gate", {"index": index}) as stage:  # the pipeline's parent run: created once, however many start
    stage.log({"worker": float(index)}, 0)
run_id = client.create_run(experiment).info.run_id
print(register(client, "rlhf-reward-model", "folder", run_id, {"rlhf.sha256": index}).version)
