"""``python -m longstraw_core.scale_check``: see ``longstraw_core.scale_check.cli``."""

from longstraw_core.scale_check.cli import main

if __name__ == "__main__":
    main()
