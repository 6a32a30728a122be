"""`python -m app.cli`: the same commands as the `dsec` script."""

from app.cli.main import main

main()
