"""Telling a peft model apart without importing peft.

Why: peft imports bitsandbytes whenever it is installed, and bitsandbytes imports torch's
compiler stack: about 2 s of a process's start that the planner, the config checks and
anything else that does not train never need (training loads peft anyway: transformers'
scheduler module imports it). A ``PeftModel`` can only exist once peft has been imported,
so a model is one exactly when peft is loaded and the model is an instance of its class.
Modules that need peft's functions import them where they use them.
"""

from __future__ import annotations

import sys
from typing import Any


def is_peft_model(model: Any) -> bool:
    """``isinstance(model, peft.PeftModel)``, without importing peft."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)
