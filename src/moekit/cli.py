"""The Hydra entry point shared by the scripts in ``scripts/``: compose the named config, run the
function, and turn user errors (bad config values, missing data or checkpoints) into a one-paragraph
message and exit status 1 instead of a traceback.

In a sweep (``-m``) a failing job does not stop the others: its error is logged in one line and kept in its
folder (``failure.json``), the sweep runs every job, and :class:`SweepSummary` writes
``<sweep dir>/sweep_summary.json`` (which settings failed and why) and exits with status 1 if any failed.

A sweep resumes: a job that finished keeps its overrides and return value in its folder (``finished.json``), and
the same sweep run again into the same folder (``hydra.sweep.dir=<its folder>``) skips each job whose folder holds
the same settings finished, returning the recorded value (to Optuna too, whose seeded sampler proposes the same
trials again); ``skip_finished=false`` reruns them. The summary lists the skipped jobs."""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import ValueType
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from moekit import recipes
from moekit.configs import check_composed
from moekit.console import tidy_library_output
from moekit.utils.allocator import use_fast_allocator
from moekit.utils.atomic import write_json_atomic, write_text_atomic

__all__ = ["RunDirCheck", "SearchSpaceCheck", "SweepSummary", "run_script", "user_message"]

FAILURE_FILE = "failure.json"
FINISHED_FILE = "finished.json"  # a sweep job that finished: its overrides and what it returned
SUMMARY_FILE = "sweep_summary.json"
log = logging.getLogger("moekit")

# The "pkg.module.ErrorClass: " that starts the last line of a formatted traceback.
_EXCEPTION_PREFIX = re.compile(r"^[A-Za-z_][\w.]*: ")
# Hydra plugins of the `sweeps` extra: (group, option) -> the module the option needs and the package that has it.
_SUBMITIT = ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher")
_HYDRA_PLUGINS = {
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    ("hydra/launcher", "submitit_local"): _SUBMITIT,
    ("hydra/launcher", "submitit_slurm"): _SUBMITIT,
}


def user_message(err: BaseException) -> str:
    """The text of a user error, without the worker traceback a ``DataLoader`` worker adds.

    An exception raised in a worker process reaches the main process re-created from a message that
    starts ``Caught ValueError in DataLoader worker process 0.`` and holds the worker's whole
    traceback; the user needs only the original message (the traceback's last entry)."""
    text = str(err)
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return text
    lines = text.rstrip("\n").splitlines()
    # Traceback frames are indented; the exception itself starts at column 0 after the last frame.
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=0)
    return _EXCEPTION_PREFIX.sub("", "\n".join(lines[last_frame + 1 :]), count=1) or text


