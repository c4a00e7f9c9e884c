"""Puts moekit's MoE recipes (``moekit.recipes``, one YAML file each) on Hydra's config search path, so that
every config of the template, whichever is primary, composes ``moe=<recipe>`` from the same files the timm
registry reads. Hydra finds this plugin in the ``hydra_plugins`` namespace package."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class MoekitRecipesSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="moekit", path="pkg://moekit.recipes")
