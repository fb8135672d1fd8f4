"""``python -m rayjobs ...`` is the ``rayjobs`` command."""

from rayjobs.cli import main

if __name__ == "__main__":
    main()
