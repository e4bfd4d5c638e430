import sys

from trainvitals.cli import main

sys.exit(main())
