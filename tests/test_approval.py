"""A person's approval before a policy takes the champion alias: Prefect's pause with input, for real (integration:
Prefect's test server and an MLflow sqlite store)."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from prefect import flow
from prefect.flow_runs import resume_flow_run
from pydantic import ValidationError
from test_gate import client

from flows.approval import PolicyApproval, await_approval, awaiting
from tasks.kit import registry

pytestmark = pytest.mark.integration
NAME = "rlhf-policy"


@flow(name="approval-test")
def wait_for_approval(report: dict, timeout_s: int) -> str:
    return await_approval(report, timeout_s, poll_s=1)


def awaiting_version(tiny_dir, folder: str) -> dict:
    """A policy version that passed its gate with approval required: its report."""
    from tasks.kit.registry import decide_once, register
    from tasks.kit.runs import tracking_client

    shutil.copytree(tiny_dir, folder)
    client_, experiment = tracking_client()
    run_id = client_.create_run(experiment).info.run_id
    found = register(client_, NAME, folder, run_id, {registry.SHA_TAG: registry.folder_sha256(folder)})
    decision = decide_once(client_, NAME, found, lambda: ([], {}), "approval test", move=False)
    assert decision["decision"] == "fail"  # no checks: never a pass by itself
    client_.set_model_version_tag(NAME, found.version, registry.APPROVAL_TAG, "awaiting")
    return {"candidate": {"name": NAME, "version": str(found.version)}, "awaiting_approval": True}


def test_no_answer_leaves_the_champion_and_an_approval_moves_it_with_the_reviewer(registry_project, tiny_dir):
    from prefect.testing.utilities import prefect_test_harness

    assert not awaiting({"candidate": {"name": NAME, "version": "1"}})  # no flag: nothing to wait for
    # None: the product's start-up timeout (flows/__init__.py, 180 s), not the harness's 30 s, which a CI run on a
    # busy 2-core machine missed while the test server migrated its database
    with prefect_test_harness(server_startup_timeout=None):
        report = awaiting_version(tiny_dir, "models/policy-1")
        assert awaiting(report)
        assert wait_for_approval(report, 2) == "timed out"
        assert registry.holder(client(), NAME) is None and not awaiting(report)
        assert client().get_model_version(NAME, "1").tags[registry.APPROVAL_TAG] == "timed out"

        report = awaiting_version(tiny_dir, "models/policy-2")
        outcome: list[str] = []
        runner = threading.Thread(target=lambda: outcome.append(wait_for_approval(report, 60)))
        runner.start()
        answer = {"approve": True, "reviewer": "ana", "reason": "read 20 samples side by side"}
        resumed = resume_paused_run(answer)
        runner.join(timeout=60)
        assert resumed and outcome == ["approved"]
    assert str(registry.holder(client(), NAME).version) == "2"
    (move,) = registry.history(client(), NAME)
    assert (move["by"], move["reason"], move["to"]) == ("approved by ana", "read 20 samples side by side", "2")


def resume_paused_run(answer: dict) -> bool:
    """Find the paused flow run and resume it with ``answer`` (as a person does in the UI)."""
    import asyncio

    from prefect.client.orchestration import get_client

    async def paused():
        async with get_client() as api:
            return [r.id for r in await api.read_flow_runs() if r.state and r.state.is_paused()]

    for _ in range(60):
        found = asyncio.run(paused())
        if found:
            resume_flow_run(found[0], run_input=answer)
            return True
        time.sleep(1)
    return False


@pytest.mark.parametrize(("reviewer", "reason"), [("x" * 189, "ok"), ("Ann", "why " * 300), ("", "ok"), ("Ann", "")])
def test_an_empty_or_over_long_reviewer_or_reason_is_refused_when_the_run_is_resumed(reviewer, reason):
    # "approved by " + reviewer is at most MAX_BY (200) and the reason at most MAX_REASON (1,000): nothing is cut
    with pytest.raises(ValidationError):
        PolicyApproval(approve=True, reviewer=reviewer, reason=reason)
    assert PolicyApproval(approve=True, reviewer="x" * 188, reason="why " * 250).reviewer == "x" * 188


ANSWERS = {
    "timed out": None,
    "rejected": PolicyApproval(approve=False, reviewer="ana", reason="samples too long"),
    "approved": PolicyApproval(approve=True, reviewer="ana", reason="read 20 samples"),
}


@pytest.mark.parametrize("outcome", list(ANSWERS))
@pytest.mark.parametrize("deleted", ["nothing", "the version", "the whole model"])
def test_every_ending_of_the_approval_says_one_line_also_for_a_version_deleted_while_it_waited(
    registry_project, tiny_dir, monkeypatch, outcome, deleted
):
    # Prefect's pause itself is the test above; here each answer it can return, with the version as a person left it
    import flows.approval

    report = awaiting_version(tiny_dir, "models/policy-1")
    if deleted == "the version":
        client().delete_model_version(NAME, "1")
    elif deleted == "the whole model":
        client().delete_registered_model(NAME)
    monkeypatch.setattr(flows.approval, "pause_flow_run", lambda **_: ANSWERS[outcome])
    lines: list[str] = []
    if deleted != "nothing" and outcome == "approved":
        with pytest.raises(registry.RegistryError, match="deleted while it awaited approval: nothing promoted"):
            await_approval(report, 1, say=lines.append)
        assert registry.holder(client(), NAME) is None
        return
    assert await_approval(report, 1, say=lines.append) == outcome
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    if deleted == "nothing":
        assert client().get_model_version(NAME, "1").tags[registry.APPROVAL_TAG] == outcome
        assert (registry.holder(client(), NAME) is not None) == (outcome == "approved")
    else:
        assert lines[1].endswith(f"{outcome}; it was deleted while it awaited approval, champion unchanged")
        assert not awaiting(report)
