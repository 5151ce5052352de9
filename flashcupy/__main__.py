"""`python -m flashcupy ...` runs the `flashcupy` command."""

from .cli import main

if __name__ == "__main__":
    main()
