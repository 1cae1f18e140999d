import sys

from mlx_qsa.cli import main

sys.exit(main())
