"""``python -m fastdata`` (also what ``torchrun -m fastdata`` runs)."""
import sys

from .cli.main import main

sys.exit(main())
