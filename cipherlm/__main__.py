import sys
from cipherlm.cli import main

sys.exit(main())
