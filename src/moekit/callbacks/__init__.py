"""Lightning callbacks."""

from .throughput import ThroughputLogger

__all__ = ["ThroughputLogger"]
