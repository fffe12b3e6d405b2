import gc

# Start-up (the command's imports: its classes, dataclasses and models)
# allocates ~85,000 objects that nearly all live as long as the process: the
# cyclic GC's passes over them freed next to nothing and took ~10 % of a short
# command's CPU. `cli.main` turns it back on once the command is parsed.
gc.disable()

from dispatcher.cli import main  # noqa: E402 - after the GC is off

raise SystemExit(main())
