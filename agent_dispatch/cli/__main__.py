import sys

from agent_dispatch.cli import main

sys.exit(main())
