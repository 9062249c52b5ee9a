"""``python -m weavepass.tune``: see ``weavepass.tune.command``."""

from weavepass.tune.command import main

if __name__ == "__main__":
    main()
