"""A person's typed approval before a policy takes the champion alias (params.yaml ``registry.policy_approval``).

With ``required: true`` the evaluate stage does not move the policy's alias when the policy passes its
gate; it tags the version ``rlhf.approval: awaiting``. The pipeline flow then pauses (Prefect's pause with
input) until a person resumes the flow run with a :class:`PolicyApproval` (in the Prefect UI, or
``prefect.flow_runs.resume_flow_run(id, run_input={...})``). An approval moves the alias, recorded with
the reviewer and the reason; a rejection or no answer within ``timeout_s`` leaves the champion as it was.
"""

from __future__ import annotations

from typing import Any

from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import Field

from flows.console import say
from tasks.kit.registry import (
    APPROVAL_TAG,
    MAX_BY,
    MAX_REASON,
    RegistryError,
    existing_version,
    move_alias,
    set_version_tag,
)
from tasks.kit.runs import tracking_client


class PolicyApproval(RunInput):
    """What a person types to resume the paused flow; an empty or over-long reviewer or reason is refused when the
    flow run is resumed (a record cut short would not say what the person wrote)."""

    approve: bool
    reviewer: str = Field(min_length=1, max_length=MAX_BY - len("approved by "))
    reason: str = Field(min_length=1, max_length=MAX_REASON)


def awaiting(report: dict[str, Any]) -> bool:
    """Whether the policy of ``report`` passed its gate and still waits for a person (its ``rlhf.approval`` tag),
    so a later run with evaluate up to date does not ask again about a version already answered."""
    if not report.get("awaiting_approval"):
        return False
    client, _ = tracking_client()
    found = existing_version(client, report["candidate"]["name"], report["candidate"]["version"])
    return found is not None and found.tags.get(APPROVAL_TAG) == "awaiting"


def await_approval(report: dict[str, Any], timeout_s: int, poll_s: int = 10, say=say) -> str:
    """Pause the running flow until a person approves or rejects the policy of ``report``; act on the answer.

    Args:
        report: the evaluate stage's ``reports/policy_gate.json`` (candidate name and version).
        timeout_s: seconds to wait; poll_s: how often the flow looks for an answer.
        say: where the waiting line goes.

    Returns:
        ``approved``, ``rejected`` or ``timed out`` (also stored as the version's ``rlhf.approval`` tag while the
        version exists). A rejection or a time-out of a version deleted while it waited is said in one line.

    Raises:
        RegistryError: an approval of a version deleted while it waited (nothing to promote), or the registry
            cannot be reached (one line each).
    """

    name, version = report["candidate"]["name"], report["candidate"]["version"]
    say(
        f"[flow] policy {name} version {version} passed its gate: waiting up to {timeout_s} s for a person's "
        "approval (resume this flow run with approve, reviewer, reason)"
    )
    try:
        answer = pause_flow_run(wait_for_input=PolicyApproval, timeout=timeout_s, poll_interval=poll_s)
    except FlowPauseTimeout:
        answer = None
    client, _ = tracking_client()
    outcome = "timed out" if answer is None else "approved" if answer.approve else "rejected"
    if existing_version(client, name, version) is None:
        if outcome == "approved":
            raise RegistryError(
                f"registry: {name} version {version} was approved by {answer.reviewer} but deleted while it awaited "
                "approval: nothing promoted, champion unchanged"
            )
        say(
            f"[flow] policy {name} version {version}: {outcome}; it was deleted while it awaited approval, "
            "champion unchanged"
        )
        return outcome
    if outcome == "approved":
        move_alias(client, name, version, f"approved by {answer.reviewer}", answer.reason)
    set_version_tag(client, name, version, APPROVAL_TAG, outcome)
    say(
        f"[flow] policy {name} version {version}: {outcome}" + ("" if outcome == "approved" else ", champion unchanged")
    )
    return outcome
