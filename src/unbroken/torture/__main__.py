"""``python -m unbroken.torture crash|corrupt``."""

from . import main

raise SystemExit(main())
