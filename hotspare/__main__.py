import sys

from hotspare.cli.main import main

sys.exit(main())
