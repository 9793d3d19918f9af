"""The words the watchdog stores and compares: rule states, decisions, journal entries.

Each is a string enum (stored in SQLite and JSON as its value, equal to that value), so a
status is never a bare string in the code, and a new one cannot be mistyped.
"""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A string enum: stored, compared and printed as its value."""

    def __str__(self) -> str:
        return str(self.value)


class RuleStatus(Word):
    """A rule's state, as Prometheus alerting rules have it."""

    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"
    RESOLVED = "resolved"


class DecisionKind(Word):
    """What the engine decided for a rule at a step."""

    FIRE = "fire"
    ESCALATE = "escalate"
    RESOLVE = "resolve"


class DecisionStatus(Word):
    """A decision's status. ``skipped``: nothing to do (a resolve, an action already covered, a dropped set).
    ``advised``: decided in advise mode: its actions were journaled and announced as what the watchdog would
    do, and none was carried out. ``waiting``: an action of it waits for a person (``--approve``: ``watchdog
    approve`` or ``deny``). ``denied``: a person refused its actions, or nobody answered in time."""

    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"
    SKIPPED = "skipped"
    ADVISED = "advised"
    WAITING = "waiting"
    DENIED = "denied"


class ActionStatus(Word):
    """A journal entry's status."""

    INTENT = "intent"
    """Written before acting."""
    SENT = "sent"
    """Carried out, awaiting confirmation."""
    WAITING = "waiting"
    """Deferred until the next checkpoint (a tuning set that needs a relaunch)."""
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"
    """A waiting set whose condition cleared before its relaunch."""
    ADVISED = "advised"
    """Advise mode: said as what would be done (its outcome: "would roll back to step 55 ..."), never done."""
    AWAITING = "awaiting"
    """Held for a person's ``watchdog approve`` or ``deny`` (``--approve KINDS``), until its deadline."""
    DENIED = "denied"
    """Refused by a person, or unanswered past its deadline: never carried out."""


class JournalKind(Word):
    """What a journal entry does."""

    LIVE_SET = "live_set"
    COMMAND = "command"
    RESTART = "restart"
    ROLLBACK = "rollback"
    NOTIFY = "notify"
    RESUME = "resume"
    STOP = "stop"


DECISION_STATUSES = tuple(s.value for s in DecisionStatus)
ACTION_STATUSES = tuple(s.value for s in ActionStatus)
OPEN_ACTION_STATUSES = (ActionStatus.INTENT.value, ActionStatus.SENT.value, ActionStatus.WAITING.value,
                        ActionStatus.AWAITING.value)
APPROVE_KINDS = ("rollback", "relaunch", "pause", "stop")
"""What ``--approve`` may hold for a person: a rollback, a relaunch (a restart of the trainer), a pause, a stop."""
