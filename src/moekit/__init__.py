"""moekit: Mixture-of-Experts layers, timm models and Lightning + Hydra training."""

from moekit.utils.openmp import limit_spin

limit_spin()  # before torch loads OpenMP, which reads its settings once (moekit/utils/openmp.py)

__version__ = "0.1.0"
