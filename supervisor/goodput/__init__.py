"""Goodput analysis and checkpoint advice: pure computation, no I/O, except
the step sampler and the CLI.

- :mod:`.calculator_log`: the gpu-recipes goodput calculator's JSON-lines log and its
  goodput formula.
- :mod:`.model`: the input timeline (plain records) and the output report.
- :mod:`.breakdown`: goodput and badput breakdown of a timeline, built on
  :mod:`.step_computations` (attempts, step computations, kept or redone),
  :mod:`.time_labels` (labelled intervals and the sweep over them) and
  :mod:`.tier_stats` (per checkpoint tier figures).
- :mod:`.calculator_timeline`: the calculator's log as a timeline, and its breakdown.
- :mod:`.history`: a job's timeline from the supervisor's events, actions, checkpoint
  reports and step samples.
- :mod:`.advice`: checkpoint intervals per tier and MTBF, from
  :mod:`.checkpoint_intervals` (Young's and Daly's formulas).
- :mod:`.ramdisk`: ramdisk size per host for the in-memory tier.
- :mod:`.report`: text tables for the CLI, JSON-able dicts for the API.
- :mod:`.sampler`: the supervisor's periodic step samples (sensor -> store).
- :mod:`.cli`: `supervisor goodput` and `supervisor advise`, online or offline.
"""

from supervisor.goodput.advice import (
    CheckpointAdvice,
    MtbfEstimate,
    TierAdvice,
    TierInput,
    advise,
    advise_from_report,
    check_tier_frequencies,
    estimate_mtbf,
)
from supervisor.goodput.breakdown import compute_goodput, goodput_series, truncate
from supervisor.goodput.calculator_log import (
    CalculatorEvent,
    CalculatorEventType,
    CalculatorGoodput,
    CalculatorLogError,
    calculator_goodput,
    parse_calculator_log,
    parse_timestamp,
    read_calculator_log,
)
from supervisor.goodput.calculator_timeline import (
    goodput_from_calculator_log,
    timeline_from_calculator,
)
from supervisor.goodput.checkpoint_intervals import (
    daly_interval,
    expected_waste,
    interval_steps,
    young_interval,
)
from supervisor.goodput.model import (
    DURABLE_TIER,
    LOCAL_TIER,
    Badput,
    CheckpointLoaded,
    CheckpointSaved,
    FailureDetected,
    GoodputPoint,
    GoodputReport,
    JobStarted,
    JobStopped,
    Record,
    Remediation,
    ReplicaChange,
    StepReported,
    TierStats,
    Timeline,
)
from supervisor.goodput.ramdisk import RamdiskSizing, ramdisk_size_bytes, ramdisk_sizing
from supervisor.goodput.report import (
    advice_to_dict,
    goodput_to_dict,
    ramdisk_to_dict,
    render_advice_text,
    render_goodput_text,
    render_ramdisk_text,
)

__all__ = [
    "DURABLE_TIER",
    "LOCAL_TIER",
    "Badput",
    "CalculatorEvent",
    "CalculatorEventType",
    "CalculatorGoodput",
    "CalculatorLogError",
    "CheckpointAdvice",
    "CheckpointLoaded",
    "CheckpointSaved",
    "FailureDetected",
    "GoodputPoint",
    "GoodputReport",
    "JobStarted",
    "JobStopped",
    "MtbfEstimate",
    "RamdiskSizing",
    "Record",
    "Remediation",
    "ReplicaChange",
    "StepReported",
    "TierAdvice",
    "TierInput",
    "TierStats",
    "Timeline",
    "advice_to_dict",
    "advise",
    "advise_from_report",
    "calculator_goodput",
    "check_tier_frequencies",
    "compute_goodput",
    "daly_interval",
    "estimate_mtbf",
    "expected_waste",
    "goodput_from_calculator_log",
    "goodput_series",
    "goodput_to_dict",
    "interval_steps",
    "parse_calculator_log",
    "parse_timestamp",
    "ramdisk_size_bytes",
    "ramdisk_sizing",
    "ramdisk_to_dict",
    "read_calculator_log",
    "render_advice_text",
    "render_goodput_text",
    "render_ramdisk_text",
    "timeline_from_calculator",
    "truncate",
    "young_interval",
]
