"""Lightning callbacks."""

from .capacity import CapacityTuner
from .guard import NonFiniteGuard, NonFiniteTrainingError
from .moe_stats import ExpertLoadMonitor
from .preemption import Preempted, PreemptionCheckpoint
from .progress_log import ProgressLog
from .routing_report import RoutingReport
from .slots import SlotPictureLogger
from .step_checkpoint import StepCheckpoint
from .throughput import ThroughputMonitor

__all__ = [
    "CapacityTuner",
    "ExpertLoadMonitor",
    "NonFiniteGuard",
    "NonFiniteTrainingError",
    "Preempted",
    "PreemptionCheckpoint",
    "ProgressLog",
    "RoutingReport",
    "SlotPictureLogger",
    "StepCheckpoint",
    "ThroughputMonitor",
]
