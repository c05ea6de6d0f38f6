"""``python tests/support/nccl_rules_run.py SCRIPT ARGS...``: run SCRIPT as ``python SCRIPT ARGS``
would, with NCCL's point-to-point rules enforced (``nccl_rules``) unless
``LONGSTRAW_NCCL_RULES=0``.

SCRIPT runs as ``__main__`` (``runpy.run_path``) with ``sys.argv`` = ``[SCRIPT, *ARGS]``,
``sys.path[0]`` its directory and ``__file__`` its path, as Python sets them (SCRIPT made
absolute: Python makes ``__file__`` and ``sys.path[0]`` absolute, and ``run_path`` puts its
path in ``sys.argv[0]``), so recipes, test workers and the test files that run themselves
under torchrun work unchanged. ``tests/support/launch.py`` puts every torchrun of the tests under
it.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python tests/support/nccl_rules_run.py SCRIPT [ARGS...]")
    import nccl_rules  # from this file's directory, still sys.path[0]

    if nccl_rules.enabled():
        nccl_rules.install()
    script = Path(sys.argv[1]).absolute()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
