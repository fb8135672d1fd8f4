"""``python -m benchmarks`` is ``rayjobs bench``."""

from rayjobs.cli import main

if __name__ == "__main__":
    import sys

    main(["bench", *sys.argv[1:]])
