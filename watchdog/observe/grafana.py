"""Push dashboards to Grafana and post an annotation for each action the watchdog takes.

A thin I/O shell over grafana-client. The token comes from the environment
(``GRAFANA_TOKEN``) or a file, never from the command line (argv is world-readable in
``ps``) and never into a log line or an exception message: :class:`GrafanaToken` hides
it from ``repr`` and :func:`redact_url` strips credentials from URLs before logging.

Grafana's documented API, as used here:

- ``POST /api/dashboards/db`` with ``{"dashboard": {...}, "overwrite": true, "folderUid"?: "..."}``
- ``POST /api/annotations`` with ``{"time": ms, "timeEnd"?: ms, "tags": [...], "text": "...",
  "dashboardUID"?: "..."}``
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ppo_watchdog.protocol import inputs

log = logging.getLogger(__name__)

#: Environment variable holding the Grafana base URL (annotations are posted only when set).
URL_ENV = "GRAFANA_URL"
#: Environment variable holding the Grafana service-account token.
TOKEN_ENV = "GRAFANA_TOKEN"
#: Environment variable naming a file that holds the token (Docker/Kubernetes secrets).
TOKEN_FILE_ENV = "GRAFANA_TOKEN_FILE"


class GrafanaError(RuntimeError):
    """A Grafana request failed; names the URL (without credentials), the path and the reason."""


class TokenError(ValueError):
    """No usable token: names the file or variable it was looked for in (never the token)."""


class GrafanaToken:
    """A bearer token that never shows itself in ``repr``/``str`` (so never in logs or tracebacks)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        value = value.strip()
        if not value:
            raise TokenError("Grafana token is empty")
        self._value = value

    def reveal(self) -> str:
        """The token itself, for the Authorization header only."""
        return self._value

    def __repr__(self) -> str:
        return "GrafanaToken(***)"

    __str__ = __repr__


def load_token(
    token_file: Path | str | None = None, env: Mapping[str, str] | None = None,
) -> GrafanaToken | None:
    """The token from ``token_file``, else ``$GRAFANA_TOKEN_FILE``, else ``$GRAFANA_TOKEN``; None when none is set.

    A named file that is missing or empty is an error (someone meant to configure a token).
    """
    env = os.environ if env is None else env
    path = token_file or env.get(TOKEN_FILE_ENV)
    if path:
        try:
            text = inputs.read_text(path)
        except OSError as exc:
            raise TokenError(f"cannot read Grafana token file {path}: {exc.strerror}") from None
        if not text.strip():
            raise TokenError(f"Grafana token file {path} is empty")
        return GrafanaToken(text)
    value = env.get(TOKEN_ENV)
    # An empty variable counts as unset: compose's ${GRAFANA_TOKEN:-} passes "" when there is none.
    if value is not None and value.strip():
        return GrafanaToken(value)
    return None


def redact_url(url: str) -> str:
    """``url`` without user and password, for log lines and error messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class Annotation:
    """One Grafana annotation, in the body's shape of ``POST /api/annotations``."""

    time_ms: int
    """Start, Unix epoch milliseconds."""
    text: str
    """What happened (Grafana renders it in the tooltip)."""
    tags: tuple[str, ...]
    """Tags; dashboards select annotations by tag."""
    time_end_ms: int | None = None
    """End for a region annotation (e.g. a rollback's span), else None."""
    dashboard_uid: str | None = None
    """Pin to one dashboard; None makes it an organisation-wide annotation found by tags."""

    def to_json(self) -> dict[str, Any]:
        """The request body (optional fields omitted, not null)."""
        body: dict[str, Any] = {"time": self.time_ms, "tags": list(self.tags), "text": self.text}
        if self.time_end_ms is not None:
            body["timeEnd"] = self.time_end_ms
        if self.dashboard_uid is not None:
            body["dashboardUID"] = self.dashboard_uid
        return body


def action_annotation(
    run: str, rule: str, kind: str, outcome: str, step: int | None = None, message: str = "",
    ts: float | None = None, dashboard_uid: str | None = None,
) -> Annotation:
    """The annotation for one watchdog action; tagged so the "PPO run" dashboard shows it.

    Pure: ``ts`` (Unix seconds) defaults to now only when not given.
    """
    when = time.time() if ts is None else ts
    at = f" at step {step}" if step is not None else ""
    text = f"watchdog: {rule} -> {kind} ({outcome}){at} on run {run}"
    if message:
        text += f": {message}"
    # The dashboard builders (grafana_foundation_sdk, about 3 MiB) only where used: every command of the CLI,
    # each daemon shard among them, imports this module.
    from ppo_watchdog.observe.dashboards import ACTION_TAG, TAG

    tags = (ACTION_TAG, TAG, f"run:{run}", f"rule:{rule}", f"action:{kind}", f"outcome:{outcome}")
    return Annotation(int(round(when * 1000)), text, tags, dashboard_uid=dashboard_uid)


