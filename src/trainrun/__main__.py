import sys

from trainrun.cli import main

sys.exit(main())
