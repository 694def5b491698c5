import sys

from mbd_jax.cli import main

sys.exit(main())