class Grafana:
    """A Grafana server reached with a bearer token; thin wrapper over grafana-client."""

    def __init__(self, url: str, token: GrafanaToken | None = None, timeout: float = 10.0) -> None:
        from grafana_client import GrafanaApi  # heavy import (niquests); only where Grafana is used

        self.url = url.rstrip("/")
        self._safe_url = redact_url(self.url)
        credential = token.reveal() if token is not None else None
        self._api = GrafanaApi.from_url(self.url, credential=credential, timeout=timeout)

    def __repr__(self) -> str:
        return f"Grafana({self._safe_url!r})"

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return self._api.client.POST(path, json=body)
        except Exception as exc:  # grafana-client raises its own hierarchy and niquests errors
            # The library's messages carry the response body, not our headers; the URL is redacted.
            raise GrafanaError(f"POST {self._safe_url}/api{path} failed: {type(exc).__name__}: {exc}") from None

    def push_dashboard(
        self, dashboard: dict[str, Any], folder_uid: str | None = None, overwrite: bool = True,
        message: str | None = None,
    ) -> dict[str, Any]:
        """Create or replace a dashboard (``POST /api/dashboards/db``); returns Grafana's reply."""
        body: dict[str, Any] = {"dashboard": dict(dashboard), "overwrite": overwrite}
        # An id from an export would clash with another Grafana's ids; the fixed uid identifies it.
        body["dashboard"].pop("id", None)
        if folder_uid is not None:
            body["folderUid"] = folder_uid
        if message is not None:
            body["message"] = message
        reply = self._post("/dashboards/db", body)
        log.info("pushed dashboard %s to %s", dashboard.get("uid"), self._safe_url)
        return reply if isinstance(reply, dict) else {"reply": reply}

    def annotate(self, annotation: Annotation) -> dict[str, Any]:
        """Post one annotation (``POST /api/annotations``); returns Grafana's reply (``{"id": ...}``)."""
        reply = self._post("/annotations", annotation.to_json())
        log.debug("annotation posted to %s: %s", self._safe_url, annotation.text)
        return reply if isinstance(reply, dict) else {"reply": reply}


def push_all(
    grafana: Grafana, folder_uid: str | None = None, names: Sequence[str] | None = None,
) -> list[str]:
    """Push the generated dashboards (all, or those whose file names are given); returns their uids."""
    from ppo_watchdog.observe.dashboards import DASHBOARDS

    uids = []
    for name, build in DASHBOARDS.items():
        if names is not None and name not in names:
            continue
        d = build()
        grafana.push_dashboard(d, folder_uid=folder_uid)
        uids.append(str(d["uid"]))
    return uids


class ActionAnnotator:
    """What the controller calls per action when a Grafana URL is configured.

    The signature starts like the actuator's ``on_action(run, rule, kind, outcome)`` hook. Failures
    are logged and counted, never raised: a Grafana outage must not stop a remediation. With
    ``background=True`` posts go through a queue and one worker thread, so a slow or unreachable
    Grafana never delays the tick that took the action; :meth:`close` drains the queue.
    """

    def __init__(
        self, grafana: Grafana, dashboard_uid: str | None = None, background: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.grafana = grafana
        self.dashboard_uid = dashboard_uid
        self.failures = 0
        """Annotations that could not be posted."""
        self.posted = 0
        """Annotations Grafana accepted."""
        self._clock = clock
        self._queue: queue.Queue[Annotation | None] | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=1000)
            self._worker = threading.Thread(target=self._drain, name="grafana-annotations", daemon=True)
            self._worker.start()

    def __call__(
        self, run: str, rule: str, kind: str, outcome: str, step: int | None = None,
        message: str = "", ts: float | None = None,
    ) -> bool:
        """Post (or queue) the annotation for one action; False (and a warning) when it could not be."""
        ann = action_annotation(run, rule, kind, outcome, step, message,
                                self._clock() if ts is None else ts, self.dashboard_uid)
        if self._queue is not None:
            try:
                self._queue.put_nowait(ann)
            except queue.Full:
                self.failures += 1
                log.warning("Grafana annotation queue full; dropped: %s", ann.text)
                return False
            return True
        return self._post(ann)

    def _post(self, ann: Annotation) -> bool:
        try:
            self.grafana.annotate(ann)
        except GrafanaError as exc:
            self.failures += 1
            log.warning("could not annotate action in Grafana: %s", exc)
            return False
        self.posted += 1
        return True

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            ann = self._queue.get()
            try:
                if ann is None:
                    return
                self._post(ann)
            finally:
                self._queue.task_done()

    def close(self, timeout: float = 10.0) -> None:
        """Post what is queued (up to ``timeout`` seconds) and stop the worker."""
        if self._queue is None or self._worker is None:
            return
        self._queue.put(None)
        self._worker.join(timeout)
        self._queue = None
        self._worker = None


def annotator_from_env(
    url: str | None = None, token_file: Path | str | None = None, dashboard_uid: str | None = None,
    env: Mapping[str, str] | None = None, background: bool = True,
) -> ActionAnnotator | None:
    """An :class:`ActionAnnotator` when a Grafana URL is configured (``url`` or ``$GRAFANA_URL``), else None.

    The token comes from ``token_file``, ``$GRAFANA_TOKEN_FILE`` or ``$GRAFANA_TOKEN``.
    """
    env = os.environ if env is None else env
    url = url or env.get(URL_ENV)
    if not url:
        return None
    token = load_token(token_file, env)
    if token is None:
        log.warning("Grafana URL %s configured without a token: annotations may be refused", redact_url(url))
    return ActionAnnotator(Grafana(url, token), dashboard_uid, background=background)
