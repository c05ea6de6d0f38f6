"""The model families: each module declares one family and registers its adapter.

The adapter contract they implement lives in ``longstraw_core.adapters``; the core finds this
package through the ``longstraw.families`` entry point (``pyproject.toml``) and imports it,
which registers the families in the order the tables list them (hence the import order).
"""

# isort: off
from model_adapters import dense, qwen36, glm52, gpt_oss

# isort: on

__all__ = ["dense", "glm52", "gpt_oss", "qwen36"]
