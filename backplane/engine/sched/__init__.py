"""Scheduling: the continuous-batching scheduler and the typed step it returns."""

from backplane.engine.sched.output import ScheduledSeq, SchedulerOutput
from backplane.engine.sched.scheduler import Scheduler, SchedulerStats

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput", "SchedulerStats"]
