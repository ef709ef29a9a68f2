"""The tools users reach for around a run (DESIGN.md: export, audit, plan, diff, deep
verification). Each module registers its own ``unbroken`` subcommand(s) with
`unbroken._commands.tool`, listed with its module in `unbroken._commands.TOOLS`: ``cli.py``
imports a tool's module only to run one of its commands."""
