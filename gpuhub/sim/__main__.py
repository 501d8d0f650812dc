from gpuhub.sim.cli import main

raise SystemExit(main())
