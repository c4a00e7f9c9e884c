"""LightningModules: the training tasks."""

from .base import MoETask
from .classification import ImageClassifier
from .language_model import LanguageModel

__all__ = ["MoETask", "ImageClassifier", "LanguageModel"]
