"""Reward functions in TRL's convention, and their weighted combination with TRL's semantics.

A reward function is called as TRL 1.16's ``GRPOTrainer._calculate_rewards`` calls it, by
keyword only, with one entry per completion in every list::

    fn(prompts=..., completions=..., completion_ids=..., **columns,
       trainer_state=..., log_extra=..., log_metric=...)

- ``prompts``: each completion's prompt as its ``Sample`` holds it: text (TRL's standard
  format) or chat messages (conversational), as the data row gave it;
- ``completions``: text for a text prompt; for a chat prompt (TRL's "conversational" format)
  ``[{"role": "assistant", "content": text}]`` (the recipes decode with special tokens
  skipped, as TRL does);
- ``completion_ids``: the sampled token ids (lists of ints, the EOS included, as TRL's);
- ``columns``: the sample's dataset columns (``sample_columns``: every column of its row but
  ``prompt``), e.g. ``solution=[...]``;
- ``trainer_state``: a ``transformers.TrainerState`` (``global_step``: optimizer steps done,
  ``max_steps``), for rewards shaped by training progress;
- ``log_extra(column, values)`` adds a column to the completions table, ``log_metric(name,
  value)`` a scalar to the step's metrics.

So TRL's own functions (``trl.rewards.think_format_reward``, ...) and functions written for
TRL run unchanged; the built-ins here are written the same way::

    def my_reward(completions, answer, **kwargs) -> list[float | None]

A function returns one value per completion; ``None`` (or NaN) means "not applicable", as in
TRL. An ``async def`` function (or an object with an async ``__call__``) runs, as in TRL, after
the synchronous ones, together with the other async ones (``asyncio.gather``) on one event
loop in a daemon thread that a ``RewardSet`` starts and keeps for the run.

A function whose signature the call cannot bind is refused, never called with wrong
arguments: a positional-only parameter, a required parameter that is neither an argument TRL
passes nor a column of the data, or no ``**kwargs`` while TRL passes more than it names
(``signature_problem``; the config check runs it at load time on the data's columns, and
``RewardSet`` again before it calls any function on a batch). LongStraw's former
``fn(completions, samples)`` is one.

``RewardSet`` calls each function, stacks the columns into ``rewards_per_func`` ([N, F],
None -> NaN) and sums ``weight * reward`` across functions ignoring NaN (TRL's ``nansum``).
A row where every function gave NaN is *unscorable*: its reward stays NaN, as in TRL, and
``losses.group_advantages`` leaves it out of its group's mean and std and gives it zero
advantage (TRL's ``nan_to_num(advantages, nan=0.0)``).

Where LongStraw differs from TRL, on purpose:

- A function that raises (or returns the wrong number of values, or a non-number) has its
  column become NaN, so one bad custom reward does not kill a long run (TRL raises);
  ``raise_errors=True`` re-raises instead. Failures are tallied (``failures``) and logged
  one line per function with the count and the distinct sample ids: after each call, or,
  with ``report_each_call=False``, when the owner calls ``report_failures`` (once a step).
- An infinite value is treated as invalid (NaN), tallied the same way: in TRL it makes
  its group's mean infinite and every advantage NaN, hence 0.
- A finite value larger in magnitude than ``MAX_ABS_REWARD`` counts as a failure of that
  function: the group's mean and std of such values overflow, and every advantage would
  silently become 0.
- A call that takes longer than its timeout (``timeouts``; a run's
  ``rewards[i].timeout_seconds``, ``DEFAULT_TIMEOUT_SECONDS`` unless set) counts as a failure
  of that call, so a hung judge or a ``sleep`` cannot stall a run (TRL waits forever). Python
  cannot stop a thread: a synchronous function with a timeout runs in a daemon thread that
  the run stops waiting for; a call that times out is left running (it lingers until it
  returns, and the function is not called again meanwhile: its later batches fail at once).
  An async function is cancelled (``asyncio.wait_for``); one that blocks its event loop is
  left with that loop, and the later async calls get a new one. ``timeouts`` None: the call
  runs in the calling thread with no limit, as in TRL.
- ``SystemExit`` raised by a reward function is a failure of that call, the rule tools and
  environments follow (a client library calling ``sys.exit`` on an error must not end a long
  run). ``KeyboardInterrupt`` reaching a reward's thread is a request to stop: ``RewardError``
  naming the function, which the recipes turn into a one-line exit.

Import from here; the modules hold:

- ``inputs``: what TRL passes (``TRL_ARGUMENTS``, ``sample_columns``, ``as_completion``).
- ``builtins``: the built-in reward functions (``BUILTIN_REWARDS``) and the text helpers
  (``completion_text``, ``extract_answer``, ``parse_number``, ...).
- ``imports``: what a reward entry names (modules beside the config or in the working
  directory, factories with ``args``/``kwargs``, ``register_callable``).
- ``resolution``: ``resolve_reward``, ``callable_name``, ``signature_problem``,
  ``is_async_callable``.
- ``running``: timeouts, the errors, a call's outcome, the async functions' event loop.
- ``failures``: ``FailureReport``, the failures tallied until reported.
- ``reward_models``: reward models (TRL's ``reward_funcs`` strings): ``RewardModel``, a sequence
  classifier's directory or Hub id scored as TRL scores it.
- ``result``: ``RewardResult``, ``reward_metrics``, ``batch_columns``.
- ``reward_set``: ``RewardSet``, ``MAX_ABS_REWARD``, ``trainer_state_at`` (what TRL's functions
  get as ``trainer_state``).
"""

# The submodules' public names (their ``__all__``), so that each lists them once.
from longstraw_core.rewards import builtins, inputs, resolution
from longstraw_core.rewards.builtins import *  # noqa: F403
from longstraw_core.rewards.imports import CALLABLE_PREFIX, RewardNameError, register_callable
from longstraw_core.rewards.inputs import *  # noqa: F403
from longstraw_core.rewards.resolution import *  # noqa: F403
from longstraw_core.rewards.result import RewardResult, batch_columns, reward_metrics
from longstraw_core.rewards.reward_set import MAX_ABS_REWARD, RewardSet, trainer_state_at
from longstraw_core.rewards.running import (
    DEFAULT_TIMEOUT_SECONDS,
    RewardError,
    RewardTimeout,
    stop_error,
)

__all__ = [
    *builtins.__all__,
    *inputs.__all__,
    *resolution.__all__,
    "CALLABLE_PREFIX",
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_ABS_REWARD",
    "RewardError",
    "RewardNameError",
    "RewardResult",
    "RewardSet",
    "RewardTimeout",
    "batch_columns",
    "register_callable",
    "reward_metrics",
    "stop_error",
    "trainer_state_at",
]
