"""The `flashcupy` command from a checkout: `python cli.py ...` runs flashcupy.cli."""

from flashcupy.cli import main

if __name__ == "__main__":
    main()
