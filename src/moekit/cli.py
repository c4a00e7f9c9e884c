"""The Hydra entry point shared by the scripts in ``scripts/``: compose the named config, run the
function, and turn user errors (bad config values, missing data or checkpoints) into a one-paragraph
message and exit status 1 instead of a traceback."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from moekit.run import USER_ERRORS


def run_script(fn: Callable[[DictConfig], Any], config_name: str, config_dir: Path) -> None:
    """Run ``fn(cfg)`` under ``@hydra.main`` with ``config_dir/config_name.yaml`` (command-line
    overrides and ``-m`` sweeps work as usual). Returns ``fn``'s result to Hydra (sweepers use it)."""

    @hydra.main(version_base="1.3", config_path=str(config_dir.resolve()), config_name=config_name)
    def main(cfg: DictConfig) -> Any:
        try:
            return fn(cfg)
        except USER_ERRORS as err:
            logging.getLogger("moekit").error("%s", err)
            sys.exit(1)

    main()
