"""Lightning callbacks."""

from .capacity import CapacityTuner
from .moe_stats import ExpertLoadMonitor
from .slots import SlotPictureLogger
from .throughput import ThroughputLogger

__all__ = ["CapacityTuner", "ExpertLoadMonitor", "SlotPictureLogger", "ThroughputLogger"]
