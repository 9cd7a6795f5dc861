import sys

from kvjax.cli import main

sys.exit(main())
