import sys

from flashpage.cli import main

sys.exit(main())
