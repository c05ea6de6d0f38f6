"""Synthetic long-context tasks in the spirit of RULER: verifiable, deterministic, any length.

Each generator builds one ``Sample`` whose prompt, rendered for the given tokenizer (through
its chat template when ``chat=True`` and it has one), is within ``tolerance`` (1%) of
``prompt_tokens`` tokens, or 4 where that is more (``haystack.MIN_SLACK_TOKENS``). The prompt
is an instruction, a haystack of seeded filler sentences from a fixed word list (no
downloads, no digits, no capitals but a sentence's first letter, so needles cannot be
confused with filler) with the needle sentences inserted at sentence
boundaries at the requested depth (a fraction of the haystack's tokens, 0 = start, 1 = end),
and a question asking for the answer inside ``<answer></answer>`` tags.

    tok = load_tokenizer(None)
    s = passkey_retrieval(tok, prompt_tokens=16_384, depth=0.25, seed=7)
    stream = make_task_stream("kv_chain", tok, 131_072, seed=0, start=1000, hops=4)

Length fitting is cheap at a million tokens: the filler's token cost is estimated from the
per-word costs of its few hundred distinct word forms, then the whole prompt is tokenized
once per pass and the filler budget corrected; a few passes suffice.
Import from here; the modules hold one job each:

- ``haystack``: the filler text (``Filler``; filler words by default), the haystack with its
  needles, and ``fit_prompt`` (length fitting); knows nothing of the tasks.
- ``documents``: real text for a haystack: the standard library's docstrings
  (``DocumentFiller``), its modules split into training and held-out ones.
- ``sample``: ``Sample`` and what every generator builds with (seeded keys, numbers,
  variable names, needle depths; ``task_generator``, which makes a generator of a task's
  ``Draft``: its needles, question and answer).
- ``generators``: the task families, one draft each (``doc_lookup`` reads real documents).
- ``agent``: the agent task (``agent_lookup``), its environment (``VaultEnvironment``, the
  ``lookup`` tool) and its reward (``final_answer_match``).
- ``streams``: the registry ``TASKS`` and the deterministic streams (``sample_at``,
  ``make_task_stream``).
"""

from longstraw_core.data.tasks.agent import VaultEnvironment, agent_lookup, final_answer_match
from longstraw_core.data.tasks.documents import (
    STDLIB_MODULES,
    DocumentFiller,
    doc_modules,
    module_split,
    module_text,
)
from longstraw_core.data.tasks.generators import (
    DOC_KINDS,
    doc_lookup,
    kv_chain,
    multi_needle,
    passkey_retrieval,
    uuid_retrieval,
    variable_tracking,
)
from longstraw_core.data.tasks.haystack import FILLER_WORDS, MAX_FIT_PASSES, Filler, WordFiller
from longstraw_core.data.tasks.sample import ANSWER_INSTRUCTION, KEY_WORDS, Depth, Sample, TaskFn
from longstraw_core.data.tasks.streams import TASKS, make_task_stream, sample_at

__all__ = [
    "ANSWER_INSTRUCTION",
    "DOC_KINDS",
    "FILLER_WORDS",
    "KEY_WORDS",
    "MAX_FIT_PASSES",
    "STDLIB_MODULES",
    "TASKS",
    "Depth",
    "DocumentFiller",
    "Filler",
    "Sample",
    "TaskFn",
    "VaultEnvironment",
    "WordFiller",
    "agent_lookup",
    "doc_lookup",
    "doc_modules",
    "final_answer_match",
    "kv_chain",
    "make_task_stream",
    "module_split",
    "module_text",
    "multi_needle",
    "passkey_retrieval",
    "sample_at",
    "uuid_retrieval",
    "variable_tracking",
]
