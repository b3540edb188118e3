import sys

from trainlib.plan.cli import main

sys.exit(main())
