"""``python -m ddptrain recipe=mnist ...``: see :mod:`ddptrain.cli`."""

from ddptrain.cli import main

if __name__ == "__main__":
    main()