class RunDirCheck(Callback):
    """Hydra callback (``configs/hydra/default.yaml``): the folder Hydra is about to create for the
    run (``hydra.run.dir``, from ``paths.log_dir``) or the sweep must be creatable. Hydra itself would
    fail on it with a traceback; this stops with one line naming the folder and exit status 1."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config, "hydra.sweep.dir")

    @staticmethod
    def _check(config: DictConfig, key: str) -> None:
        HydraConfig.instance().set_config(config)  # resolves ${hydra:runtime.cwd}; run_job sets it again
        folder = Path(str(OmegaConf.select(config, key)))
        # The parent (e.g. logs/train/runs): the run folder's own name holds the time, which may tick.
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            logging.basicConfig(format="%(message)s")
            logging.getLogger("moekit").error(
                "cannot create the run folder %s (%s: %s); set paths.log_dir to a folder you can write to",
                folder,
                type(err).__name__,
                err.strerror or err,
            )
            sys.exit(1)


class SweepSummary(Callback):
    """Hydra callback (``configs/hydra/default.yaml``): at the end of a sweep, read which of its jobs failed
    (their ``failure.json``), write ``<sweep dir>/sweep_summary.json``, log one line per failed job and exit
    with status 1 if any did. The jobs of this sweep are the folders whose ``.hydra`` Hydra wrote since it started
    (a value with a ``/`` nests its folder); those of an earlier sweep into the same folder are left out."""

    _start = float("inf")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # A job's files older than this were written by an earlier sweep (less 0.1 s: files are stamped by the
        # kernel's coarse clock, a tick behind time.time())
        self._start = time.time() - 0.1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
        written = (p for p in sweep_dir.glob("**/.hydra/overrides.yaml") if p.stat().st_mtime >= self._start)
        jobs = sorted(p.parent.parent for p in written)
        failed, skipped = [], []
        for job in jobs:
            name = job.relative_to(sweep_dir).as_posix()
            failure = job / FAILURE_FILE
            if failure.is_file():
                failed.append({"job": name, **json.loads(failure.read_text())})
            finished = job / FINISHED_FILE
            if finished.is_file() and finished.stat().st_mtime < self._start:
                skipped.append(name)
        summary = {"jobs": len(jobs), "succeeded": len(jobs) - len(failed), "failed": failed, "skipped": skipped}
        if skipped:
            log.info(
                "sweep: skipped %d jobs that had finished already (%s); skip_finished=false reruns them",
                len(skipped),
                ", ".join(skipped),
            )
        write_json_atomic(sweep_dir / SUMMARY_FILE, summary)
        if not failed:
            log.info("sweep: all %d jobs finished (%s)", len(jobs), sweep_dir / SUMMARY_FILE)
            return
        lines = [f"  {' '.join(f['overrides']) or '(no overrides)'}: {f['error']}" for f in failed]
        log.error(
            "sweep: %d of %d jobs failed (%s):\n%s", len(failed), len(jobs), sweep_dir / SUMMARY_FILE, "\n".join(lines)
        )
        sys.exit(1)


class SearchSpaceCheck(Callback):
    """Hydra callback (``configs/hydra/default.yaml``): every key a sweeper's search space varies
    (``hydra.sweeper.params``, e.g. ``hparams_search/``) must be a setting of the composed config; Hydra would
    fail on the first trial instead, deep in the sweep. Stops with one paragraph naming the key and exit 1."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
        job = OmegaConf.masked_copy(config, [key for key in config if key != "hydra"])
        missing = object()
        for key in params:
            name = str(key).lstrip("+~")
            if str(key).startswith("+") or OmegaConf.select(job, name, default=missing) is not missing:
                continue
            logging.basicConfig(format="%(message)s")
            log.error(
                "hydra.sweeper.params: %s is not a setting of this config, so no trial could set it; %s (a new key "
                "needs a leading +)",
                name,
                _did_you_mean(job, name),
            )
            sys.exit(1)


def _did_you_mean(config: DictConfig, key: str, groups: tuple[str, ...] = ()) -> str:
    """``did you mean trainer.max_epochs?`` for a dotted ``key`` that ``config`` lacks, each part of it spelt as the
    closest key at its level (``trainr.max_epochz`` too; ``groups``: config group names that also count at the top);
    ``check its spelling`` when some part comes close to nothing."""
    node: Any = config
    parts = []
    for depth, part in enumerate(key.split(".")):
        names = [str(name) for name in node] if isinstance(node, DictConfig) else []
        names += [group for group in groups if depth == 0 and group not in names]
        if part not in names:
            close = difflib.get_close_matches(part, names, n=1)
            if not close:
                return "check its spelling"
            part = close[0]
        parts.append(part)
        node = OmegaConf.select(node, part, default=None, throw_on_resolution_failure=False) if node else None
    return f"did you mean {'.'.join(parts)}?"


def _group_folders(config_dir: Path, group: str) -> list[Path]:
    """The folders of config group ``group``'s options (``moe``: the recipes' too)."""
    folders = [config_dir / group]
    if group == "moe":
        folders.append(Path(recipes.__file__).parent / "moe")
    return [folder for folder in folders if folder.is_dir()]


def _options_with(config_dir: Path, key: str) -> list[str]:
    """``mod=interleaved`` for ``mod.capacity``: the options of the config group ``key`` starts with whose own file
    sets ``key``."""
    group, _, rest = key.partition(".")
    found, missing = [], object()
    for folder in _group_folders(config_dir, group) if rest else []:
        for path in sorted(folder.rglob("*.yaml")):
            try:
                node = OmegaConf.load(path)
            except Exception:  # not a config this can read: skip it
                continue
            if "@package" in path.read_text().partition("\n")[0] or not isinstance(node, DictConfig):
                continue
            if OmegaConf.select(node, rest, default=missing, throw_on_resolution_failure=False) is not missing:
                found.append(f"{group}={path.relative_to(folder).with_suffix('').as_posix()}")
    return sorted(set(found))


