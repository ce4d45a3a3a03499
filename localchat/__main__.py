from localchat.cli import main

raise SystemExit(main())
