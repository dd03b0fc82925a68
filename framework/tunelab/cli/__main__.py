"""``python -m tunelab.cli``: the same as the ``tunelab`` command."""

from tunelab.cli.main import main

if __name__ == "__main__":
    main()
