from ._launch import main

raise SystemExit(main())
