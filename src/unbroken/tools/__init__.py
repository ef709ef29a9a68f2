"""The tools users reach for around a run (DESIGN.md: export, audit, plan, diff, deep
verification). Each module registers its own ``unbroken`` subcommand(s) with
`unbroken._commands.command`; ``cli.py`` imports every module here, so a tool is one module."""
