"""Notifications: events and finished actions sent where on-call people look (a JSON
webhook, Slack, Alertmanager), by routes in the settings.

- ``settings``: the routes as configured (sinks, matchers, where secrets come from);
- what is said about one event or action, and a delivery's record, is
  ``supervisor.notices`` (the store keeps deliveries, and imports nothing of this package);
- ``routing``: which routes a notice goes to;
- ``sinks``: the body each kind of receiver expects;
- ``delivery``: the background worker that records and sends deliveries, with retries.

Only ``delivery`` does I/O; the others are plain functions of their inputs.
"""