def _first_of_sweeps(args: list[str]) -> list[str] | None:
    """The overrides of ``args`` with each sweep (``a=1,2``, ``range(...)``, ``choice(...)``) replaced by its first
    value, an interval sweep left out: one job of the sweep, whose keys are the sweep's; None when Hydra's grammar
    refuses them (Hydra reports that itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [arg for arg in args if "=" in arg and not arg.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        single = []
        for text, override in zip(overrides, parsed, strict=True):
            if not override.is_sweep_override():
                single.append(text)
            elif override.value_type != ValueType.INTERVAL_SWEEP:
                single.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
    except Exception:  # a grammar error, an empty sweep: Hydra's to report
        return None
    return single


def _check_override_keys(config_dir: Path, config_name: str, args: list[str]) -> None:
    """A misspelt key (``trainer.max_epochz=1``, of a single run or a ``-m`` sweep): Hydra would advise adding it
    with ``+``, which the run then refuses as a key nothing reads. Compose the config first (a fifth of a second;
    a sweep's first job) and, where a key is not in it, stop with the setting that was meant, or the group option
    that has it (``mod.capacity`` needs ``mod=interleaved``). Anything else Hydra reports itself, as it would."""
    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in args):  # --cfg, --help: Hydra's own
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    def composed(overrides: list[str]) -> DictConfig:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)

    overrides = _first_of_sweeps(args)
    if overrides is None:
        return
    try:
        composed(overrides)
        return
    except ConfigCompositionException as err:
        unknown = re.match(r"Could not override '([^']+)'", str(err))
        if unknown is None or "not in struct" not in str(err.__cause__):
            return
        key = unknown.group(1)
    try:
        config = composed([o for o in overrides if o.partition("=")[0] != key])
    except ConfigCompositionException:
        return
    logging.basicConfig(format="[%(name)s][%(levelname)s] - %(message)s")
    options = _options_with(config_dir, key)
    group = key.partition(".")[0]
    chosen = [value for name, _, value in (o.partition("=") for o in overrides) if name.lstrip("+") == group]
    if options:
        instead = f", not of {group}={chosen[-1]}" if chosen else ""
        pick = options[0] if len(options) == 1 else "one of them"
        hint = f"it is a setting of {', '.join(options)}{instead}: put {pick} on the command line"
    else:
        groups = tuple(sorted(p.name for p in config_dir.iterdir() if p.is_dir() and p.name != "hydra"))
        adding = "a new key needs a leading +, and is refused when nothing reads it"
        hint = f"{_did_you_mean(config, key, groups)} ({adding})"
    log.error("%s is not a setting of this config; %s", key, hint)
    sys.exit(1)


def _missing_hydra_plugin(config_dir: Path, args: list[str]) -> str | None:
    """What a ``hydra/sweeper=optuna`` or ``hydra/launcher=submitit_*`` on the command line, or an ``hparams_search=``
    config that selects one, lacks when its plugin is not installed (Hydra itself only says it cannot find the
    option); None when nothing is missing."""
    chosen = []  # (group, option, where it was chosen)
    for key, _, value in (arg.lstrip("+").partition("=") for arg in args if "=" in arg and arg[0] != "-"):
        chosen.append((key, value, "on the command line"))
        search = config_dir / "hparams_search" / f"{value}.yaml"
        if key == "hparams_search" and search.is_file():
            for group, option in re.findall(r"override /(hydra/\w+): (\w+)", search.read_text()):
                chosen.append((group, option, f"in hparams_search={value}"))
    for group, option, where in chosen:
        module, package = _HYDRA_PLUGINS.get((group, option), (None, None))
        try:
            installed = module is None or importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # no hydra_plugins package at all
            installed = False
        if not installed:
            return (
                f"{group}={option} ({where}) needs the {package} package, which is not installed; install it with "
                f"pip install -e '.[sweeps]' (or pip install {package})"
            )
    return None


def _finished_job(job_dir: Path, overrides: list[str]) -> dict | None:
    """The ``finished.json`` of a sweep job's folder when it records these ``overrides``, in any order (else None)."""
    path = job_dir / FINISHED_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("overrides"), list):
        return None
    return record if sorted(record["overrides"]) == sorted(overrides) else None


def _job_failed(err: Exception, user_error: bool) -> None:
    """A sweep job's failure: one line (a traceback too for an unexpected error), kept in the job's folder."""
    message = " ".join((user_message(err) if user_error else f"{type(err).__name__}: {err}").split())
    if user_error:
        log.error("%s", message)
    else:
        log.exception("the job failed with an unexpected error")
    hydra_cfg = HydraConfig.get()
    record = {"overrides": list(hydra_cfg.overrides.task), "error": message}
    write_json_atomic(Path(hydra_cfg.runtime.output_dir) / FAILURE_FILE, record)


