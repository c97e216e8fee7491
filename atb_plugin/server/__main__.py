import sys

from atb_plugin.server.cli import main

sys.exit(main())
