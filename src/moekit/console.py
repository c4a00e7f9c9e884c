"""What the commands print: each message once, in Hydra's format, without the libraries' advertisements and
deprecation notices (which a user cannot act on).

Lightning gives its top logger a console handler of its own (``INFO: ...``) and lets records propagate to the
root logger too, where Hydra's handler prints them again with a timestamp. :func:`tidy_library_output` (run by
``moekit.cli.run_script`` once the command's modules are imported) removes Lightning's handler when the root
logger has one, drops Lightning's tip advertising its cloud logger, and ignores the ``DeprecationWarning`` /
``FutureWarning`` that Lightning, torch, timm and torchmetrics raise about each other's APIs.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["tidy_library_output"]

_LIBRARIES = r"(lightning|lightning_utilities|torch|torchmetrics|timm)(\.|$)"
_ADVERTISEMENTS = ("💡 Tip:",)


class _DropAdvertisements(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_ADVERTISEMENTS)


def tidy_library_output() -> None:
    """Each Lightning message once (through the root logger's handlers when it has any), no advertisements,
    no library-internal deprecation warnings. Idempotent."""
    lightning = logging.getLogger("lightning")
    if logging.getLogger().handlers:
        for handler in list(lightning.handlers):
            if type(handler) is logging.StreamHandler:
                lightning.removeHandler(handler)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertisements) for f in logger.filters):
            logger.addFilter(_DropAdvertisements())
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=_LIBRARIES)
