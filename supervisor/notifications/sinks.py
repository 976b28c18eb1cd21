"""The request each kind of receiver expects for a notice: URL, headers and JSON body.

- webhook: the notice as a flat JSON object (documented in docs/notifications.md);
- slack: an incoming-webhook message, a `text` line plus two blocks;
- alertmanager: a list of alerts for `POST /api/v2/alerts`. Every alert ends by itself
  (`endsAt` = its start + `alert_duration_s`), since nothing sends it again; an event that
  clears a condition (node_recovered, straggler_recovered) also resolves the alerts it
  clears on the same node (and job, rank) at once, with `endsAt` = its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from supervisor.config_parts.notification_routes import Route
from supervisor.domain import EventType
from supervisor.notices import CLEARS, Notice, event_severity
from supervisor.notifications.routing import selects

SOURCE = "resiliency-supervisor"
ALERTS_PATH = "/api/v2/alerts"
#: Receivers can drop a delivery they already took (a retry after a lost answer).
DELIVERY_HEADER = "X-Supervisor-Delivery"

_EMOJI = {"critical": ":rotating_light:", "warning": ":warning:", "info": ":information_source:"}


@dataclass(frozen=True, slots=True)
class Request:
    url: str
    headers: dict[str, str]
    body: Any


@dataclass(frozen=True, slots=True)
class Links:
    """Where a person sees the notice: the dashboard's history filtered to it, and the
    record in the API. Both None without `public_url`."""

    dashboard: str | None
    api: str | None

    @classmethod
    def of(cls, notice: Notice, public_url: str | None) -> Links:
        if not public_url:
            return cls(None, None)
        base = public_url.rstrip("/")
        filters = {"type" if notice.kind == "event" else "action_type": notice.type}
        filters.update({k: v for k, v in (("node", notice.node), ("job", notice.job)) if v})
        return cls(f"{base}/#{urlencode(filters)}", f"{base}/api/v1/{notice.kind}s/{notice.id}")


def request_for(route: Route, notice: Notice, delivery_id: int, public_url: str | None) -> Request:
    sink = route.sink
    headers = {k: v.get_secret_value() for k, v in sink.headers.items()}
    headers[DELIVERY_HEADER] = str(delivery_id)
    url = sink.url.get_secret_value()
    links = Links.of(notice, public_url)
    if sink.type == "slack":
        return Request(url, headers, slack_body(notice, links))
    if sink.type == "alertmanager":
        own = selects(route, notice)
        duration = timedelta(seconds=sink.alert_duration_s)
        return Request(alerts_url(url), headers, alertmanager_body(notice, links, duration, own))
    return Request(url, headers, webhook_body(notice, links))


def webhook_body(notice: Notice, links: Links) -> dict[str, Any]:
    return {
        "source": SOURCE,
        **notice.to_json(),
        "url": links.dashboard,
        "api_url": links.api,
    }


def slack_body(notice: Notice, links: Links) -> dict[str, Any]:
    emoji = ":white_check_mark:" if notice.outcome == "succeeded" else _EMOJI[notice.severity]
    text = f"{emoji} {notice.summary}"
    lines = [f"*{_escape(text)}*"]
    if notice.reason:
        lines.append(_escape(notice.reason))
    if notice.error:
        lines.append(f"error: {_escape(notice.error)}")
    context = [f"{notice.time:%Y-%m-%d %H:%M:%S} UTC", f"{notice.kind} {notice.id}"]
    if links.dashboard:
        context.append(f"<{links.dashboard}|Open in the dashboard>")
    return {
        "text": text,
        "blocks": [
            {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": " · ".join(context)}]},
        ],
    }


def alertmanager_body(
    notice: Notice, links: Links, duration: timedelta, own: bool = True
) -> list[dict[str, Any]]:
    """The notice's own alert (when `own`), and resolutions of what it clears."""
    alerts = []
    if own:
        alert: dict[str, Any] = {
            "labels": _labels(notice, notice.type, notice.severity),
            "annotations": _annotations(notice),
            "startsAt": notice.time.isoformat(),
            "endsAt": (notice.time + duration).isoformat(),
        }
        if links.dashboard:
            alert["generatorURL"] = links.dashboard
        alerts.append(alert)
    if notice.kind == "event":
        for cleared in sorted(CLEARS.get(EventType(notice.type), ())):
            # No startsAt: Alertmanager then takes endsAt, and keeps the first start of
            # the alert this resolves (same labels).
            alerts.append(
                {
                    "labels": _labels(notice, cleared.value, event_severity(cleared)),
                    "annotations": {"summary": notice.summary},
                    "endsAt": notice.time.isoformat(),
                }
            )
    return alerts


def alerts_url(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith(ALERTS_PATH) else base + ALERTS_PATH


def _labels(notice: Notice, type_: str, severity: str) -> dict[str, str]:
    name = type_ if notice.kind == "event" else f"{type_}_{notice.outcome}"
    labels = {
        "alertname": "Supervisor" + "".join(w.capitalize() for w in name.split("_")),
        "severity": severity,
        "source": SOURCE,
    }
    if notice.kind == "action":
        labels["action"] = type_
    for key, value in (("node", notice.node), ("job", notice.job), ("rank", notice.rank)):
        if value is not None:
            labels[key] = str(value)
    return labels


def _annotations(notice: Notice) -> dict[str, str]:
    annotations = {"summary": notice.summary}
    description = "; ".join(
        part for part in (notice.reason, notice.error and f"error: {notice.error}") if part
    )
    if description:
        annotations["description"] = description
    return annotations


def _escape(text: str) -> str:
    """Slack's mrkdwn reads &, < and > as markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
