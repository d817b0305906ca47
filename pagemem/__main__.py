import sys

from pagemem.cli import main

sys.exit(main())
