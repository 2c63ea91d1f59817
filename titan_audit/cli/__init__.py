"""cli/: the `titan-audit` command line. Thin click commands over the library; no logic here.

Exit codes: 0 ok, 1 a check found a difference, 2 bad input or usage.
"""
