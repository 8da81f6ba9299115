"""`python -m dspark.cli`."""
from dspark.cli.commands import main

raise SystemExit(main())