def _check_unquoted_non_ascii(args: list[str]) -> None:
    """Hydra's override grammar reads non-ASCII characters (a path like ``/data/données``) only inside quotes
    and otherwise fails with a lexer error; say so with the quoted override to type instead."""
    for arg in args:
        key, sep, value = arg.partition("=")
        quoted = len(value) >= 2 and value[0] in "'\"" and value[-1] == value[0]
        if sep and not arg.startswith("-") and not value.isascii() and not quoted:
            logging.basicConfig(format="[%(name)s][%(levelname)s] - %(message)s")
            log.error(
                "%s: Hydra reads non-ASCII characters in a value only inside quotes; write it as '%s=\"%s\"' "
                "(the outer single quotes keep the double ones from the shell)",
                arg,
                key,
                value,
            )
            sys.exit(1)


def _earlier_run_record(args: list[str]) -> dict[Path, str]:
    """The ``.hydra/*.yaml`` of an existing run folder that a command runs into again (``hydra.run.dir=<run>``, as a
    resume does): Hydra rewrites them with this command's config before it starts, so a command that is refused
    writes them back (:func:`_put_back`), and the folder keeps the record of the run it holds."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.run.dir" and (Path(value) / ".hydra").is_dir():
            return {path: path.read_text() for path in (Path(value) / ".hydra").glob("*.yaml")}
    return {}


def _put_back(record: dict[Path, str]) -> None:
    for path, text in record.items():
        write_text_atomic(path, text)


def _resolve(fn: Callable[[DictConfig], Any] | str) -> Callable[[DictConfig], Any]:
    if callable(fn):
        return fn
    module_name, _, name = fn.partition(":")
    return getattr(importlib.import_module(module_name), name)


def run_script(fn: Callable[[DictConfig], Any] | str, config_name: str, config_dir: Path) -> None:
    """Run ``fn(cfg)`` under ``@hydra.main`` with ``config_dir/config_name.yaml`` (command-line
    overrides and ``-m`` sweeps work as usual). Returns ``fn``'s result to Hydra (sweepers use it).

    ``fn`` may be given as ``"module:function"``: it is then imported after the config is composed,
    so a mistyped key or group fails in a fraction of a second instead of after importing torch and
    Lightning."""

    @hydra.main(version_base="1.3", config_path=str(config_dir.resolve()), config_name=config_name)
    def main(cfg: DictConfig) -> Any:
        hydra_cfg = HydraConfig.get()
        in_sweep = hydra_cfg.mode == RunMode.MULTIRUN
        job_dir = Path(hydra_cfg.runtime.output_dir)
        if in_sweep:  # a rerun of the sweep into the same folders: the job's earlier failure no longer holds
            (job_dir / FAILURE_FILE).unlink(missing_ok=True)
            finished = _finished_job(job_dir, list(hydra_cfg.overrides.task))
            if finished is not None and cfg.get("skip_finished", True):
                log.info("skipped: this setting finished already (%s); skip_finished=false reruns it", job_dir)
                return finished["return"]
            (job_dir / FINISHED_FILE).unlink(missing_ok=True)
        try:  # before torch is imported: a config that cannot run fails in a fraction of a second
            check_composed(cfg, hydra_cfg.overrides.task)
        except ValueError as err:
            if in_sweep:
                return _job_failed(err, user_error=True)
            log.error("%s", err)
            _put_back(earlier_run)
            sys.exit(1)
        function = _resolve(fn)
        tidy_library_output()  # once the command's libraries are imported
        from moekit.errors import USER_ERRORS

        try:
            result = function(cfg)
        except USER_ERRORS as err:
            if in_sweep:
                return _job_failed(err, user_error=True)
            log.error("%s", user_message(err))
            _put_back(earlier_run)
            sys.exit(1)
        except Exception as err:
            if not in_sweep:
                _put_back(earlier_run)
                raise
            return _job_failed(err, user_error=False)
        if in_sweep:
            record = {"overrides": list(hydra_cfg.overrides.task), "return": result}
            write_json_atomic(job_dir / FINISHED_FILE, record)
        return result

    _check_unquoted_non_ascii(sys.argv[1:])
    if missing := _missing_hydra_plugin(config_dir, sys.argv[1:]):
        logging.basicConfig(format="[%(name)s][%(levelname)s] - %(message)s")
        log.error("%s", missing)
        sys.exit(1)
    _check_override_keys(config_dir, config_name, sys.argv[1:])
    earlier_run = _earlier_run_record(sys.argv[1:])
    use_fast_allocator()  # before anything heavy: may restart this process with tcmalloc preloaded
    main()
