"""A recipe's command line: ``main(Recipe, argv, ...)`` parses ``--config`` and ``key=value``
overrides, checks the config and the memory plan, runs ``setup`` / ``train`` / ``cleanup``,
and ends the process the way launchers and schedulers expect.

Why one function for every recipe: the one-line errors and exit codes are a contract
(``longstraw_core.process.exits``): a config, data or checkpoint problem exits 1 with one line
before any training; a diverged run or a failed checkpoint exits 1 on every rank; a stop
signal exits 128 + the signal after saving; a distributed run that finished skips gloo's
teardown. ``longstraw_core.training.trainer.train`` (the Python API) calls a recipe's ``main`` so
that it cannot drift from the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeVar

from longstraw_core import checkpoint, config, distributed, plan
from longstraw_core.data import samples as data
from longstraw_core.launch import settings as launch_settings
from longstraw_core.launch.preemption import exit_after_stop
from longstraw_core.process import exits, failure_causes, guard
from longstraw_core.rewards import RewardError, RewardNameError
from longstraw_core.tools import AgentError
from longstraw_core.training.session import Session

RunT = TypeVar("RunT", bound=Session)


def main(
    recipe: type[RunT],
    argv: list[str] | None,
    *,
    default_config: str | Path,
    description: str,
) -> RunT:
    """Run ``recipe`` as ``python <recipe file> [--config FILE] [key=value ...]``; returns
    the trained run (exits instead on an error or a stop signal). ``description``: the
    recipe's docstring; its first paragraph is ``--help``'s."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--config", default=str(default_config), help="a YAML under configs/")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=2")
    args = parser.parse_args(argv)
    try:
        cfg = config.load_config(args.config, args.overrides)
        # accelerate launch's settings (mixed_precision, FSDP, DeepSpeed, ...): each mapped
        # onto the run config or refused here, never silently ignored.
        cfg = launch_settings.honour(cfg)
    except (config.ConfigError, FileNotFoundError) as error:
        exits.fail(f"config error: {error}")
    try:  # before any weight is loaded: refuse a step the GPUs cannot hold
        plan.check_fits(cfg)
    except plan.MemoryPlanError as error:
        table = f"python -m longstraw_core.plan --config {args.config} prints the full table"
        exits.fail(f"memory plan: {error}\n({table})")
    run = recipe(cfg)

    def machine_failure(error: Exception) -> str:
        """The one line for out of memory, a collective's timeout, a lost write permission
        (``failure_causes``); anything else is re-raised with its traceback."""
        cause = failure_causes.cause_of(error, rank=exits.launch_rank(), config_file=args.config)
        if cause is None:
            raise error
        return cause

    try:
        run.setup()
    except config.ConfigError as error:
        exits.fail(f"config error: {error}")
    except data.DataError as error:
        exits.fail(f"data error: {error}")
    except checkpoint.CheckpointError as error:
        exits.fail(f"checkpoint error: {error}")
    except RewardNameError as error:  # a reward model's weights that do not load
        exits.fail(f"config error: rewards: {error}")
    except Exception as error:  # machine_failure re-raises what it cannot name
        exits.fail(f"setup stopped: {machine_failure(error)}", local=True)
    stopped, failure, together = None, None, False
    try:
        stopped = run.train()
        together = True
    except (guard.TrainingDiverged, checkpoint.CheckpointError) as error:  # raised on all ranks
        failure, together = f"training stopped: {error}", True
    except (RewardError, AgentError) as error:  # this rank's reward function or tools alone
        failure = f"training stopped: {error}"
    except Exception as error:  # machine_failure re-raises what it cannot name
        failure = f"training stopped: {machine_failure(error)}"  # this rank's, as it met it
    finally:
        run.cleanup(together=together)
    if failure:
        exits.fail(failure, local=not together)
    if stopped:  # SIGTERM/SIGINT/SIGHUP: the step finished and was saved
        exit_after_stop(
            stopped,
            f"stopped by {stopped.name} after step {run.step}/{cfg.train.steps}; "
            f"resume: the same command with train.resume_from=latest "
            f"(train.output_dir={cfg.train.output_dir})",
        )
    if run.world_size > 1:  # a distributed run is done on every rank: skip gloo's teardown
        distributed.exit_ranks()
    return run  # the trained run (longstraw_core.training.trainer.train returns it)
