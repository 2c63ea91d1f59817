"""`python -m titan_audit.cli` runs the titan-audit command line."""

from titan_audit.cli.main import main

main()
