"""Scheduled operations on APScheduler 3: fault drills by cron or interval, maintenance
windows, and the supervisor's periodic work, with jobs kept in the supervisor's own
database and run by the acting supervisor only."""

from supervisor.schedules.scheduler import Scheduler

__all__ = ["Scheduler"]
