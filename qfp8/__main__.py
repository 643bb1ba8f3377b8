import sys

from qfp8.cli import main

sys.exit(main())
