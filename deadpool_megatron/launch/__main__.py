import sys

from deadpool_megatron.launch.launcher import main

sys.exit(main())
