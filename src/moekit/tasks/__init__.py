"""LightningModules: the training tasks."""

from .classification import ImageClassifier

__all__ = ["ImageClassifier"]
