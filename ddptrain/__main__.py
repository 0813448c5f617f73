"""``python -m ddptrain recipe=mnist ...``: see :mod:`ddptrain.cli`."""

import sys

try:
    from ddptrain.cli import main
except KeyboardInterrupt:  # Ctrl-C in the first instants: the same one line as later in the start-up
    print("ddptrain: stopped by SIGINT (Ctrl-C): during start-up, nothing ran", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    main()
